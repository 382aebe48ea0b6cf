"""Run tfdist's 2-rank checks on every TensorFlow x Python cell of the declared range, as a pip user installs.

    python3 scripts/version_matrix.py                      # every cell of CELLS, one after another
    python3 scripts/version_matrix.py 2.16/3.11 2.21/3.13  # chosen cells (TF/Python)
    python3 scripts/version_matrix.py 2.16/3.11/keras=3.3.3  # a cell with another Keras 3
    python3 scripts/version_matrix.py --table              # only rewrite the table from recorded cells

Per cell, in $TFDIST_CACHE/matrix (default ~/.cache/tfdist/matrix; never in the checkout):

1. a new venv with that Python (python3.X on the PATH, else pyenv's), then
   `pip install '<tfdist wheel>[cpu,test]' 'tensorflow-cpu==TF.*' 'tf-keras==TF.*'`: the declared
   extras, with TensorFlow held to the cell's minor version (the newest patch release);
2. `tfdist-install-horovod` in it: Horovod built for that TensorFlow and Python once, then cached
   in ~/.cache/tfdist/wheels like every build;
3. SUBSET below, from a copy of the checkout taken at the start (later edits do not reach a run)
   without its tfdist sources (the tests import the installed wheel), with pytest's JUnit report: 2 ranks equal one process (12 optimizer/model cases) on Keras 3
   and on tf-keras, the preemption stop and exact resume (Keras 3, through tfdist-run), the
   README's first run on 2 ranks, and Keras' TensorBoard summaries and profile read back by the
   installed profile plugin (one process).

Each cell's result goes to matrix/results/<cell>.json; the table of all recorded cells, with the
machine (lscpu's model, cores) and the date of each, replaces the block between the
`<!-- version-matrix -->` markers in docs/INSTALL.md (--docs PATH elsewhere). A cell that cannot
work says why (no TensorFlow wheel for that Python, the build's error, the failing tests).
About 10 to 15 minutes a cell on 2 cores, of which the Horovod build is 4 to 6.
"""

import argparse
import json
import os
import re
import shutil
import sys
import time
import xml.etree.ElementTree as ET

import target_env
from target_env import TargetError

CELLS = ("2.16/3.11", "2.18/3.11", "2.20/3.11", "2.21/3.11", "2.21/3.10", "2.21/3.12", "2.21/3.13")
SUBSET = {  # column -> pytest node ids (run from the checkout's copy)
    "2 ranks = 1 process, Keras 3": ["tests/test_multirank.py::test_two_ranks_equal_one_process_with_double_batch[keras3"],
    "2 ranks = 1 process, tf-keras": ["tests/test_multirank.py::test_two_ranks_equal_one_process_with_double_batch[tf_keras"],
    "preemption resume": ["tests/test_preemption.py::test_preempted_job_saves_at_one_step_and_resumes_exactly[keras3]"],
    "README first run": ["tests/test_example.py::test_first_run_script_trains_on_two_ranks_as_the_quick_start_shows"],
    "TensorBoard profile": ["tests/test_profiling.py::test_profile_loads_in_the_plugin_and_scalars_are_written"],
}
MARK = "<!-- version-matrix -->"


def parse_cell(text):
    """"2.16/3.11[/keras=3.3.3]" -> dict."""
    match = re.fullmatch(r"(\d+\.\d+(?:\.\d+)?)/(3\.\d+)((?:/[\w-]+=[\w.]+)*)", text)
    if not match:
        raise SystemExit(f"version_matrix: cell {text!r}: expected TF/PYTHON, e.g. 2.16/3.11 (or 2.16/3.11/keras=3.3.3)")
    pins = dict(pin.split("=") for pin in match.group(3).split("/") if pin)
    return {"name": text.replace("/", "_").replace("=", "-"), "cell": text, "tf": match.group(1),
            "python": match.group(2), "pins": pins}


def tf_requirement(tf):
    """`==2.16.*` for a minor version, `==2.16.2` for a release."""
    return f"=={tf}.*" if tf.count(".") == 1 else f"=={tf}"


def node_ids():
    """The pytest arguments of SUBSET: a whole id where it ends with "]", else the test function
    (every parametrization: the columns pick theirs by prefix)."""
    return sorted({node if node.endswith("]") else node.split("[")[0] for nodes in SUBSET.values() for node in nodes})


def outcomes(report):
    """{test id: (outcome, seconds, message)} from a JUnit XML report."""
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name")  # the test function with its parameters
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome, message = ("skipped" if tag == "skipped" else "failed"), (element.get("message") or "")[:300]
        found[name] = (outcome, float(case.get("time", 0)), message)
    return found


