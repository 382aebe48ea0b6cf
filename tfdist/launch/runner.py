"""`tfdist-run`: one command line for horovodrun (Gloo), mpirun and Slurm's srun.

```bash
tfdist-run -np 2 python train.py --epochs 3                 # horovodrun -np 2 --gloo ...
tfdist-run -np 8 -H node1:4,node2:4 python train.py         # two hosts over ssh, Gloo
tfdist-run --launcher mpirun -np 4 python train.py          # needs Horovod built with MPI
tfdist-run -np 8 python train.py                            # inside a Slurm allocation: srun
tfdist-run --dry-run -np 2 python train.py                  # print the command, run nothing
```

Every rank starts as `python -m tfdist -- <command>`: its share of the node's cores, thread
counts and oneDNN are set per rank before the command's Python (and TensorFlow) starts
(`tfdist.tuning.startup`; `--no-tuning` launches the command as it is).

`--launcher auto` (the default) picks srun inside a Slurm allocation (`SLURM_JOB_ID` set and
`srun` on the PATH), else horovodrun. A leading `python`/`python3` becomes this interpreter
(`sys.executable`), so the ranks run in the environment tfdist is installed in. The launched
command is printed first (stderr), and its exit status is tfdist-run's.

Before launching, a missing script (`python missing.py`) or program is refused, naming it, when
every rank runs on this host (`check_command`). tfdist-run stays the launcher's parent: a failed
job ends with one line naming the first rank that failed, its host and the cause
(`tfdist.launch.job_summary`).
"""

import argparse
import os
import re
import shlex
import shutil
import socket
import sys

from tfdist.errors import TfdistError
from tfdist.launch.hosts import parse_host_slots

LAUNCHERS = ("auto", "horovodrun", "mpirun", "srun")


class UsageError(TfdistError):
    """A tfdist-run command line that cannot be launched (printed without a traceback)."""


def parse_hosts(hosts):
    """'node1:2,node2:2' -> [('node1', 2), ('node2', 2)]; a host without ':N' has 1 slot."""
    return parse_host_slots(hosts.split(","), f"-H {hosts!r}", error=UsageError)


_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")


def script_of(command):
    """The script of `python [options] script.py ...`; None for -c, -m, stdin or another program."""
    if not command or not _PYTHON.match(os.path.basename(command[0])):
        return None
    args = iter(command[1:])
    for arg in args:
        if arg == "--":
            return next(args, None)
        if arg == "-" or arg in ("--help", "--version", "-h", "-V"):
            return None
        if not arg.startswith("-"):
            return arg
        if arg == "--check-hash-based-pycs":
            next(args, None)
            continue
        for i, flag in enumerate(arg[1:]):  # short options, possibly combined: -uB, -Wignore, -X dev
            if flag in "cm":
                return None
            if flag in "WX":
                if i == len(arg) - 2:
                    next(args, None)
                break
    return None


def local_only(launcher, hosts, env=None):
    """Whether every rank runs on this host (so a file missing here is missing for them too)."""
    env = os.environ if env is None else env
    if launcher == "srun" or (launcher == "mpirun" and not hosts and any(env.get(v) for v in ALLOCATION_VARIABLES)):
        return False
    here = {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0]}
    return not hosts or all(name in here for name, _ in parse_hosts(hosts))


def check_command(command, local=True):
    """Refuse (`UsageError`) a command whose program or Python script does not exist here.

    Done when every rank runs on this host (`local`); otherwise the same finding is a warning,
    since the ranks' hosts may hold what this one lacks."""
    if not command:
        return
    program, problem = command[0], None
    if "/" in program and not (os.path.isfile(program) and os.access(program, os.X_OK)):
        problem = f"program {program!r} does not exist or is not executable"
    elif "/" not in program and shutil.which(program) is None:
        problem = f"program {program!r} is not on the PATH"
    elif (script := script_of(command)) is not None and not os.path.isfile(script):
        problem = f"script {script!r} does not exist in {os.getcwd()}"
    if problem is None:
        return
    if not local:
        print(f"tfdist-run: warning: {problem} on this host ({socket.gethostname()}); the ranks' "
              "hosts must have it", file=sys.stderr)
        return
    raise UsageError(f"{problem} (host {socket.gethostname()}); no rank was started. Fix the "
                     "command (spelling, path, or the directory you run tfdist-run from).")


