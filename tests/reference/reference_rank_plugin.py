"""pytest plugin for one rank of a reference-suite run (tests/reference/suite.py starts it).

Loaded with `-p reference_rank_plugin` in every process of the job. It

- builds the job's one strategy when a test first asks for one (so a test may configure
  TensorFlow's devices first, as Keras' integration test does): `tfdist.HorovodStrategy()` (mode
  "horovod", under horovodrun), or TensorFlow's `MultiWorkerMirroredStrategy` (mode "mwms", one
  replica per worker from TF_CONFIG: the oracle for "not applicable" reasons);
- puts it where the reference's tests construct theirs, without editing a test file: Keras 3's
  tests call `tf.distribute.MirroredStrategy([...])`, so that name (and MWMS's) returns it;
  tf-keras' tests take `combinations.multi_worker_mirrored_2x1_cpu`, whose strategy factory
  returns it (with one worker per process: the job itself is the cluster);
- keeps the ranks in lock step: a rank starts a test only once every rank has started it (read
  from the progress files), so a test that left one rank behind in a collective never lets the
  next test's collectives pair with it; the runner sees the stall and names the test;
- writes this rank's progress to REFERENCE_OUT/rank<R>.jsonl, a line per event (start, end with
  outcome and a short message), flushed at once, so a hang or crash still names its test, and
  on SIGUSR2 (the runner's, before it stops a hung job) every thread's stack to rank<R>.stacks;
- keeps to the tests it was given (REFERENCE_SELECT, a JSON list of test ids; without it, the
  tf.distribute tests that `picking` finds), and gives their
  modules what Keras' repository gives them and its sdist lacks: a `conftest` with
  `skip_if_backend`, and (for other backends' branches the TensorFlow backend never takes)
  `jax` and `torch` placeholders that raise if anything is used.
"""

import faulthandler
import json
import os
import signal
import sys
import time
import types

import tfdist  # first: this rank's threads and pinning are set before TensorFlow loads  # noqa: F401

import pytest
import tensorflow as tf

import picking

MODE = os.environ.get("REFERENCE_MODE", "horovod")
COLLECT_ONLY = os.environ.get("REFERENCE_COLLECT_ONLY") == "1"  # the runner's listing: no strategy
_state = {"strategy": None, "log": None, "rank": 0, "size": 1, "outcomes": {}}


def job_strategy():
    """The job's one strategy (built on first use; a test asking for any strategy gets it)."""
    if _state["strategy"] is None:
        if MODE == "horovod":
            _state["strategy"] = tfdist.HorovodStrategy()
        else:
            # The real TensorFlow class, kept before the names are swapped below.
            _state["strategy"] = _ORIGINAL_MWMS()
    return _state["strategy"]


_ORIGINAL_MWMS = tf.distribute.MultiWorkerMirroredStrategy


class SwappedStrategy:
    """Stands where a test constructs MirroredStrategy / MWMS: returns the job's strategy."""

    def __new__(cls, *args, **kwargs):
        return job_strategy()


def _swap_keras3_names():
    tf.distribute.MirroredStrategy = SwappedStrategy
    tf.distribute.MultiWorkerMirroredStrategy = SwappedStrategy
    tf.distribute.experimental.MultiWorkerMirroredStrategy = SwappedStrategy


def _swap_tf_keras_slot():
    """tf-keras' tests name their strategies through TensorFlow's combination objects; the slot
    with one CPU replica per worker (a chief and a worker: 2 tasks) becomes the job's strategy,
    run in this process (the job itself is the cluster: no multi-process runner)."""
    from tensorflow.python.distribute import strategy_combinations

    slot = strategy_combinations.multi_worker_mirrored_2x1_cpu
    assert tf.__internal__.distribute.combinations.multi_worker_mirrored_2x1_cpu is slot
    slot._distribution_fn = job_strategy
    slot.has_chief, slot.num_workers, slot._pool_runner_fn = False, 1, None


def _keep_mwms_context():
    """Mode "mwms": Keras' tests reset TensorFlow's context and split the CPU into two logical
    devices for a MirroredStrategy in one process; a reset would take the workers' cluster away
    from the job's MWMS (every op then fails with "/job:worker/... unknown device"). With one
    replica per worker neither is needed, so in this mode both are left out (tfdist's mode runs
    them as written)."""
    from tensorflow.python.eager import context

    context._reset_context = lambda: None
    tf.config.set_logical_device_configuration = lambda *args, **kwargs: None