def summarize(found):
    """{column: "12/12 passed" or the failure} from the per-test outcomes."""
    columns = {}
    for column, prefixes in SUBSET.items():
        picked = {name: result for name, result in found.items()
                  if any(name.startswith(p.split("::")[-1]) for p in prefixes)}
        passed = sum(1 for outcome, _, _ in picked.values() if outcome == "passed")
        failed = [f"{name.split('::')[-1]}: {message}" for name, (outcome, _, message) in picked.items()
                  if outcome != "passed"]
        columns[column] = {"passed": passed, "total": len(picked), "seconds": round(sum(r[1] for r in picked.values())),
                           "failures": failed[:3]}
    return columns


def cell_venv(cell, python, path, wheel, log):
    """The cell's venv: a new one, or ("reused:" + its python) the one an earlier run installed for
    the same TensorFlow and Python, with this run's tfdist wheel put in (TensorFlow's install is
    most of a cell's time on 2 cores; the pip install after this makes the rest as declared)."""
    venv_python = os.path.join(path, "bin", "python")
    if os.path.exists(venv_python):
        found = target_env.installed(venv_python, "tensorflow-cpu")["tensorflow-cpu"] or ""
        if found == cell["tf"] or found.startswith(cell["tf"] + "."):  # "2.16.2" for "2.16.2" or "2.16"
            target_env.checked([venv_python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel],
                               "reinstalling tfdist's wheel", log)
            return "reused:" + venv_python
    return target_env.make_venv(python, path, log)


def run_cell(cell, work, src, wheel, log, prepare_only=False):
    """Install, build and test one cell; returns its result record (it never raises TargetError)."""
    result = {**cell, "machine": target_env.machine(), "tfdist": SOURCE_COMMIT, "began": time.strftime("%H:%M")}
    began = time.monotonic()
    try:
        python = target_env.find_python(cell["python"])
        result["python_full"] = target_env.python_version(python)
        step = time.monotonic()
        # one venv per TensorFlow and Python: a cell with pins (keras=3.3.3) changes the plain cell's
        # venv, so run it after that one (the pins stay until its TensorFlow changes)
        venv = cell_venv(cell, python, os.path.join(work, "venvs", f"{cell['tf']}_{cell['python']}"), wheel, log)
        result["reused_venv"] = venv.startswith("reused:")
        venv = venv.removeprefix("reused:")
        minor = ".".join(cell["tf"].split(".")[:2])
        requirements = [f"{wheel}[cpu,test]", f"tensorflow-cpu{tf_requirement(cell['tf'])}", f"tf-keras=={minor}.*",
                        *(f"{name}=={version}" for name, version in cell["pins"].items())]
        try:
            target_env.checked([venv, "-m", "pip", "install", "-q", *requirements], "pip install", log)
        except TargetError as e:
            raise TargetError(f"{e} (for {' '.join(requirements[1:])} on Python {result['python_full']})") from None
        result["install_s"] = round(time.monotonic() - step)
        result["versions"] = target_env.installed(venv, "tensorflow-cpu", "keras", "tf-keras", "tensorboard",
                                                  "xprof", "numpy")
        step = time.monotonic()
        result["horovod_wheel"], result["horovod_build_s"] = target_env.horovod_wheel(venv, log=log)
        result["horovod_s"] = round(time.monotonic() - step)
        if prepare_only:
            result["ok"], result["prepared"] = True, True
            return result
        report = os.path.join(work, "results", cell["name"] + ".xml")
        step = time.monotonic()
        code, tail = target_env.run([venv, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", f"--junitxml={report}",
                                     *node_ids()], log, env=target_env.clean_env(venv), cwd=src, timeout=4 * 3600)
        result["tests_s"] = round(time.monotonic() - step)
        result["pytest"] = tail.strip().splitlines()[-1] if tail.strip() else f"exit {code}"
        result["columns"] = summarize(outcomes(report)) if os.path.exists(report) else {}
        result["ok"] = code == 0 and all(c["passed"] == c["total"] > 0 for c in result["columns"].values())
    except (TargetError, OSError) as e:
        result["ok"], result["error"] = False, str(e)
    result["total_s"] = round(time.monotonic() - began)
    return result


