"""Run a command as a child subreaper and record how each process of it that ends here ended.

    python tests/exit_statuses.py STATUSES.json -- command [args ...]

With Linux's PR_SET_CHILD_SUBREAPER this process becomes the parent of every descendant whose own
parent is gone: when Slurm signals every process of a job, horovodrun's middlemen and shells die
at once and the ranks they started end here, so their own exit status can be read (horovodrun
reports its middlemen's). STATUSES.json gets {pid: exit status, -N for killed by signal N} of every
process reaped here, the command's included, once the last one has ended; the exit status is the
command's. The test signals the job's processes, never this one (as slurmstepd is not).
"""

import ctypes
import json
import os
import sys

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def main():
    out, separator, *command = sys.argv[1:]
    if separator != "--" or not command:
        sys.exit("usage: python tests/exit_statuses.py STATUSES.json -- command [args ...]")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        try:
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    statuses = {}
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        statuses[pid] = os.waitstatus_to_exitcode(status)
    with open(out, "w") as f:
        json.dump(statuses, f)
    code = statuses[child]
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
