"""Run the reference's own tf.distribute tests with tfdist's strategy swapped in, rank by rank.

    python tests/reference/suite.py                          # Keras 3's tests, 2 ranks, vs expectations.toml
    python tests/reference/suite.py --np 4                   # the same on 4 ranks
    python tests/reference/suite.py --mode mwms --only-na    # the "not applicable" ones under MWMS
    python tests/reference/suite.py --source ~/src/keras     # also Keras' integration_tests/ (not in the sdist)
    python tests/reference/suite.py --suite tf_keras --source ~/src/tf-keras   # tf-keras (from a checkout)

Keras 3 publishes its tests in its PyPI sdist: the installed version's sdist is downloaded once
into $TFDIST_CACHE/reference (default ~/.cache/tfdist/reference) and its tf.distribute test files
(`picking`) are extracted into a scratch folder; nothing of it is kept in the repository.
tf-keras and TensorFlow publish no tests (their sdists and wheels hold none), so the tf-keras
suite reads a checkout of keras-team/tf-keras at the installed version's tag, given by --source.

The tests run unmodified, under `horovodrun -np N --gloo python -m pytest` with
`reference_rank_plugin` loaded in every rank (mode "horovod"), or as N plain processes under
TensorFlow's MultiWorkerMirroredStrategy on loopback (mode "mwms", the oracle). Every rank runs
the same tests in lock step and writes its progress; this runner watches it. A test that one rank
finished while another is still in it after --grace seconds, or that runs longer than
--test-timeout, is a hang: the job is stopped, the test is recorded as "hung" with what each rank
was doing, and the job is started again on the tests not yet run. A job that dies names its test
("crashed") the same way. Nothing waits forever.

Each test's outcome is compared with tests/reference/expectations.toml: "pass", or "n/a: <reason>"
(run only with --all or in mode mwms, where such a test must not pass either).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from sources import prepare_keras3, prepare_selftest, prepare_tf_keras  # noqa: E402

EXPECTATIONS = HERE / "expectations.toml"
GRACE_S = 60  # one rank finished a test, another is still in it: a hang after this long
TEST_TIMEOUT_S = 400  # no test of these suites needs this long, even on a busy 2-core machine


# --- one job and its progress ---------------------------------------------------------------------
def read_progress(out, size):
    """{rank: [events]} from OUT/rank<R>.jsonl (a line being written is left for the next read)."""
    progress = {}
    for rank in range(size):
        path = out / f"rank{rank}.jsonl"
        events = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        progress[rank] = events
    return progress


def launch(suite, mode, np, rootdir, args, out, select):
    env = {**os.environ, "REFERENCE_MODE": mode, "REFERENCE_SUITE": suite, "REFERENCE_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(rootdir), str(ROOT)]), "KERAS_BACKEND": "tensorflow",
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    if suite == "tf_keras":
        env["TF_USE_LEGACY_KERAS"] = "1"
    if select is not None:
        env["REFERENCE_SELECT"] = json.dumps(sorted(select))
    pytest = [sys.executable, "-m", "pytest", "-p", "reference_rank_plugin", "-p", "no:cacheprovider",
              "--import-mode=importlib", "--rootdir", str(rootdir), "-q", "-rN", *args]
    log = open(out / "job.log", "ab")
    if mode == "horovod":
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        return [subprocess.Popen([horovodrun, "-np", str(np), "--gloo", *pytest], cwd=rootdir, env=env,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)]
    ports = _free_ports(np)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    return [subprocess.Popen(pytest, cwd=rootdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker",
                                                                                                 "index": i}})})
            for i in range(np)]


def _free_ports(n):
    import socket

    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _stop(procs, rank_pids=()):
    """Stop the job; first each rank in `rank_pids` writes its threads' stacks (SIGUSR2)."""
    for pid in rank_pids:
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass
    if rank_pids:
        time.sleep(3)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def _pids(progress):
    return [e["pid"] for events in progress.values() for e in events if "pid" in e]


def _in_flight(events):
    """(test, started at) this rank is in, or (None, None)."""
    current, since = None, None
    for event in events:
        if "start" in event:
            current, since = event["start"], event["time"]
        elif "end" in event and event["end"] == current:
            current, since = None, None
    return current, since


