"""Test harness: launch real multi-process Horovod jobs (horovodrun --gloo) from pytest."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SITE = ROOT / "tests" / "site"  # sitecustomize.py for the processes the tests start (no exit-time GC)
# The reference-suite runner's files (its rank plugin, its own small test suite) run only under
# tests/reference/suite.py (tests/test_reference_suite.py), never as tests of this suite.
collect_ignore = ["reference"]


# A suite started in the background by a shell without job control (`bash .ci/run &` in a script)
# inherits SIGINT ignored, and so would every process it starts: the tests that stop a process with
# SIGINT (Ctrl-C) would see it ignored. A handler here gives the processes it starts the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


class JobFailed(AssertionError):
    pass


@pytest.fixture(autouse=True, scope="module")
def _environment_restored():
    """Undo, after each test module, what its in-process HorovodStrategy() set in os.environ (its
    tuning sets HOROVOD_CYCLE_TIME, for one), so jobs launched by later modules start from the same
    environment in any test order. Module scope: set up before the modules' own strategy fixtures."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def run_job(args, out_dir, np=2, env=None, timeout=420, launcher="horovodrun"):
    """Run `python ARGS --out OUT_DIR` under `horovodrun -np NP --gloo` (np=None: one plain process).

    `launcher="mpirun"`: under the mpirun command `tfdist-run --launcher mpirun` builds
    (`tfdist.launch.runner.build_command`); `"tfdist-run mpirun"`: through `tfdist-run --launcher mpirun`.

    Returns {rank: results dict}. A job that exceeds `timeout` is killed with its whole process
    group and fails the test, so a hang can never stall the suite.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, *map(str, args), "--out", str(out_dir)]
    job_env = make_job_env(env)
    if np is not None and launcher == "horovodrun":
        command = [str(BIN / "horovodrun"), "-np", str(np), "--gloo", *command]
    elif np is not None and launcher == "mpirun":
        from tfdist.launch.runner import build_command

        command = build_command("mpirun", command, np, env=job_env)
    elif np is not None and launcher == "tfdist-run mpirun":
        command = [str(BIN / "tfdist-run"), "--launcher", "mpirun", "-np", str(np), *command]
    elif np is not None:
        raise ValueError(f"run_job: unknown launcher {launcher!r}")
    proc = subprocess.Popen(
        command, cwd=ROOT, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    # mpirun gives each rank its own process group: given time, it stops them itself
    output, _, timed_out = communicate_or_kill(proc, timeout, grace=20 if launcher != "horovodrun" else 0)
    if timed_out:
        raise JobFailed(f"job timed out after {timeout}s: {' '.join(command)}\n{_tail(output)}")
    if proc.returncode != 0:
        raise JobFailed(f"job failed ({proc.returncode}): {' '.join(command)}\n{_tail(output)}")
    results = read_results(out_dir)
    expected = np or 1
    if len(results) != expected:
        raise JobFailed(f"expected {expected} result files, got {sorted(results)}\n{_tail(output)}")
    return results


def make_job_env(extra=None):
    """os.environ for a job's processes: TensorFlow's C++ log quiet, tfdist imported from this
    checkout, no garbage collection at exit (tests/site), then `extra`, where a None value removes
    the variable."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.pathsep.join([str(ROOT), str(SITE)]),
           **(extra or {})}
    return {k: v for k, v in env.items() if v is not None}


def read_results(out_dir):
    """{rank: results} from the rank<R>.json files the workers wrote in `out_dir`."""
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))}


