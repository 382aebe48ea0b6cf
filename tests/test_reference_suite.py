"""Keras 3's own tf.distribute tests, unmodified, with HorovodStrategy swapped in (issue 35).

tests/reference/suite.py downloads the installed Keras' sdist (cached in $TFDIST_CACHE), picks its
tf.distribute tests and runs them on 2 ranks in lock step; each outcome must be what
tests/reference/expectations.toml says: pass, or "n/a" with a reason that must also make the test
fail under MultiWorkerMirroredStrategy with one replica per worker (checked here too). The
runner's own handling of a hang and a crash is checked on a small suite of ours (selftest/).
"""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, _tail, make_job_env

SUITE = ROOT / "tests" / "reference" / "suite.py"
pytestmark = pytest.mark.multirank
sys.path.insert(0, str(SUITE.parent))
import suite as reference  # noqa: E402


def run_suite(out, *args, timeout=1500):
    done = subprocess.run([sys.executable, str(SUITE), "--out", str(out), *args], cwd=ROOT, env=make_job_env(),
                          capture_output=True, text=True, timeout=timeout)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    assert results is not None, f"the runner wrote no results:\n{_tail(done.stdout + done.stderr)}"
    return done, results["results"]


def test_keras3_tf_distribute_tests_pass_or_are_named_not_applicable(tmp_path):
    done, results = run_suite(tmp_path, "--np", "2")
    assert done.returncode == 0, _tail(done.stdout + done.stderr)
    table = reference.expectations("keras3", 2)
    # the n/a ones are left out of this run; everything else ran to an outcome, none hung or crashed
    assert all(r["outcome"] in ("passed", "skipped") for r in results.values()), _tail(done.stdout)
    assert not set(results) & {t for t, e in table.items() if e.startswith("n/a")}
    assert sum(r["outcome"] == "passed" for r in results.values()) >= 15, done.stdout  # the files were found
    for test, r in results.items():
        assert set(r["ranks"]) == {"0", "1"}, test  # both ranks reached an outcome


def test_not_applicable_ones_fail_under_mwms_with_one_replica_per_worker(tmp_path):
    done, results = run_suite(tmp_path, "--mode", "mwms", "--only-na")
    assert done.returncode == 0, _tail(done.stdout + done.stderr)
    table = reference.expectations("keras3", 2)
    named = {t for t, e in table.items() if e.startswith("n/a")}
    assert set(results) == named, "every test expectations.toml calls n/a exists in this Keras and ran under MWMS"
    assert not [t for t, r in results.items() if r["outcome"] == "passed"]


def test_runner_names_a_hang_and_a_crash_and_goes_on(tmp_path):
    done, results = run_suite(tmp_path, "--suite", "selftest", "--all", "--grace", "5", timeout=600)
    assert done.returncode == 0, _tail(done.stdout + done.stderr)
    outcome = {test.split("::")[-1]: r for test, r in results.items()}
    assert outcome["test_1_passes"]["outcome"] == "passed"
    assert outcome["test_2_leaves_rank_0_waiting"]["outcome"] == "hung"
    assert outcome["test_2_leaves_rank_0_waiting"]["message"].startswith("rank 0 still in it 5 s after rank 1 failed")
    assert outcome["test_3_rank_1_dies"]["outcome"] == "crashed"
    assert outcome["test_3_rank_1_dies"]["message"].startswith("rank 1 exited in it")
    assert outcome["test_4_passes_after_both"]["outcome"] == "passed"


def _loop_sum(n):
    import tensorflow as tf

    total = tf.constant(0)
    for i in tf.range(n):  # AutoGraph makes this a while loop; unconverted, a graph cannot iterate it
        total += i
    return total


def test_placeholders_answer_module_probes_so_autograph_still_converts(monkeypatch):
    """The jax/torch stand-ins refuse real use but answer probes such as `__file__` as a missing
    attribute: AutoGraph's source lookup reads every module's `__file__`, and an ImportError there
    made it run tf-keras' training loops unconverted (a for-loop over a distributed dataset inside
    a tf.function then traced forever)."""
    import inspect

    import tensorflow as tf
    import reference_rank_plugin as plugin

    monkeypatch.setitem(sys.modules, "jax_placeholder_probe", plugin._placeholder("jax"))
    with pytest.raises(ImportError, match=r"jax is not installed.*jax\.numpy"):
        sys.modules["jax_placeholder_probe"].numpy
    assert getattr(sys.modules["jax_placeholder_probe"], "__file__", None) is None
    assert inspect.getmodule(_loop_sum.__code__) is sys.modules[__name__]
    assert int(tf.function(_loop_sum)(tf.constant(4))) == 6