def watch(procs, out, np, grace, test_timeout):
    """Wait for the job; stop it at a hang. Returns (stalled test or None, why)."""
    while True:
        running = any(p.poll() is None for p in procs)
        progress = read_progress(out, np)
        ended = {r: {e["end"]: e for e in events if "end" in e} for r, events in progress.items()}
        order = next((e["collected"] for e in progress.get(0, []) if "collected" in e), [])
        in_flight = {r: _in_flight(events) for r, events in progress.items()}
        in_flight = sorted(((order.index(t) if t in order else len(order), r, t, since)
                            for r, (t, since) in in_flight.items() if t is not None))
        now = time.time()
        for _, rank, test, since in in_flight:  # the earliest test first: later ones only wait for it
            done_elsewhere = {r: ended[r][test] for r in ended if test in ended[r]}
            if done_elsewhere and now - max(e["time"] for e in done_elsewhere.values()) > grace:
                _stop(procs, _pids(progress))
                others = ", ".join(f"rank {r} {e['outcome']}" + (f" ({e['message'][:200]})" if e["message"] else "")
                                   for r, e in sorted(done_elsewhere.items()))
                return test, f"rank {rank} still in it {grace:g} s after {others}"
            if now - since > test_timeout:
                _stop(procs, _pids(progress))
                return test, f"rank {rank} still in it after {test_timeout:g} s"
        if not running:
            if in_flight:
                _, rank, test, _ = in_flight[0]
                codes = [p.returncode for p in procs]
                return test, f"rank {rank} exited in it (exit statuses {codes}); see {out / 'job.log'}"
            return None, None
        time.sleep(1)


def _where_waiting(out, np):
    """The innermost frames of each rank's main thread, from the stacks it wrote on SIGUSR2."""
    said = []
    for rank in range(np):
        path = out / f"rank{rank}.stacks"
        text = path.read_text() if path.exists() else ""
        main = text.split("Current thread")[-1] if "Current thread" in text else text
        frames = [line.strip() for line in main.splitlines() if line.strip().startswith("File ")][:4]
        said.append(f"rank {rank} in " + (" < ".join(frames) if frames else "?"))
    return "; ".join(said) + f" (all threads: {out}/rank<R>.stacks)"


def run_suite(suite, mode, np, rootdir, args, out, select=None, grace=GRACE_S, test_timeout=TEST_TIMEOUT_S):
    """Run the suite's tests (all picked ones, or `select`) to the end, across hangs and crashes.

    Returns {test: {"outcome": passed|failed|skipped|hung|crashed, "ranks": {rank: outcome},
    "message": ...}} and the list of tests the first collection picked.
    """
    results, picked, attempt = {}, None, 0
    remaining = None if select is None else set(select)
    while remaining is None or remaining:
        attempt += 1
        job_out = out / f"job{attempt}"
        job_out.mkdir(parents=True)
        procs = launch(suite, mode, np, rootdir, args, job_out, remaining)
        stalled, why = watch(procs, job_out, np, grace, test_timeout)
        _stop(procs)
        progress = read_progress(job_out, np)
        collected = next((e["collected"] for e in progress.get(0, []) if "collected" in e), None)
        if collected is None:
            raise SystemExit(f"reference suite: the job collected nothing; its output:\n"
                             f"{(job_out / 'job.log').read_text()[-4000:]}")
        picked = picked if picked is not None else collected
        for test in collected:
            ends = {r: next((e for e in events if e.get("end") == test), None) for r, events in progress.items()}
            if all(ends.values()):
                outcomes = {r: e["outcome"] for r, e in ends.items()}
                combined = ("failed" if "failed" in outcomes.values() else
                            "skipped" if set(outcomes.values()) == {"skipped"} else "passed")
                message = next((e["message"] for e in ends.values() if e["outcome"] == combined and e["message"]), "")
                results[test] = {"outcome": combined, "ranks": outcomes, "message": message}
        if stalled is not None:
            crashed = "exited" in why
            if not crashed:
                why += "; " + _where_waiting(job_out, np)
            results[stalled] = {"outcome": "crashed" if crashed else "hung", "ranks": {}, "message": why}
        remaining = set(collected) - set(results)
        if stalled is None and remaining:
            for test in remaining:  # the job ended without reaching them: said, not retried
                results[test] = {"outcome": "not run", "ranks": {}, "message": f"job {attempt} ended first"}
            remaining = set()
    return results, picked


# --- expectations ---------------------------------------------------------------------------------
def expectations(suite, np):
    """{test: "pass" | "n/a: reason"} for this suite and rank count (np<N> tables override)."""
    table = tomllib.loads(EXPECTATIONS.read_text()).get(suite, {})
    merged = {k: v for k, v in table.items() if isinstance(v, str)}
    merged.update(table.get(f"np{np}", {}))
    return merged


def expected(table, test):
    return table.get(test, "pass")


def verdict(mode, want, got):
    """Whether outcome `got` of a test meets expectation `want` in `mode` (None: nothing to check)."""
    if mode == "mwms":
        return got != "passed" if want.startswith("n/a") else None
    if want == "pass":
        return got in ("passed", "skipped")
    return got != "passed" or None  # an n/a test that passes should say so


def report(results, table, mode):
    lines, bad = [], []
    for test in sorted(results):
        got, want = results[test]["outcome"], expected(table, test)
        ok = verdict(mode, want, got)
        mark = {True: "ok", False: "MISMATCH", None: "-"}[ok]
        if ok is False:
            bad.append(test)
        message = results[test]["message"]
        lines.append(f"{mark:8} {got:8} {test}  [{want}]" + (f"\n           {message[:300]}" if message else ""))
    return lines, bad


