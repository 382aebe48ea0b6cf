"""Horovod's own API on Keras 3 and tf-keras, with tfdist's Horovod build: one 2-rank launch per flavour.

tests/multirank/horovod_api_checks.py runs, as a Horovod user would (no tfdist strategy),
DistributedGradientTape with a local source, SyncBatchNormalization, DistributedOptimizer with
the broadcast, metric-average and warmup callbacks in fit (also with backward_passes_per_step=2),
load_model, a LossScaleOptimizer inside DistributedOptimizer with a float16 overflow on one
rank, and the flows of Horovod's two TF2 examples (docs/MIGRATING.md). Checked here: what the
ranks hold is equal where Horovod makes it so, equals a numpy replay of the same training, and is
the same on Keras 3 as on tf-keras. Without tfdist's patches (tfdist/horovod_build/patches/) the Keras 3
launch fails at its first check.
"""

import numpy as np
import pytest

from conftest import ROOT, flavor_env, run_job

WORKER = ROOT / "tests" / "multirank" / "horovod_api_checks.py"
FLAVOURS = ("keras3", "tf_keras")
SIZE = 2
# Keras 3 and tf-keras run the same float32 TensorFlow kernels here: measured, their weights are
# bit-identical and their logged losses differ by at most 7.5e-9. 1e-5 is float32 rounding over a
# few hundred operations, so the comparisons hold on other CPUs and still catch any real change
# (a step not all-reduced, skipped or applied twice moves the weights by 1e-3 or more).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {flavour: run_job([WORKER], tmp_path_factory.mktemp(f"hvd-api-{flavour}"), np=SIZE,
                             env=flavor_env(flavour), timeout=300) for flavour in FLAVOURS}


def arrays(values):
    return [np.asarray(v, dtype=np.float64) for v in values]