def cell_row(r):
    versions = r.get("versions", {})
    if r.get("error"):
        blank = " |" * (len(SUBSET) + 1)
        return (f"| {r.get('python_full', r['python'])} | {r['tf']} | | | not run: {r['error'][:400]} |{blank} "
                f"{r['machine']['date']} |")
    build = f"built in {r['horovod_build_s']} s" if r.get("horovod_build_s") else f"cached ({r['horovod_s']} s)"
    cells = []
    for column in SUBSET:
        c = r["columns"].get(column, {"passed": 0, "total": 0, "failures": []})
        if not c["total"]:
            cells.append("not run")
            continue
        mark = "pass" if c["passed"] == c["total"] else "**FAIL**"
        cells.append(f"{mark} {c['passed']}/{c['total']}" + (f" ({'; '.join(c['failures'])[:200]})" if c["failures"] else ""))
    return (f"| {r['python_full']} | {versions.get('tensorflow-cpu')} | {versions.get('keras')} | {versions.get('tf-keras')} "
            f"| {build} | {' | '.join(cells)} | {r['tests_s']} s | {r['machine']['date']} |")


def table(results):
    machines = sorted({f"{r['machine']['cpu']}, {r['machine']['cores']} cores" for r in results})
    lines = [f"Machine: {'; '.join(machines)} (lscpu). tfdist: {', '.join(sorted({r['tfdist'] for r in results}))}. "
             "Command: `python3 scripts/version_matrix.py`. Passed/run tests per check; seconds of the whole subset.", "",
             f"| Python | TensorFlow | Keras | tf-keras | Horovod | {' | '.join(SUBSET)} | tests | date |",
             "| --- " * (len(SUBSET) + 7) + "|"]
    order = {cell: i for i, cell in enumerate(CELLS)}
    for r in sorted(results, key=lambda r: (order.get(r["cell"], len(order)), r["cell"])):
        lines.append(cell_row(r))
    return "\n".join(lines)


def write_docs(path, text):
    with open(path) as f:
        doc = f.read()
    parts = doc.split(MARK)
    if len(parts) != 3:
        raise SystemExit(f"version_matrix: {path} needs two {MARK} lines around the table")
    with open(path, "w") as f:
        f.write(f"{parts[0]}{MARK}\n{text}\n{MARK}{parts[2]}")


def recorded(work):
    folder = os.path.join(work, "results")
    if not os.path.isdir(folder):
        return []
    return [json.load(open(os.path.join(folder, n))) for n in sorted(os.listdir(folder)) if n.endswith(".json")]


SOURCE_COMMIT = "?"


def main(argv=None):
    global SOURCE_COMMIT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("cells", nargs="*", help=f"TF/PYTHON cells (default: {' '.join(CELLS)})")
    cache = os.environ.get("TFDIST_CACHE") or os.path.expanduser("~/.cache/tfdist")
    parser.add_argument("--work", default=os.path.join(cache, "matrix"), help="venvs, logs, results (default: %(default)s)")
    parser.add_argument("--docs", default=os.path.join(target_env.ROOT, "docs", "INSTALL.md"),
                        help="the page whose marked block gets the table (default: %(default)s)")
    parser.add_argument("--table", action="store_true", help="only rewrite the table from the recorded cells")
    parser.add_argument("--prepare", action="store_true",
                        help="only make the venvs and build Horovod (no tests, nothing recorded): prepared cells "
                             "can be made side by side, and a later run reuses them and runs the tests alone")
    args = parser.parse_args(argv)
    cells = [parse_cell(c) for c in (args.cells or CELLS)]
    os.makedirs(os.path.join(args.work, "results"), exist_ok=True)
    if not args.table:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"  # runs side by side (--prepare) keep apart
        src = os.path.join(args.work, "src", run_id)
        SOURCE_COMMIT = target_env.snapshot(src)
        log = os.path.join(args.work, f"matrix-{run_id}.log")
        wheel = target_env.build_tfdist_wheel(src, os.path.join(args.work, "dist", run_id), log)
        for package in ("tfdist", "callbacks", "pipelines"):  # the tests import the installed wheel's
            shutil.rmtree(os.path.join(src, package))
        for cell in cells:
            print(f"version_matrix: {cell['cell']} ... (log: {log})", flush=True)
            result = run_cell(cell, args.work, src, wheel, log, args.prepare)
            if result.get("prepared"):
                print(f"version_matrix: {cell['cell']}: installed, Horovod ready, in {result['total_s']} s", flush=True)
                continue
            with open(os.path.join(args.work, "results", cell["name"] + ".json"), "w") as f:
                json.dump(result, f, indent=1)
            print(f"version_matrix: {cell['cell']}: {'ok' if result['ok'] else 'FAILED'} in {result['total_s']} s: "
                  f"{result.get('error') or result.get('pytest')}", flush=True)
    if args.prepare:
        return 0
    results = recorded(args.work)
    text = table(results)
    print(text)
    if results:
        write_docs(args.docs, text)
        print(f"version_matrix: the table of {len(results)} cells is in {args.docs}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