def resolve_launcher(launcher, env=None):
    env = os.environ if env is None else env
    if launcher != "auto":
        return launcher
    return "srun" if env.get("SLURM_JOB_ID") and shutil.which("srun") else "horovodrun"


def _tool(name):
    """The launcher next to this interpreter, else on the PATH, else its bare name (checked later)."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.access(beside, os.X_OK) else (shutil.which(name) or name)


_INSTALL_HINTS = {  # what to do when a launcher is missing
    "horovodrun": "Horovod is not installed in this environment: run `tfdist-install-horovod` "
                  "(in a tfdist checkout: `bash scripts/bootstrap.sh`)",
    "mpirun": "install an MPI (Debian: openmpi-bin libopenmpi-dev), then run `tfdist-install-horovod` again",
}


def not_found(tool):
    """The error for a launcher that is neither next to this interpreter nor on the PATH."""
    hint = _INSTALL_HINTS.get(os.path.basename(tool))
    return f"{tool} not found next to {sys.executable} or on the PATH" + (f": {hint}" if hint else "")


def build_command(launcher, command, np=None, hosts=None, extra=(), env=None, as_root=None):
    """The argv that launches `command` on `np` ranks with `launcher` (horovodrun, mpirun, srun).

    `as_root` (default: whether this process runs as root) adds Open MPI's
    `--allow-run-as-root`, which mpirun needs to start as root (containers).
    """
    env = os.environ if env is None else env
    as_root = os.geteuid() == 0 if as_root is None else as_root
    if not command:
        raise UsageError("no command to launch (e.g. tfdist-run -np 2 python train.py)")
    command = list(command)
    if command[0] in ("python", "python3"):
        command[0] = sys.executable
    host_slots = parse_hosts(hosts) if hosts else None
    if np is None and host_slots:
        np = sum(slots for _, slots in host_slots)
    if np is not None and np < 1:
        raise UsageError(f"-np {np}: need at least 1 rank")
    if launcher == "horovodrun":
        if np is None:
            raise UsageError("-np is required with horovodrun (or give -H host:slots,...)")
        argv = [_tool("horovodrun"), "-np", str(np), "--gloo"]
        if hosts:
            argv += ["-H", ",".join(f"{h}:{s}" for h, s in host_slots)]
    elif launcher == "mpirun":
        if np is None:
            raise UsageError("-np is required with mpirun (or give -H host:slots,...)")
        argv = [_tool("mpirun")] + (["--allow-run-as-root"] if as_root else []) + ["-np", str(np)]
        if hosts:
            argv += ["-H", ",".join(f"{h}:{s}" for h, s in host_slots)]
        elif not any(env.get(v) for v in ALLOCATION_VARIABLES):
            # As horovodrun: N slots on this host, however many cores it has (Open MPI counts cores).
            argv += ["-H", f"localhost:{np}"]
        # tfdist.tuning.startup pins each rank to its share of the node's cores; mpirun must not bind too.
        argv += ["-bind-to", "none", "-map-by", "slot"]
        for name in sorted(env):
            if name in MPI_FORWARD or (name.startswith(MPI_FORWARD_PREFIXES) and name not in MPI_NO_FORWARD):
                argv += ["-x", name]
    elif launcher == "srun":
        argv = [_tool("srun")]
        if np is not None:
            argv += [f"--ntasks={np}"]
        if host_slots:
            argv += [f"--nodelist={','.join(h for h, _ in host_slots)}"]
            slots = {s for _, s in host_slots}
            if len(slots) == 1:
                argv += [f"--ntasks-per-node={slots.pop()}"]
            else:  # unequal counts: one line per task in SLURM_HOSTFILE (see srun_hostfile_lines)
                argv += ["--distribution=arbitrary"]
        argv += ["--kill-on-bad-exit=1"]
    else:
        raise UsageError(f"--launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    return argv + list(extra) + command


# Resource managers whose allocation mpirun reads itself (then no -H localhost:N).
ALLOCATION_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE")
# Forwarded to every rank with -x (Open MPI copies the environment to local ranks only).
MPI_FORWARD = ("PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
MPI_FORWARD_PREFIXES = ("PYTHON", "TFDIST_", "HOROVOD_", "TF_", "KERAS_", "NCCL_")
MPI_NO_FORWARD = ("TF_CONFIG",)  # a worker list for MWMS, meaningless to Horovod's ranks


def srun_hostfile_lines(hosts, np=None):
    """SLURM_HOSTFILE for `srun --distribution=arbitrary`: task i runs on line i's host, so
    '-H n1:3,n2:1' places 3 tasks on n1 and 1 on n2 (srun alone has no per-node counts)."""
    lines = [name for name, slots in parse_hosts(hosts) for _ in range(slots)]
    if np is not None and np > len(lines):
        raise UsageError(f"-np {np} is more than the {len(lines)} slots of -H {hosts}")
    return lines[:np] if np is not None else lines


def horovod_has_mpi():
    """Whether this Horovod was built with MPI (imports horovod.tensorflow, hence TensorFlow)."""
    from tfdist import collectives

    return bool(collectives.horovod().mpi_built())


NO_MPI = ("this Horovod was built without MPI (`horovodrun -cb` lists no MPI), so mpirun would start "
          "processes that each train alone. Use the default launcher (horovodrun --gloo) or srun, or "
          "install an MPI (e.g. libopenmpi-dev) and run `tfdist-install-horovod` again (it then builds "
          "with MPI).")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="tfdist-run", description="Launch a tfdist training script on several ranks.", allow_abbrev=False,
        usage="tfdist-run [-np N] [-H host:slots,...] [--launcher auto|horovodrun|mpirun|srun] "
              "[--max-restarts N [--min-np K] [--host-discovery-script PATH] [--global-batch B]] "
              "[--dry-run] command [args ...]")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, help="number of ranks")
    parser.add_argument("-H", "--hosts", help="host:slots,... (default: this host)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="auto")
    parser.add_argument("--launcher-args", default="", help="extra arguments for the launcher, one string")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("--no-tuning", action="store_true",
                        help="do not apply tfdist's per-rank settings before the command starts")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="relaunch a failed job up to N times; it resumes from its Checkpointer "
                             "checkpoint (see docs/faults/RESTARTS.md)")
    parser.add_argument("--min-np", type=int, metavar="K",
                        help="a relaunch may use fewer ranks, down to K, when hosts are gone")
    parser.add_argument("--host-discovery-script", metavar="PATH",
                        help="prints host:slots lines; run before every launch (instead of -H)")
    parser.add_argument("--global-batch", type=int, metavar="B",
                        help="with --min-np: relaunch only on rank counts that divide B")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    supervised = bool(args.max_restarts or args.min_np is not None or args.host_discovery_script)
    from tfdist.tuning import startup

    startup.undo()  # the ranks apply their own settings, not this launcher's
    command = list(args.command)
    if command and command[0] in ("python", "python3"):
        command[0] = sys.executable
    user_command = command
    if command and not args.no_tuning:
        command = [sys.executable, "-m", "tfdist", "--", *command]
    try:
        launcher = resolve_launcher(args.launcher)
        if supervised:
            return _supervise(args, launcher, command, user_command)
        argv_out = build_command(launcher, command, args.np, args.hosts,
                                 shlex.split(args.launcher_args))
        hostfile = None
        if launcher == "srun" and "--distribution=arbitrary" in argv_out:
            import tempfile

            lines = srun_hostfile_lines(args.hosts, args.np)
            with tempfile.NamedTemporaryFile("w", prefix="tfdist-hosts-", suffix=".txt", delete=False) as f:
                f.write("\n".join(lines) + "\n")
            hostfile = os.environ["SLURM_HOSTFILE"] = f.name
            print(f"tfdist-run: SLURM_HOSTFILE={hostfile}: {' '.join(lines)}", file=sys.stderr)
        if launcher == "mpirun" and not horovod_has_mpi():
            if not args.dry_run:
                raise UsageError(f"--launcher mpirun: {NO_MPI}")
            print(f"tfdist-run: warning: {NO_MPI}", file=sys.stderr)
    except UsageError as e:
        print(f"tfdist-run: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(argv_out))
        return 0
    if not os.path.isabs(argv_out[0]):
        print(f"tfdist-run: error: {not_found(argv_out[0])}", file=sys.stderr)
        return 2
    try:
        check_command(user_command, local_only(launcher, args.hosts))
    except UsageError as e:
        print(f"tfdist-run: error: {e}", file=sys.stderr)
        return 2
    print(f"tfdist-run: {launcher}: {shlex.join(argv_out)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    from tfdist.launch import job_summary
    from tfdist.launch import recovery

    hosts = parse_hosts(args.hosts) if args.hosts else None
    # The launcher's exit status becomes ours; a failure ends with one line naming its cause.
    return job_summary.run(argv_out, lambda rank: recovery._host_of_rank(rank, hosts, argv_out))


def _supervise(args, launcher, command, user_command):
    """tfdist-run as the launcher's parent: relaunch after failures (`tfdist.launch.recovery`)."""
    from tfdist.launch import recovery

    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: expected 0 or more")
    if args.host_discovery_script and args.hosts:
        raise UsageError("give either -H or --host-discovery-script, not both")
    hosts = parse_hosts(args.hosts) if args.hosts else None
    try:
        if args.host_discovery_script:
            hosts = recovery.run_discovery(args.host_discovery_script)
        np_ = args.np or (sum(s for _, s in hosts) if hosts else None)
        if np_ is None and launcher == "srun" and os.environ.get("SLURM_NTASKS", "").isdigit():
            np_ = int(os.environ["SLURM_NTASKS"])
        if np_ is None:
            raise UsageError("--max-restarts/--min-np need -np N (or -H host:slots,...)")
        if args.min_np is not None and not 1 <= args.min_np <= np_:
            raise UsageError(f"--min-np {args.min_np}: expected 1 to -np {np_}")
        slurm_slots = None
        if (launcher == "srun" and not hosts and args.min_np is not None and args.min_np < np_):
            from tfdist.launch import slurm as launch

            nodes = launch.node_names(os.environ.get("SLURM_JOB_NODELIST", "")) or ["?"]
            slurm_slots = -(-np_ // len(nodes))
        extra = shlex.split(args.launcher_args)
        if launcher == "mpirun":  # mpirun passes only the environment it is told to
            extra += [a for name in (recovery.RESTART_ENV, recovery.CAUSE_ENV, recovery.PROGRESS_ENV,
                                                   recovery.CONTROL_ENV)
                      for a in ("-x", name)]
            if not horovod_has_mpi():
                raise UsageError(f"--launcher mpirun: {NO_MPI}")

        def make_argv(np_now, hosts_now):
            spec = ",".join(f"{h}:{s}" for h, s in hosts_now) if hosts_now else None
            argv_out = build_command(launcher, command, np_now, spec, extra)
            if launcher == "srun" and "--distribution=arbitrary" in argv_out:
                import tempfile

                with tempfile.NamedTemporaryFile("w", prefix="tfdist-hosts-", suffix=".txt",
                                                 delete=False) as f:
                    f.write("\n".join(srun_hostfile_lines(spec, np_now)) + "\n")
                os.environ["SLURM_HOSTFILE"] = f.name
            if not os.path.isabs(argv_out[0]):
                raise UsageError(not_found(argv_out[0]))
            return argv_out

        if args.dry_run:
            np_now, hosts_now = recovery.plan_ranks(np_, args.min_np or np_, hosts, args.global_batch)
            print(shlex.join(make_argv(np_now, hosts_now)))
            print(f"tfdist-run: supervised: up to {args.max_restarts} restart(s), "
                  f"at least {args.min_np or np_} rank(s)", file=sys.stderr)
            return 0
        check_command(user_command, local_only(launcher, args.hosts) and not args.host_discovery_script)
        sys.stdout.flush()
        return recovery.supervise(make_argv, np_, hosts, max_restarts=args.max_restarts,
                                  min_np=args.min_np, discovery_script=args.host_discovery_script,
                                  slurm_slots=slurm_slots, global_batch=args.global_batch)
    except recovery.RecoveryError as e:
        raise UsageError(str(e)) from e


if __name__ == "__main__":
    sys.exit(main())