def table_markdown(results, table_of, suite):
    """A markdown table of `results` per test file: tests, passed, skipped, n/a (with reasons), other."""
    files = {}
    not_applicable = {t for t, e in table_of.items() if e.startswith("n/a")}
    for test in sorted(set(results) | not_applicable):  # n/a ones are left out of a default run
        r = results.get(test, {"outcome": "not run"})
        name = test.split("::")[0]
        row = files.setdefault(name, {"tests": 0, "passed": 0, "skipped": 0, "n/a": [], "other": []})
        row["tests"] += 1
        want = expected(table_of, test)
        if want.startswith("n/a"):
            row["n/a"].append(f"`{test.split('::', 1)[1]}`: {want[4:].strip()}")
        elif r["outcome"] in ("passed", "skipped"):
            row[r["outcome"]] += 1
        else:
            row["other"].append(f"`{test.split('::', 1)[1]}`: {r['outcome']}")
    lines = [f"| {suite} file | tests | passed | skipped | not applicable (reason) | other |", "| --- | --- | --- | --- | --- | --- |"]
    for name, row in sorted(files.items()):
        lines.append(f"| `{name}` | {row['tests']} | {row['passed']} | {row['skipped']} | "
                     f"{'<br>'.join(row['n/a']) or '-'} | {'<br>'.join(row['other']) or '-'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=("keras3", "tf_keras", "selftest"), default="keras3")
    parser.add_argument("--source", help="a checkout at the installed version: tf_keras (keras-team/tf-keras, "
                        "required) or keras3 (keras-team/keras, adds its integration_tests/)")
    parser.add_argument("--mode", choices=("horovod", "mwms"), default="horovod")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--all", action="store_true", help="also run the tests expected to be n/a")
    parser.add_argument("--only-na", action="store_true", help="run only the tests expected to be n/a")
    parser.add_argument("-k", dest="keyword", help="only tests whose id contains this text")
    parser.add_argument("--out", help="where to keep the jobs' logs and results.json (default: a temp dir)")
    parser.add_argument("--grace", type=float, default=GRACE_S)
    parser.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT_S)
    parser.add_argument("--table", action="store_true", help="also print a markdown table per test file "
                        "(docs/DISTRIBUTE_API.md keeps it); with --all, the n/a tests are counted too")
    args = parser.parse_args(argv)
    import tempfile

    out = Path(args.out or tempfile.mkdtemp(prefix="tfdist-reference-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for previous in ("tests", "jobs", "collect"):
        shutil.rmtree(out / previous, ignore_errors=True)
    scratch = out / "tests"
    scratch.mkdir()
    rootdir, pytest_args = {"tf_keras": lambda: prepare_tf_keras(scratch, args.source),
                            "selftest": lambda: prepare_selftest(scratch),
                            "keras3": lambda: prepare_keras3(scratch, args.source)}[args.suite]()
    table = expectations(args.suite, args.np)
    select = None
    if args.only_na or not (args.all or args.mode == "mwms") or args.keyword:
        select = collect(args.suite, rootdir, pytest_args, out)
        if args.only_na:
            select = [t for t in select if expected(table, t).startswith("n/a")]
        elif not (args.all or args.mode == "mwms"):
            select = [t for t in select if not expected(table, t).startswith("n/a")]
        if args.keyword:
            select = [t for t in select if args.keyword in t]
    results, _ = run_suite(args.suite, args.mode, args.np, rootdir, pytest_args, out / "jobs", select,
                           args.grace, args.test_timeout)
    (out / "results.json").write_text(json.dumps({"suite": args.suite, "mode": args.mode, "np": args.np,
                                                  "results": results}, indent=1))
    lines, bad = report(results, table, args.mode)
    print("\n".join(lines))
    if args.table:
        print(table_markdown(results, table, args.suite))
    counts = {}
    for r in results.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print(f"{args.suite} under {args.mode}, {args.np} ranks: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
          + f"; {len(bad)} not as expected; results in {out / 'results.json'}")
    return 1 if bad else 0


def collect(suite, rootdir, pytest_args, out):
    """The picked tests' ids, from one plain process's collection (no strategy is built for it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(rootdir), str(ROOT)]),
           "KERAS_BACKEND": "tensorflow", "REFERENCE_COLLECT_ONLY": "1", "REFERENCE_SUITE": suite,
           "REFERENCE_OUT": str(out), "TF_CPP_MIN_LOG_LEVEL": "2"}
    if suite == "tf_keras":
        env["TF_USE_LEGACY_KERAS"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "reference_rank_plugin", "-p", "no:cacheprovider",
                           "--import-mode=importlib", "--rootdir", str(rootdir), "--collect-only", "-q", *pytest_args],
                          cwd=rootdir, env=env, capture_output=True, text=True)
    progress = read_progress(out, 1)
    collected = next((e["collected"] for e in progress[0] if "collected" in e), None)
    (out / "rank0.jsonl").unlink(missing_ok=True)
    if collected is None:
        raise SystemExit(f"reference suite: collecting the tests failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return collected


if __name__ == "__main__":
    sys.exit(main())
