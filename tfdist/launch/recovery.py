"""Automatic recovery for `tfdist-run --max-restarts N [--min-np K]`: relaunch a job that failed.

```bash
tfdist-run -np 2 --max-restarts 2 python train.py                    # same ranks, up to 2 relaunches
tfdist-run -np 3 --min-np 2 --max-restarts 2 \
    --host-discovery-script ./hosts.sh --global-batch 96 python train.py   # may go on with 2 ranks
```

tfdist-run then stays as the launcher's parent: it copies the job's output through, keeps its
last lines, and when the job fails it names the cause (the launcher's exit report, the
watchdog's "rank R (host H, pid P) died/failed/stopped responding" line), decides whether to
relaunch (`decide`), re-discovers the hosts (`discover_hosts`) and relaunches the same command
with `TFDIST_RESTART=<k>` and `TFDIST_RESTART_CAUSE=<cause>`. The training script resumes from
its newest `callbacks.Checkpointer` checkpoint, which reports each save to the file named by
`TFDIST_PROGRESS_FILE`, so tfdist-run can tell a failure that makes progress from one that repeats.
No TensorFlow here: the launcher starts in milliseconds.
"""

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from tfdist.errors import TfdistError
from tfdist.launch.hosts import parse_host_slots
from tfdist.launch.launcher_output import (  # noqa: F401  (re-exported)
    PREEMPTED_CODE, TAIL_LINES, launcher_lines, preempted, report_note, run_once)

RESTART_ENV = "TFDIST_RESTART"
CAUSE_ENV = "TFDIST_RESTART_CAUSE"
PROGRESS_ENV = "TFDIST_PROGRESS_FILE"
CONTROL_ENV = "TFDIST_CONTROL_FILE"  # tfdist.faults.preemption.CONTROL_ENV: tfdist-run asks the job to stop (grow back)

# Errors that a relaunch would meet again at the same point: not worth a restart.
DETERMINISTIC = ("SyntaxError", "ModuleNotFoundError", "ImportError", "RankMismatchError",
                 "CheckpointError", "NonFiniteLossError")

_WATCHDOG = re.compile(r"tfdist watchdog: rank (\d+) \(host (.+?), pid \d+\) (.+?)\. Stopping ")
_HOROVOD_NAME = re.compile(r"^\s*Process name: (\S+)\s*$")
_HOROVOD_CODE = re.compile(r"^\s*Exit code: (-?\d+)\s*$")
_MPIRUN = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_SRUN = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (.+)$")
_HANG = re.compile(r"tfdist hang: ranks wait in different collectives for \d+ s .*?: (ranks? \d.+? \(host .+?)\. Every rank must")
_TRACEBACK_LAST = re.compile(r"^(?:\[\d+\]<std\w+>:)?(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt)): ")


class RecoveryError(TfdistError):
    """A job that cannot be (re)launched: too few slots, a batch that cannot be kept, a bad script."""


def restart_info(env=None):
    """In a rank: (restart number, cause) of this launch; (0, None) for the first launch.

    >>> restart, cause = restart_info()   # e.g. (1, 'rank 1 (host n2) was killed by SIGKILL')
    """
    env = os.environ if env is None else env
    return int(env.get(RESTART_ENV, "0") or 0), env.get(CAUSE_ENV) or None


def report_progress(epoch, path, step=None, env=None):
    """Tell the supervising tfdist-run that checkpoint `path` (epoch `epoch`) is saved (chief).

    A no-op outside `tfdist-run --max-restarts`; written atomically; never raises.
    """
    target = (os.environ if env is None else env).get(PROGRESS_ENV)
    if not target:
        return
    try:
        with open(target + ".tmp", "w") as f:
            json.dump({"epoch": int(epoch), "path": str(path), "step": step}, f)
        os.replace(target + ".tmp", target)
    except OSError:
        pass  # progress is advice for the restart decision, never a reason to fail training


