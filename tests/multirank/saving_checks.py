"""Saving under horovodrun: MWMS-style code that saves and loads on every rank, in one job.

    horovodrun -np 2 --gloo python tests/multirank/saving_checks.py --dir SHARED --out OUT [--no-watchdog]

Every rank runs the same checks on files in SHARED (the chief writes shared paths, the other
ranks wait for it: tfdist.keras.chief_saves) and writes what it saw to OUT/rank<r>.json: per check,
the loads that succeeded and matched what was saved, errors, and the save numbers of the rank.
With --no-watchdog (no channel to the chief) it runs the few checks that still hold then.
"""

import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LogMessages, keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist import collectives  # noqa: E402
from tfdist.keras import chief_saves

keras = keras_module()
TF_KERAS = keras.__name__ == "tf_keras"
ITERATIONS = 20


def barrier(name):
    """All ranks meet here (a training step's allreduce would do the same)."""
    collectives.allreduce([tf.constant(1.0)], name=f"test.barrier.{name}")


def build_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    return model


def set_distinct_weights(model, iteration):
    """Weights only iteration `iteration` has, from rank 0 (a Horovod broadcast: also a barrier)."""
    rng = np.random.default_rng(1000 + iteration)
    values = [rng.normal(size=w.shape).astype("float32") for w in model.get_weights()]
    values = [collectives.broadcast(tf.constant(v), 0, name=f"test.weights.{iteration}.{i}").numpy()
              for i, v in enumerate(values)]
    model.set_weights(values)
    return values


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def save_load_loop(model, save, load, label):
    """ITERATIONS times: new weights, save on every rank, load on every rank, compare."""
    result = {"loaded": 0, "equal": 0, "errors": []}
    for i in range(ITERATIONS):
        expected = set_distinct_weights(model, i)
        try:
            save()
            weights = load()
            result["loaded"] += 1
            result["equal"] += same(weights, expected)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which names it
            result["errors"].append(f"{label} iteration {i}: {type(e).__name__}: {e}"[:500])
    return result


def listing(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else None


def check_keras_loops(shared):
    model = build_model()
    fresh = build_model()
    out = {}
    path = os.path.join(shared, "loop-model", "model.keras")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out["model.save"] = save_load_loop(
        model, lambda: model.save(path), lambda: keras.models.load_model(path, compile=False).get_weights(), "model")

    def loop_weights(path, label):
        os.makedirs(os.path.dirname(path), exist_ok=True)

        def load():
            fresh.load_weights(path)
            return fresh.get_weights()

        out[label] = save_load_loop(model, lambda: model.save_weights(path), load, label)

    loop_weights(os.path.join(shared, "loop-weights", "model.weights.h5"), "save_weights.h5")
    if TF_KERAS:
        loop_weights(os.path.join(shared, "loop-tf-weights", "weights"), "save_weights.tf")
    barrier("loops")
    out["files"] = {d: listing(os.path.join(shared, d)) for d in ("loop-model", "loop-weights", "loop-tf-weights")}
    return out


def check_tensorflow_apis(shared, strategy):
    out = {}
    with strategy.scope():
        variable = tf.Variable(tf.zeros([3]))
    module = tf.Module()
    module.v = variable

    def values(i):
        return np.arange(3, dtype="float32") + 10 * i

    def loop(label, save, load, n=5):
        result = {"loaded": 0, "equal": 0, "errors": [], "paths": []}
        for i in range(n):
            variable.assign(values(i))
            barrier(f"{label}.{i}")
            try:
                result["paths"].append(save(i))
                result["loaded"] += 1
                result["equal"] += bool(np.array_equal(load(i), values(i)))
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"{label} {i}: {type(e).__name__}: {e}"[:500])
        out[label] = result

    saved_model = os.path.join(shared, "saved_model")
    loop("tf.saved_model", lambda i: tf.saved_model.save(module, saved_model),
         lambda i: tf.saved_model.load(saved_model).v.numpy())

    def restored(path):
        target = tf.Variable(tf.zeros([3]))
        tf.train.Checkpoint(v=target).restore(path).expect_partial()
        return target.numpy()

    checkpoint = tf.train.Checkpoint(v=variable)
    write_prefix = os.path.join(shared, "ckpt-write", "state")
    loop("checkpoint.write", lambda i: checkpoint.write(write_prefix), lambda i: restored(write_prefix))
    save_prefix = os.path.join(shared, "ckpt-save", "ckpt")
    loop("checkpoint.save", lambda i: checkpoint.save(save_prefix),
         lambda i: restored(tf.train.latest_checkpoint(os.path.dirname(save_prefix))))

    manager_checkpoint = tf.train.Checkpoint(v=variable)
    shared_dir = os.path.join(shared, "manager")
    manager = tf.train.CheckpointManager(manager_checkpoint, shared_dir, max_to_keep=2)
    latest = []

    def load_latest(i):
        latest.append([tf.train.latest_checkpoint(shared_dir), manager.latest_checkpoint])
        return restored(latest[-1][0])

    loop("manager.shared_dir", lambda i: manager.save(), load_latest)
    out["manager.shared_dir"]["latest"] = latest
    barrier("manager")
    out["manager.shared_dir"]["files"] = listing(shared_dir)

    # The MWMS custom-training-loop tutorial: per-worker temp dirs, removed after each save.
    task_type, task_id = "worker", int(os.environ["HOROVOD_RANK"])
    checkpoint_dir = os.path.join(shared, "ctl", "ckpt")
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
    ctl_manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=variable), directory=write_checkpoint_dir,
                                             max_to_keep=1)

    def ctl_save(i):
        path = ctl_manager.save()
        if not is_chief(task_type, task_id):
            tf.io.gfile.rmtree(write_checkpoint_dir)
        return path

    loop("manager.mwms_ctl", ctl_save, lambda i: restored(tf.train.latest_checkpoint(checkpoint_dir)), n=3)
    return out


