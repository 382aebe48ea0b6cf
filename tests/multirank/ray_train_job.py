"""Train under Ray Train's TensorflowTrainer with tfdist.HorovodStrategy() and record each rank.

    python tests/multirank/ray_train_job.py --out DIR --workers 2 --flavour tf_keras
    python tests/multirank/ray_train_job.py --out DIR --workers 2 --flavour keras3 --kill
    python tests/multirank/ray_train_job.py --out DIR --reference      # 1 process, no Ray

A local Ray cluster (`ray.init()` on this machine) starts the workers; Ray writes each one's
TF_CONFIG and, on every worker, TF_USE_LEGACY_KERAS=1. `--flavour keras3` takes the documented way
past that (TF_USE_LEGACY_KERAS=0 first in the train function, then `import keras`). Each rank writes
DIR/rank<R>.json: replicas, chief, flavour, the final weights after EPOCHS epochs at one global
batch, the ids of the Ray Data rows its distributed dataset gave it, and the attempt it finished in.
`--kill`: in the first attempt rank 1 kills itself (SIGKILL) in the middle of epoch 2;
FailureConfig(max_failures=1) lets Ray start the group again, and Keras' BackupAndRestore on the
run's storage resumes it. DIR/driver.json: what `trainer.fit()` returned and the attempts.
"""

import argparse
import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GLOBAL_BATCH = 16
ROWS = 80  # 5 steps an epoch at the global batch
EPOCHS = 3
DATA_ROWS = 100  # the Ray Data rows: 100 / workers each, batches of 8 (partial last ones)
KILL_AT = (1, 2)  # (epoch, batch): rank 1 dies there in the first attempt


def train(config):
    """The train function: the same code in every Ray worker and in the one-process reference."""
    if config["flavour"] == "keras3":
        os.environ["TF_USE_LEGACY_KERAS"] = "0"  # Ray set 1; before anything imports keras
    sys.path.insert(0, config["here"])
    import tfdist

    strategy = tfdist.HorovodStrategy()  # first: a user's strategy meets Ray's TF_USE_LEGACY_KERAS
    from common import keras_module, write_results
    from train_checks import build_model, loss_fn, make_data

    keras = keras_module()
    rank = strategy.rank
    attempt = _count_attempt(config, rank)
    x, y = make_data("dense", ROWS)
    with strategy.scope():
        model = build_model("dense", seed=100 + rank)  # ranks start different; the broadcast aligns them
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss_fn())
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(config["storage"], "backup"))]
    if config["ray"]:
        from ray.train.tensorflow.keras import ReportCheckpointCallback

        callbacks.append(ReportCheckpointCallback(metrics={"loss": "loss"}))
    if config["kill"] and rank == 1 and attempt == 1:
        callbacks.append(_KillAt(keras, *KILL_AT))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    results = {"rank": rank, "size": strategy.size, "replicas": strategy.num_replicas_in_sync,
               "is_chief": strategy.is_chief, "keras": keras.__name__, "attempt": attempt,
               "steps": int(model.optimizer.iterations.numpy()),
               "final": [w.tolist() for w in model.get_weights()]}
    if config["ray"]:
        results.update(_ray_data_checks(strategy, keras, build_model, loss_fn))
    write_results(config["out"], rank, results)


def _count_attempt(config, rank):
    """1 in the first attempt of this rank, 2 in the next (a file per attempt on the run's storage)."""
    attempt = 1
    while os.path.exists(os.path.join(config["storage"], f"attempt-{rank}-{attempt}")):
        attempt += 1
    open(os.path.join(config["storage"], f"attempt-{rank}-{attempt}"), "w").close()
    return attempt


def _KillAt(keras, epoch, batch):
    class KillAt(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            self.epoch = e

        def on_train_batch_end(self, b, logs=None):
            if (self.epoch, b) == (epoch, batch):
                os.kill(os.getpid(), signal.SIGKILL)

    return KillAt()


def _ray_data_checks(strategy, keras, build_model, loss_fn):
    """This rank's Ray Data shard through the strategy: the ids it gave this rank, and a fit on it
    (a new model: tf-keras' BackupAndRestore leaves a model that cannot fit again, in one process too)."""
    import ray.train

    shard = ray.train.get_dataset_shard("train")
    ids = []
    for batch in strategy.experimental_distribute_dataset(
            shard.to_tf(feature_columns="id", label_columns="y", batch_size=8)):
        ids += [int(i) for i in strategy.experimental_local_results(batch[0])[0].numpy().ravel()]
    with strategy.scope():
        model = build_model("dense", seed=200 + strategy.rank)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss_fn())
    model.fit(shard.to_tf(feature_columns="x", label_columns="y", batch_size=8), epochs=1, verbose=0)
    return {"ray_data_ids": ids, "ray_data_steps": int(model.optimizer.iterations.numpy()),
            "after_ray_data": [w.tolist() for w in model.get_weights()]}


def run_ray(args, config):
    import numpy as np
    import ray
    import ray.train
    from ray.train.tensorflow import TensorflowTrainer

    ray.init(num_cpus=args.workers, include_dashboard=False, object_store_memory=512 * 2**20,
             log_to_driver=True, configure_logging=False)
    rng = np.random.default_rng(3)
    rows = [{"id": i, "x": rng.normal(size=6).astype("float32"), "y": int(i % 3)} for i in range(DATA_ROWS)]
    trainer = TensorflowTrainer(
        train, train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="tfdist", storage_path=os.path.join(config["storage"], "ray"),
                                       failure_config=ray.train.FailureConfig(max_failures=args.max_failures)),
        datasets={"train": ray.data.from_items(rows)})
    try:
        result, error = trainer.fit(), None
    except Exception as e:  # Ray raises the workers' error once it gives up
        result, error = None, str(e)
    ray.shutdown()
    attempts = sorted(p for p in os.listdir(config["storage"]) if p.startswith("attempt-"))
    with open(os.path.join(args.out, "driver.json"), "w") as f:
        json.dump({"error": error, "attempts": attempts, "metrics": result and result.metrics,
                   "checkpoint": _checkpoint_weights(result and result.checkpoint, args.flavour)}, f)


def _checkpoint_weights(checkpoint, flavour):
    """The weights of the model in Ray's last reported checkpoint (ReportCheckpointCallback's model.keras)."""
    if checkpoint is None:
        return None
    os.environ["TF_USE_LEGACY_KERAS"] = "1" if flavour == "tf_keras" else "0"
    sys.path.insert(0, HERE)
    from common import keras_module

    with checkpoint.as_directory() as path:
        model = keras_module().models.load_model(os.path.join(path, "model.keras"), compile=False)
        return {"files": sorted(os.listdir(path)), "weights": [w.tolist() for w in model.get_weights()]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--flavour", choices=("keras3", "tf_keras"), default="tf_keras")
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--max-failures", type=int, default=1)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    storage = os.path.join(os.path.abspath(args.out), "storage")
    os.makedirs(storage, exist_ok=True)
    config = {"here": HERE, "out": os.path.abspath(args.out), "storage": storage, "flavour": args.flavour,
              "kill": args.kill, "ray": not args.reference}
    if args.reference:
        os.environ["TF_USE_LEGACY_KERAS"] = "1" if args.flavour == "tf_keras" else "0"
        train(config)
    else:
        run_ray(args, config)


if __name__ == "__main__":
    main()