def python_results(code, *args, env=None, timeout=300):
    """Run `python -c CODE ARGS` from the checkout with make_job_env(env); asserts that it exits 0
    having printed lines `RESULT <text>`, and returns their texts."""
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=make_job_env(env),
                         capture_output=True, text=True, timeout=timeout)
    lines = [line[len("RESULT "):] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return lines


def free_ports(n=1, host="127.0.0.1"):
    """`n` ports free on `host` (held together while chosen, so they differ)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port(host="127.0.0.1"):
    return free_ports(1, host)[0]


# --- ending the processes of a job (each started with start_new_session=True) -------------------

def kill_group(proc, grace=0):
    """End `proc` and its process group if it still runs: with `grace`, SIGTERM first and that many
    seconds to stop (mpirun stops its ranks, each in a process group of its own, only so), then
    SIGKILL to the group. Reaps it (what it wrote to a pipe stays for `proc.communicate()`).
    Returns whether it was still running."""
    if proc.poll() is not None:
        return False
    if grace:
        proc.terminate()
        try:
            proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return True


def communicate_or_kill(proc, timeout, grace=0):
    """`proc.communicate()` for at most `timeout` seconds, then `kill_group(proc, grace)`.
    Returns (stdout, stderr, timed_out): all it wrote, also when it was killed."""
    try:
        return (*proc.communicate(timeout=timeout), False)
    except subprocess.TimeoutExpired:
        survivors = describe_session(proc.pid)
        kill_group(proc, grace)
        stdout, stderr = proc.communicate()
        return (stdout or "") + survivors, stderr, True


def describe_session(session):
    """What still runs of a job started with start_new_session (`session`: its pid): one line per
    process of its session or below it, and each Python process' stacks where py-spy is installed. For the
    message of a test whose job did not end."""
    import psutil
    lines = []
    spy = shutil.which("py-spy", path=str(BIN)) or shutil.which("py-spy")  # the venv's (bootstrap)
    try:  # with the filters of their own session that a subreaper among them adopted
        descendants = {p.pid for p in psutil.Process(session).children(recursive=True)}
    except psutil.Error:
        descendants = set()
    for p in psutil.process_iter(["pid", "ppid", "status", "cmdline"]):
        try:
            if os.getsid(p.pid) != session and p.pid not in descendants:
                continue
        except OSError:
            continue
        cmd = " ".join(p.info["cmdline"] or [])[:160]
        lines.append(f"  pid {p.pid} (parent {p.info['ppid']}, {p.info['status']}): {cmd}")
        if spy and "python" in cmd:
            try:
                dump = subprocess.run([spy, "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=60)
            except subprocess.TimeoutExpired:  # the description must not hide the test's own failure
                lines.append("    (py-spy: no stacks within 60 s)")
                continue
            lines.extend("    " + line for line in (dump.stdout + dump.stderr).splitlines())
    return "\n[still running when the test gave up]\n" + "\n".join(lines) + "\n"


def wait_or_kill(procs, timeout, fail_fast=False):
    """Wait for every process of a job (one per host or rank) to exit, for at most `timeout`
    seconds, and with `fail_fast` only until one fails (the others would wait for it in a
    collective); then `kill_group` each one still running. Returns the indices of those killed."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if fail_fast and any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        killed = [i for i, p in enumerate(procs) if kill_group(p)]
    return killed


# --- signalling a rank of a tests/multirank/watchdog_checks.py job -------------------------------

WATCHDOG_WORKER = ROOT / "tests" / "multirank" / "watchdog_checks.py"
EXIT_LIMIT_S = 60  # how soon after rank 1 dies the watchdog must have stopped rank 0


def wait_ready(out, ranks=(0, 1), timeout=180, procs=()):
    """The pids the watchdog worker's ranks write to OUT/ready<R> once training (step 20); None if
    they do not within `timeout` seconds or one of `procs` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [out / f"ready{r}" for r in ranks]
        if all(f.exists() for f in files):
            return [int(f.read_text()) for f in files]
        if any(p.poll() is not None for p in procs):
            return None
        time.sleep(0.1)
    return None


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_exit(pid, timeout):
    """Seconds until process `pid` (not necessarily a child) has exited, or `timeout` has passed."""
    start = time.monotonic()
    while _alive(pid) and time.monotonic() - start < timeout:
        time.sleep(0.02)
    return time.monotonic() - start


def signal_rank(out, procs, sig, logs):
    """Once both ranks of a watchdog worker job writing to `out` train, send `sig` to rank 1; returns
    (pids, seconds from then until rank 0 exited, at most EXIT_LIMIT_S + 10). `logs`: the job's log
    files, shown should the ranks never get ready."""
    pids = wait_ready(out, procs=procs)
    assert pids, "".join(Path(log).read_text()[-3000:] for log in logs)
    os.kill(pids[1], sig)
    return pids, wait_exit(pids[0], EXIT_LIMIT_S + 10)


def _tail(output, lines=80):
    kept = [l for l in output.splitlines() if " I0000 " not in l and " W0000 " not in l]
    return "\n".join(kept[-lines:])


@pytest.fixture(params=["keras3", "tf_keras"])
def keras_flavor(request):
    return request.param


# The extended tier: tf-keras twins of the slowest fault-tolerance launches (1-1.5 min each), whose
# Keras 3 variant runs in every CI run and whose tf-keras paths are also covered by the tf-keras
# launches CI keeps (test_multirank, test_conformance, test_keras_hooks). CI time is budgeted
# (docs/TESTING.md#ci-time); `TFDIST_EXTENDED=1 bash scripts/run_tests.sh` runs them too.
EXTENDED_TF_KERAS = {
    "test_preempted_job_saves_at_one_step_and_resumes_exactly": "preemption save and exact resume",
    "test_lost_rank_goes_on_two_then_grows_back_to_three_at_the_digits_target": "elastic shrink and grow",
    "test_killed_twice_mid_epoch_ends_equal_to_an_uninterrupted_run": "restarts after two kills",
    "test_powersgd_step_matches_numpy_with_error_feedback_and_warm_start": "PowerSGD against numpy",
    "test_killed_job_resumes_to_the_uninterrupted_result": "Checkpointer resume after a kill",
}


def extended_tier(what):
    """A pytest mark for a case of the extended tier (above): skipped with `what` unless TFDIST_EXTENDED=1."""
    return pytest.mark.skipif(os.environ.get("TFDIST_EXTENDED") != "1",
                              reason=f"extended tier ({what}): TFDIST_EXTENDED=1 to run it")


# The files that take longest (CI's durations, docs/TESTING.md#ci-time), run first under pytest-xdist
# (TFDIST_TEST_WORKERS): the workers take whole files as they come free, so a long file started last
# would leave the others idle at the end. One process keeps the files' own order.
LONGEST_FILES_FIRST = ("test_conformance.py", "test_sharded.py", "test_multirank.py", "test_faults.py",
                       "test_compression.py", "test_benchmark.py", "test_reference_suite.py", "test_slurm.py")


def _file_order(item):
    name = item.path.name
    return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_file_order)  # stable: each file's own order is kept
    if os.environ.get("TFDIST_EXTENDED") == "1":
        return
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        what = EXTENDED_TF_KERAS.get(getattr(item, "originalname", ""))
        if what and "tf_keras" in (params.get("flavor"), params.get("keras_flavor")):
            item.add_marker(pytest.mark.skip(
                reason=f"extended tier ({what}: its keras3 variant runs here): TFDIST_EXTENDED=1 to run it"))


def flavor_env(flavor):
    return {"TF_USE_LEGACY_KERAS": "1" if flavor == "tf_keras" else "0"}