def read_progress(path):
    """The newest checkpoint epoch reported to `path`, or None (none saved, or not reported)."""
    try:
        with open(path) as f:
            return int(json.load(f)["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- why did the job end? -------------------------------------------------------------------

@dataclasses.dataclass
class Failure:
    """One failed launch: its cause in words, whether a relaunch can help, the progress it had."""

    returncode: int
    cause: str
    rank: int = None
    host: str = None
    retry: bool = True
    why_not: str = None
    progress: int = None  # newest checkpoint epoch when it failed (None: none or unknown)

    @property
    def key(self):
        """What must match for two failures to count as 'the same failure'."""
        return self.rank, self.host, re.sub(r"pid \d+", "pid", self.cause)


def signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _exit_words(code):
    """Exit status in words: -9 and 137 (a shell's 128+9) both read 'was killed by SIGKILL'."""
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    if code > 128 and code - 128 < 65:
        return f"was killed by {signal_name(code - 128)} (exit code {code})"
    return f"exited with code {code}"


def analyse(returncode, lines, host_of_rank=None):
    """A `Failure` from the launcher's exit status and the job's last output lines.

    `host_of_rank(rank)` names the host when the output does not (horovodrun reports only the
    rank, and may stop the survivors before the watchdog's line is out).

    >>> analyse(1, ["Process name: 1", "Exit code: 137"]).cause
    'rank 1 was killed by SIGKILL (exit code 137)'
    """
    rank = host = code = what = None
    for line in lines:
        if rank is None and (m := _WATCHDOG.search(line)):  # the first verdict: later ones may be echoes
            rank, host, what = int(m[1]), m[2], m[3]
    exit_rank = None
    for i, line in enumerate(lines):  # horovodrun: the first process to exit with non-zero status
        # its "Exit code" line follows, but the other stream's lines may come between
        codes = [c for later in lines[i + 1:i + 6] if (c := _HOROVOD_CODE.match(later))]
        if (m := _HOROVOD_NAME.match(line)) and codes:
            exit_rank, code = (int(m[1]) if m[1].isdigit() else None), int(codes[0][1])
            break
        if m := _MPIRUN.search(line):
            exit_rank, host, code = int(m[1]), host or m[2], -int(m[3])
            break
        if m := _SRUN.search(line):
            host = host or m[1]
            exit_rank = int(m[2].split(",")[0].split("-")[0])
            what = what or m[3].strip()
            break
    if rank is None:
        rank = exit_rank
    if host is None and rank is not None and host_of_rank is not None:
        host = host_of_rank(rank)
    who = "the job" if rank is None else f"rank {rank}" + (f" (host {host})" if host else "")
    if code is not None and (rank is None or exit_rank == rank) and (code < 0 or code > 128):
        cause = f"{who} {_exit_words(code)}"
        if what and not what.startswith("died"):
            cause += f": {what}"
    elif what:
        cause = f"{who} {what}"
    elif code is not None:
        cause = f"{who} {_exit_words(code)}"
    else:
        cause = f"{who} {_exit_words(returncode)} (launcher exit status)"
    hung = next((m for line in lines if (m := _HANG.search(line))), None)
    if hung:  # the hang detector's line: no rank failed, they waited in different collectives
        cause = f"ranks waited in different collectives: {hung[1]}"
    failure = Failure(returncode, cause, rank if not hung else None, host if not hung else None)
    if hung:
        failure.retry, failure.why_not = False, "a hang in mismatched collectives happens again on every launch"
    text = "\n".join(lines)
    if 2 in (returncode, code) and re.search(r"^(?:\[\d+\]<std\w+>:)?usage: ", text, re.M) and "error:" in text:
        failure.retry, failure.why_not = False, "a usage error (the command line is wrong; fix it and rerun)"
    for line in lines:
        m = _TRACEBACK_LAST.match(line.strip())
        if m and m[1] in DETERMINISTIC:
            failure.retry = False
            failure.why_not = f"{m[1]} happens again on every launch: {line.strip()[:300]}"
    return failure


def decide(failure, history, restarts_done, max_restarts):
    """(relaunch?, reason): the restart rule, given the earlier failures of this run.

    Give up when restarts are used up, on an error a relaunch meets again (usage error, import
    or syntax error, ranks that disagree, a bad checkpoint, a non-finite loss), or when the same
    failure (same rank, host and cause) repeats with no newer checkpoint than the last time.
    """
    if not failure.retry:
        return False, f"not restarting: {failure.why_not}"
    if restarts_done >= max_restarts:
        return False, f"restarts exhausted ({restarts_done} of --max-restarts {max_restarts} used)"
    if history:
        last = history[-1]
        if last.key == failure.key and last.progress == failure.progress:
            at = "no checkpoint yet" if failure.progress is None else f"newest checkpoint still epoch {failure.progress}"
            return False, (f"not restarting: the same failure again with no progress since the last "
                           f"restart ({at}); a relaunch would repeat it")
    return True, "relaunching"


# --- where can it run? ---------------------------------------------------------------------

def parse_host_lines(text, source):
    """'h1:2\\nh2:1\\n' (host[:slots] per line, like horovodrun's discovery) -> [('h1', 2), ('h2', 1)]."""
    return parse_host_slots(text.splitlines(), source, error=RecoveryError, zero_slots="drop")


def run_discovery(script, timeout=30):
    """The hosts that `script` prints now (host:slots per line)."""
    try:
        out = subprocess.run([script], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RecoveryError(f"--host-discovery-script {script}: {type(e).__name__}: {e}") from e
    if out.returncode:
        raise RecoveryError(f"--host-discovery-script {script} exited with code {out.returncode}: "
                            f"{out.stderr.strip()[-300:]}")
    return parse_host_lines(out.stdout, f"--host-discovery-script {script}")


def slurm_hosts(slots_per_node, env=None, run=subprocess.run):
    """The Slurm job's nodes now (`scontrol show job`), less those down, drained or failed.

    A node that fails under `sbatch --no-kill` leaves the job's NodeList; `sinfo` catches a
    node still listed but marked down. `slots_per_node` ranks per node, as the first launch used.
    """
    from tfdist.launch import slurm as launch

    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    try:
        out = run(["scontrol", "show", "job", "-o", env["SLURM_JOB_ID"]], capture_output=True,
                  text=True, timeout=30)
        if out.returncode == 0 and (m := re.search(r"\bNodeList=(\S+)", out.stdout)) and m[1] != "(null)":
            nodelist = m[1]
    except (OSError, subprocess.SubprocessError, KeyError):
        pass  # fall back to the allocation's environment
    nodes = launch.node_names(nodelist) if nodelist else []
    try:
        out = run(["sinfo", "-h", "-N", "-o", "%N %t", "-n", ",".join(nodes)], capture_output=True,
                  text=True, timeout=30)
        bad = {n for n, state in (l.split()[:2] for l in out.stdout.splitlines() if len(l.split()) >= 2)
               if re.match(r"(down|drain|drng|fail|futr|maint|npc|powered_down)", state.rstrip("*~#!%$@^-"))}
    except (OSError, subprocess.SubprocessError):
        bad = set()
    return [(n, slots_per_node) for n in nodes if n not in bad]


def plan_ranks(wanted, min_np, hosts, global_batch=None):
    """(rank count, hosts trimmed to it) for the next launch; RecoveryError when below `min_np`.

    The rule on fewer ranks: the global batch is kept (each rank's part grows, the learning rate
    and the schedule's steps stay), so the count must divide `global_batch` when one is given.

    >>> plan_ranks(3, 2, [("a", 1), ("b", 1)], global_batch=48)
    (2, [('a', 1), ('b', 1)])
    """
    total = wanted if hosts is None else min(wanted, sum(s for _, s in hosts))
    where = "" if hosts is None else " on " + ",".join(f"{h}:{s}" for h, s in hosts)
    if total < min_np:
        raise RecoveryError(f"only {total} slot(s) left{where}, fewer than --min-np {min_np}")
    np_ = total
    if global_batch:
        while np_ >= min_np and global_batch % np_:
            np_ -= 1
        if np_ < min_np:
            raise RecoveryError(
                f"--global-batch {global_batch} cannot be kept on {min_np} to {total} ranks: it divides by "
                f"none of them. Use a global batch divisible by every rank count from --min-np {min_np} "
                f"to -np {wanted} (e.g. {_lcm_range(min_np, wanted)}).")
    if hosts is None:
        return np_, None
    kept, left = [], np_
    for name, slots in hosts:
        if left:
            kept.append((name, min(slots, left)))
            left -= kept[-1][1]
    return np_, kept


def _lcm_range(low, high):
    import math

    value = 1
    for n in range(max(low, 1), high + 1):
        value = value * n // math.gcd(value, n)
    return value


# --- the supervising loop -------------------------------------------------------------------

def _host_of_rank(rank, hosts, argv):
    """The host rank `rank` ran on: launchers fill hosts in order, slot by slot; no hosts: this
    host, except under srun (the allocation's nodes, not known here)."""
    if hosts:
        for name, slots in hosts:
            if rank < slots:
                return name
            rank -= slots
        return None
    return None if os.path.basename(argv[0]) == "srun" else socket.gethostname()


def supervise(make_argv, np_, hosts, *, max_restarts, min_np=None, discovery_script=None,
              slurm_slots=None, global_batch=None, env=None, log=None):
    """Launch, and relaunch after failures as `decide` allows; tfdist-run's exit status.

    `make_argv(np, hosts)` builds the launcher's argv for `np` ranks on `hosts` ([(host, slots)]
    or None for this host). `slurm_slots`: ranks per node when hosts come from the Slurm job.
    """
    log = log or (lambda text: print(f"tfdist-run: {text}", file=sys.stderr, flush=True))
    base_env = dict(os.environ if env is None else env)
    scratch = tempfile.mkdtemp(prefix="tfdist-recovery-")
    try:
        return _loop(make_argv, np_, hosts, max_restarts, min_np, discovery_script, slurm_slots,
                     global_batch, base_env, log, os.path.join(scratch, "progress.json"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _loop(make_argv, np_, hosts, max_restarts, min_np, discovery_script, slurm_slots, global_batch,
          base_env, log, progress_file):
    wanted, min_np = np_, np_ if min_np is None else min_np
    history, cause = [], None

    def current_hosts():
        if discovery_script:
            return run_discovery(discovery_script)
        if slurm_slots:
            return slurm_hosts(slurm_slots, base_env)
        return hosts

    control_file = os.path.join(os.path.dirname(progress_file), "control.json")
    restart = grows = 0  # launches after the first; of them, those that grew the job back
    grew = False
    while True:
        try:
            np_now, hosts_now = plan_ranks(wanted, min_np, current_hosts(), global_batch)
            argv = make_argv(np_now, hosts_now)
        except TfdistError as e:
            log(f"error: {e}" + (f" (after {len(history)} failure(s); last: {history[-1].cause})"
                                 if history else ""))
            return 2
        where = " on " + ",".join(f"{h}:{s}" for h, s in hosts_now) if hosts_now else ""
        if grew:
            log(f"growing back: relaunching on {np_now} rank(s){where} after {cause}")
        elif restart:
            log(f"restart {restart - grows}/{max_restarts} after {cause}; relaunching on {np_now} rank(s){where}")
        log(" ".join(argv))
        job_env = {**base_env, RESTART_ENV: str(restart), PROGRESS_ENV: progress_file, CONTROL_ENV: control_file}
        if cause:
            job_env[CAUSE_ENV] = cause
        watcher = None
        if np_now < wanted and (discovery_script or slurm_slots):
            from tfdist.launch.grow import GrowWatcher

            watcher = GrowWatcher(control_file, lambda: plan_ranks(wanted, min_np, current_hosts(), global_batch)[0],
                                  np_now, log).start()
        code, tail, stopped, report = run_once(argv, job_env, kind=launcher_lines(argv))
        grew = watcher.stop() if watcher is not None else False
        stop = preempted(tail)  # before the status: horovodrun sent SIGTERM once exited 0 after the ranks' 75
        if code == 0 and stop is None:
            if restart:
                log(f"job finished after {restart - grows} restart(s)" + (f" and {grows} growth(s)" if grows else "")
                    + f" on {np_now} rank(s)")
            return 0
        grew = grew and stop is not None and stopped is None and "hosts for" in stop[0]
        if grew:  # stopped at an epoch's end for more ranks: not a failure, no restart used
            restart, grows = restart + 1, grows + 1
            cause = f"the job stopped for it ({stop[1]})"
            continue
        if stop is not None and (stopped is not None or restart - grows >= max_restarts):
            log(f"job preempted ({stop[0]}; {stop[1]}); not restarting"
                + (f": {signal_name(stopped)} was sent to tfdist-run" if stopped is not None
                   else f" (restarts used up: {restart - grows} of --max-restarts {max_restarts})")
                + f". Exit status {PREEMPTED_CODE}: run the same command again to continue{report_note(argv, report)}.")
            return PREEMPTED_CODE
        if stopped is not None:
            log(f"stopped by {signal_name(stopped)}; not restarting")
            return code if code > 0 else 128 + stopped
        if stop is not None:  # only some ranks were signalled: this allocation goes on, so resume
            restart, cause = restart + 1, f"preemption ({stop[0]}; {stop[1]})"
            if report:
                log(f"job preempted{report_note(argv, report)}")
            continue
        failure = analyse(code, tail, lambda r, hosts_now=hosts_now, argv=argv: _host_of_rank(r, hosts_now, argv))
        failure.progress = read_progress(progress_file)
        go, reason = decide(failure, history, restart - grows, max_restarts)
        history.append(failure)
        at = "no checkpoint yet" if failure.progress is None else f"newest checkpoint: epoch {failure.progress}"
        if not go:
            log(f"giving up: {failure.cause} ({at}); {reason}. Exit status {code}.")
            return code if code > 0 else 1
        restart += 1
        cause = f"{failure.cause} ({at})"