def _rank_and_size():
    if COLLECT_ONLY:
        return 0, 1
    if MODE == "horovod":  # from horovodrun's environment: Horovod starts with the strategy
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    config = json.loads(os.environ["TF_CONFIG"])
    return int(config["task"]["index"]), len(config["cluster"]["worker"])


def _placeholder(name):
    module = types.ModuleType(name)

    def refuse(attribute):
        if attribute.startswith("__"):  # a probe such as inspect.getmodule's (AutoGraph reads __file__)
            raise AttributeError(attribute)
        raise ImportError(f"{name} is not installed: this reference run uses the TensorFlow backend only "
                          f"(a test reached {name}.{attribute})")

    module.__getattr__ = refuse
    return module


def _stand_ins():
    """Keras 3's test modules import jax and torch at the top; tf-keras' need neither."""
    import importlib.util

    if os.environ.get("REFERENCE_SUITE") == "tf_keras":
        return
    for name in ("jax", "torch"):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = _placeholder(name)


def _absl_flags_parsed():
    """absl's flags (tf-keras' test combinations read them) parse sys.argv, which is pytest's
    here ("Unknown command line flag 'p'"): parse the program name alone, as `absltest.main` does
    for a test run without flags."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])


def pytest_configure(config):
    _stand_ins()
    _absl_flags_parsed()
    if not COLLECT_ONLY and MODE == "mwms":
        _keep_mwms_context()
    _state["rank"], _state["size"] = _rank_and_size()
    _swap_keras3_names()
    if os.environ.get("REFERENCE_SUITE") == "tf_keras":
        _swap_tf_keras_slot()
    path = os.path.join(os.environ["REFERENCE_OUT"], f"rank{_state['rank']}.jsonl")
    _state["log"] = open(path, "a")
    # The runner sends SIGUSR2 before it stops a hung job: every thread's stack, to a file.
    _state["stacks"] = open(os.path.join(os.environ["REFERENCE_OUT"], f"rank{_state['rank']}.stacks"), "w")
    faulthandler.register(signal.SIGUSR2, file=_state["stacks"], all_threads=True)
    _write(pid=os.getpid())  # horovodrun starts each rank in a session of its own: the runner signals it by pid


def _write(**event):
    _state["log"].write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")
    _state["log"].flush()


def pytest_collection_modifyitems(session, config, items):
    wanted = os.environ.get("REFERENCE_SELECT")
    if wanted is not None:
        wanted = set(json.loads(wanted))
        keep = [item.nodeid in wanted for item in items]
    elif os.environ.get("REFERENCE_SUITE") == "tf_keras":
        keep = [picking.is_tf_keras_slot_test(item) for item in items]
    elif os.environ.get("REFERENCE_SUITE") == "selftest":
        keep = [True] * len(items)
    else:
        keep = [picking.is_keras3_distribute_test(item) for item in items]
    config.hook.pytest_deselected(items=[item for item, k in zip(items, keep) if not k])
    items[:] = [item for item, k in zip(items, keep) if k]
    _write(collected=[item.nodeid for item in items])


def _same_test_on_every_rank(nodeid):
    """Wait until every rank has started `nodeid` (read from their progress files, not through a
    collective: a rank still inside the previous test would pair it with its own collective)."""
    if _state["size"] == 1:
        return
    others = [os.path.join(os.environ["REFERENCE_OUT"], f"rank{r}.jsonl") for r in range(_state["size"])
              if r != _state["rank"]]
    marker = json.dumps(nodeid)
    while not all(_started(path, marker) for path in others):
        time.sleep(0.05)  # the runner stops the job if another rank never gets here


def _started(path, marker):
    try:
        with open(path) as f:
            return f'"start": {marker}' in f.read()
    except FileNotFoundError:
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _write(start=item.nodeid)
    _same_test_on_every_rank(item.nodeid)


def pytest_runtest_logreport(report):
    outcomes = _state["outcomes"].setdefault(report.nodeid, [])
    if report.failed or (report.when == "call") or (report.when == "setup" and report.skipped):
        message = ""
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)[-800:]
        elif report.skipped and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])
        outcomes.append({"when": report.when, "outcome": report.outcome, "message": message[:800]})
    if report.when == "teardown":
        results = _state["outcomes"].pop(report.nodeid, [])
        failed = [r for r in results if r["outcome"] == "failed"]
        skipped = [r for r in results if r["outcome"] == "skipped"]
        outcome = "failed" if failed else "skipped" if skipped else "passed"
        first = (failed or skipped or [{}])[0]
        _write(end=report.nodeid, outcome=outcome, when=first.get("when"), message=first.get("message", ""))