def assert_close(got, want, what, tolerance=TOLERANCE):
    for g, w in zip(arrays(got), arrays(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance, err_msg=what)


@pytest.mark.multirank
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tape_reduces_all_but_the_registered_local_source(runs, flavour):
    ranks = [runs[flavour][r]["tape"] for r in range(SIZE)]
    if flavour == "keras3":
        assert ranks[0]["variable_type"] == "keras.src.backend.Variable"  # a Keras 3 variable, not a tf.Variable
    mean_bias = np.mean([arrays(r["local"])[1] for r in ranks], axis=0)
    for rank, got in enumerate(ranks):
        for mode in ("eager", "function"):
            kernel, bias = arrays(got[mode])
            np.testing.assert_allclose(bias, mean_bias, rtol=1e-6, err_msg=f"{flavour} {mode} rank {rank}: bias")
            np.testing.assert_allclose(kernel, arrays(got["local"])[0] / SIZE, rtol=1e-6,
                                       err_msg=f"{flavour} {mode} rank {rank}: the local kernel")
    assert not np.allclose(arrays(ranks[0]["local"])[0], arrays(ranks[1]["local"])[0])  # the ranks' gradients differ


@pytest.mark.multirank
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_sync_batch_norm_normalizes_with_the_global_batch(runs, flavour):
    ranks = [runs[flavour][r]["syncbn"] for r in range(SIZE)]
    x = np.concatenate([np.asarray(r["x"], dtype=np.float64) for r in ranks])
    mean, variance = x.mean(axis=0), x.var(axis=0)
    assert not np.allclose(np.asarray(ranks[0]["x"]).mean(axis=0), mean, atol=0.1)  # each rank alone is off
    for rank, got in enumerate(ranks):
        np.testing.assert_allclose(got["moving_mean"], mean, rtol=1e-5, atol=1e-5, err_msg=f"{flavour} rank {rank}")
        np.testing.assert_allclose(got["moving_variance"], variance, rtol=1e-5, err_msg=f"{flavour} rank {rank}")
        expected = (np.asarray(got["x"]) - mean) / np.sqrt(variance + got["epsilon"])
        np.testing.assert_allclose(got["outputs"], expected, rtol=1e-4, atol=1e-5, err_msg=f"{flavour} rank {rank}")


def replay(ranks, batch, bpps):
    """The fit of check_fit in numpy (float64): each rank's gradient of its batch's MSE at its own
    weights, averaged over the ranks (after bpps local batches, divided by bpps), applied with the
    learning rate the warmup callback set; rank 0's weights everywhere after the first batch.
    Returns the weights and the per-epoch losses, averaged over the ranks."""
    weights = [arrays(r["start"]) for r in ranks]
    rates, steps = ranks[0]["rates"], len(ranks[0]["x"]) // batch
    summed = [[np.zeros_like(w) for w in weights[0]] for _ in ranks]
    losses = []
    for step, rate in enumerate(rates):
        begin = (step % steps) * batch
        if step % steps == 0:
            losses.append(0.0)
        for r, data in enumerate(ranks):
            x = np.asarray(data["x"], dtype=np.float64)[begin:begin + batch]
            y = np.asarray(data["y"], dtype=np.float64)[begin:begin + batch]
            error = x @ weights[r][0] + weights[r][1] - y
            losses[-1] += np.mean(error ** 2) / steps / len(ranks)
            summed[r] = [summed[r][0] + 2 * x.T @ error / error.size, summed[r][1] + 2 * error.sum(axis=0) / error.size]
        if (step + 1) % bpps == 0:
            update = [sum(s[i] for s in summed) / len(ranks) / bpps for i in range(2)]
            weights = [[w - rate * u for w, u in zip(ws, update)] for ws in weights]
            summed = [[np.zeros_like(w) for w in weights[0]] for _ in ranks]
        if step == 0:  # BroadcastGlobalVariablesCallback, on_batch_end of the first batch
            weights = [weights[0]] * len(ranks)
    return weights[0], losses


@pytest.mark.multirank
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("check, bpps", [("fit", 1), ("fit_bpps2", 2)])
def test_distributed_optimizer_and_callbacks_in_fit_equal_the_numpy_replay(runs, flavour, check, bpps):
    ranks = [runs[flavour][r][check] for r in range(SIZE)]
    assert not np.allclose(arrays(ranks[0]["start"])[0], arrays(ranks[1]["start"])[0])  # the broadcast matters
    batch, epochs, steps = 8, 2, 4
    warmup = [0.1 / SIZE * ((e + (b + 1) / steps) * (SIZE - 1) / epochs + 1) for e in range(epochs) for b in range(steps)]
    np.testing.assert_allclose(ranks[0]["rates"], warmup, rtol=1e-6)  # LearningRateWarmupCallback's schedule
    np.testing.assert_allclose(ranks[0]["lr_logged"], [warmup[steps - 1], warmup[-1]], rtol=1e-6)
    weights, losses = replay(ranks, batch, bpps)
    for rank, got in enumerate(ranks):
        assert got["iterations"] == epochs * steps, (flavour, check, rank)
        assert_close(got["weights"], weights, f"{flavour} {check} rank {rank}: weights")
        np.testing.assert_allclose(got["loss"], losses, rtol=TOLERANCE, err_msg=f"{flavour} {check} rank {rank}: "
                                   "History's loss (MetricAverageCallback averages it over the ranks)")
    if flavour == "keras3":  # the wrapper keeps the optimizer's class name and module
        assert ranks[0]["class"] == "keras.src.optimizers.sgd.SGD"


@pytest.mark.multirank
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_load_model_wraps_the_saved_optimizer_with_its_state(runs, flavour):
    ranks = [runs[flavour][r]["load_model"] for r in range(SIZE)]
    for rank, got in enumerate(ranks):
        assert got["optimizer_class"] == "Adam" and got["distributed"], (flavour, rank, got["optimizer_class"])
        assert got["iterations"] == 2, (flavour, rank)
        assert_close(got["optimizer_variables"], got["saved_optimizer_variables"], f"{flavour} rank {rank}: Adam's slots")
    # trained on each rank's own data after loading: all-reduced, so still equal
    assert_close(ranks[1]["weights_after_training_on"], ranks[0]["weights_after_training_on"], flavour, tolerance=0)
    if flavour == "keras3":
        assert ranks[0]["plain_optimizer"] == "keras.src.optimizers.adam.Adam"  # loads without Horovod too


@pytest.mark.multirank
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_float16_overflow_on_one_rank_skips_the_step_on_both(runs, flavour):
    """Only the second batch (finite everywhere, the same on both ranks) is applied: one SGD step of
    MSE from W = 0.1, b = 0 on x = 1, y = 1 gives W = 0.1 + 0.01 * 1.2 and b = 0.012."""
    for rank in range(SIZE):
        got = runs[flavour][rank]["mixed_precision"]
        assert_close(got["weights"], [np.full((4, 1), 0.112), [0.012]], f"{flavour} rank {rank}", tolerance=1e-4)
        assert got["loss_scale"] == 2.0 ** 14, (flavour, rank)  # halved once, from 2**15


@pytest.mark.multirank
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_horovods_examples_train_identical_ranks(runs, flavour):
    for example in ("keras_mnist", "mnist"):
        ranks = [runs[flavour][r][example] for r in range(SIZE)]
        assert_close(ranks[1]["weights"], ranks[0]["weights"], f"{flavour} {example}: rank 1 vs rank 0", tolerance=0)
        assert ranks[1]["files"] == [], f"{flavour} {example}: only rank 0 saves"
    keras_mnist = runs[flavour][0]["keras_mnist"]
    assert keras_mnist["files"] == ["checkpoint-1.h5", "checkpoint-2.h5"]
    assert runs[flavour][0]["mnist"]["files"] == ["checkpoint", "checkpoints-1.data-00000-of-00001", "checkpoints-1.index"]
    loss = keras_mnist["history"]["loss"]
    assert loss == runs[flavour][1]["keras_mnist"]["history"]["loss"] and loss[-1] < loss[0] - 0.05, loss
    losses = runs[flavour][0]["mnist"]["losses"]
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.multirank
def test_keras3_trains_as_tf_keras(runs):
    keras3, tf_keras = runs["keras3"][0], runs["tf_keras"][0]
    for check in ("fit", "fit_bpps2", "keras_mnist", "mnist"):
        assert_close(keras3[check]["weights"], tf_keras[check]["weights"], f"{check}: Keras 3 vs tf-keras")
    np.testing.assert_allclose(keras3["keras_mnist"]["history"]["loss"], tf_keras["keras_mnist"]["history"]["loss"],
                               rtol=TOLERANCE)
    np.testing.assert_allclose(keras3["mnist"]["losses"], tf_keras["mnist"]["losses"], rtol=TOLERANCE)


def test_example_flows_make_the_keras3_changes_migrating_lists():
    """docs/MIGRATING.md's two changes, read from the scripts the tests run: `compile` without
    `experimental_run_tf_function`, and the optimizer's `variables` broadcast as a list."""
    import ast

    def tree(name):
        return ast.parse((ROOT / "tests" / "multirank" / name).read_text())

    compiles = [node for node in ast.walk(tree("hvd_keras_mnist.py"))
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "compile"]
    assert len(compiles) == 1 and {k.arg for k in compiles[0].keywords} == {"loss", "optimizer", "metrics"}
    loop = tree("hvd_mnist.py")
    called = {id(node.func) for node in ast.walk(loop) if isinstance(node, ast.Call)}
    variables = [node for node in ast.walk(loop) if isinstance(node, ast.Attribute) and node.attr == "variables"
                 and getattr(node.value, "id", None) == "optimizer"]
    assert variables and not any(id(node) in called for node in variables)  # `optimizer.variables`, never `()`
    doc = (ROOT / "docs" / "MIGRATING.md").read_text()
    assert "experimental_run_tf_function=False" in doc and "opt.variables()" in doc