# The MWMS tutorials' helpers (multi_worker_with_keras, multi_worker_with_ctl).
def is_chief(task_type, task_id):
    return task_type is None or task_type == "chief" or (task_type == "worker" and task_id == 0)


def get_temp_dir(dirpath, task_id):
    temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not is_chief(task_type, task_id):
        dirpath = get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


def check_mwms_keras_tutorial(shared, strategy):
    """multi_worker_with_keras: fit, save to write_filepath, rmtree on non-chief, load_model everywhere."""
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    task_type, task_id = "worker", int(os.environ["HOROVOD_RANK"])
    model_path = os.path.join(shared, "mwms", "keras-model") + ("" if TF_KERAS else ".keras")  # tf-keras: SavedModel
    os.makedirs(os.path.dirname(model_path), exist_ok=True)
    write_model_path = write_filepath(model_path, task_type, task_id)
    out = {"write_model_path": write_model_path}
    try:
        model.save(write_model_path)
        if not is_chief(task_type, task_id):
            tf.io.gfile.rmtree(os.path.dirname(write_model_path))
        loaded = keras.models.load_model(model_path)
        out["equal"] = same(loaded.get_weights(), model.get_weights())
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"[:800]
    return out


def check_callbacks(shared, strategy):
    """ModelCheckpoint (every rank saves) and BackupAndRestore (Keras 3: the chief alone) in one fit."""
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")
    path = os.path.join(shared, "callbacks", "best.keras")
    callbacks = [keras.callbacks.ModelCheckpoint(path),
                 keras.callbacks.BackupAndRestore(os.path.join(shared, "callbacks", "backup"))]
    model.fit(x, x[:, :1], batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
    barrier("callbacks")
    loaded = keras.models.load_model(path, compile=False)
    return {"equal": same(loaded.get_weights(), model.get_weights())}


def check_chief_only_block(shared):
    model = build_model()
    path = os.path.join(shared, "chief-only-block", "model.keras")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    expected = set_distinct_weights(model, 100)
    with chief_saves.chief_only_saves():  # every rank calls it; nobody waits
        model.save(path)
    barrier("chief-only-block")
    return {"equal": same(keras.models.load_model(path, compile=False).get_weights(), expected),
            "files": listing(os.path.dirname(path))}


def check_timeout(shared, rank):
    """A save made by rank 1 alone: it waits TFDIST_SAVE_TIMEOUT, then fails naming the cause."""
    os.environ["TFDIST_SAVE_TIMEOUT"] = "3"
    out = {}
    if rank == 1:
        start = time.monotonic()
        try:
            build_model().save(os.path.join(shared, "rank1-alone.keras"))
            out["error"] = None
        except tfdist.TfdistError as e:
            out["error"], out["type"] = str(e), type(e).__name__
        out["seconds"] = time.monotonic() - start
    barrier("timeout")
    del os.environ["TFDIST_SAVE_TIMEOUT"]
    out["exists"] = os.path.exists(os.path.join(shared, "rank1-alone.keras"))
    return out


def check_horovod_style(shared, rank):
    model = build_model()
    out = {}
    expected = set_distinct_weights(model, 200)
    chief_path = os.path.join(shared, "horovod", "model.keras")
    os.makedirs(os.path.dirname(chief_path), exist_ok=True)
    if rank == 0:
        model.save(chief_path)  # Horovod style: the chief alone
    barrier("horovod")
    out["chief_file_equal"] = same(keras.models.load_model(chief_path, compile=False).get_weights(), expected)
    # Per-rank files: each rank writes its own, and every rank can load every one.
    model.save(os.path.join(shared, "horovod", f"rank{rank}.keras"))
    barrier("per-rank")
    out["per_rank_equal"] = [same(keras.models.load_model(os.path.join(shared, "horovod", f"rank{r}.keras"),
                                                          compile=False).get_weights(), expected)
                             for r in range(collectives.size())]
    # Then a save on every rank again (the chief is one save ahead in numbering): still whole files.
    shared_path = os.path.join(shared, "horovod", "after.keras")
    expected = set_distinct_weights(model, 201)
    model.save(shared_path)
    out["after_equal"] = same(keras.models.load_model(shared_path, compile=False).get_weights(), expected)
    barrier("horovod-end")
    out["files"] = listing(os.path.join(shared, "horovod"))
    return out


def check_without_watchdog(shared, rank):
    """No channel to the chief: files still whole, checkpoints of rank 1 in its temp dir."""
    model = build_model()
    path = os.path.join(shared, "unsynchronised", "model.keras")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out = {"loads_equal": 0, "errors": []}
    for i in range(5):
        expected = set_distinct_weights(model, 300 + i)
        try:
            model.save(path)
            out["loads_equal"] += same(keras.models.load_model(path, compile=False).get_weights(), expected)
        except Exception as e:  # noqa: BLE001
            out["errors"].append(f"{type(e).__name__}: {e}"[:500])
    checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
    out["checkpoint_path"] = checkpoint.save(os.path.join(shared, "unsynchronised", "ckpt", "c"))
    checkpoint_dir = os.path.join(shared, "unsynchronised", "ctl", "ckpt")
    write_checkpoint_dir = write_filepath(checkpoint_dir, "worker", rank)
    tf.train.CheckpointManager(checkpoint, write_checkpoint_dir, max_to_keep=1).save()
    if not is_chief("worker", rank):
        tf.io.gfile.rmtree(write_checkpoint_dir)  # as the MWMS tutorial does: the directory exists
    barrier("unsynchronised")
    out["files"] = listing(os.path.dirname(path))
    out["checkpoint_files"] = listing(os.path.join(shared, "unsynchronised", "ckpt"))
    return out


def main():
    parser = worker_parser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--no-watchdog", action="store_true")
    args = parser.parse_args()
    records = LogMessages()
    logger = logging.getLogger("tfdist")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    strategy = tfdist.HorovodStrategy(tuning=False, watchdog=not args.no_watchdog)
    rank = strategy.rank
    if args.no_watchdog:
        write_results(args.out, rank, {"checks": check_without_watchdog(args.dir, rank), "log": records.texts})
        return
    results = {"numbers": {}}

    def run(name, check, *check_args):
        results[name] = check(*check_args)
        results["numbers"][name] = chief_saves._state["number"]

    run("keras_loops", check_keras_loops, args.dir)
    run("tensorflow", check_tensorflow_apis, args.dir, strategy)
    run("mwms_keras", check_mwms_keras_tutorial, args.dir, strategy)
    run("callbacks", check_callbacks, args.dir, strategy)
    run("chief_only_block", check_chief_only_block, args.dir)
    run("timeout", check_timeout, args.dir, rank)
    run("horovod", check_horovod_style, args.dir, rank)
    results["log"] = records.texts
    write_results(args.out, rank, results)


if __name__ == "__main__":
    main()
