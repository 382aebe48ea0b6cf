"""The GPU tier's job (tests/test_gpu.py): a GPU per rank, NCCL, the 1-process weights (also under
XLA), loss scaling.

    HOROVOD_TIMELINE=DYNAMIC horovodrun -np 2 --gloo python tests/multirank/gpu_checks.py --out DIR
    python tests/multirank/gpu_checks.py --out DIR --reference      # one process, the global batch

`--device cpu` runs the same code on the CPU: a way to check this script where no GPU is.
Each rank writes DIR/rank<R>.json; the test compares them.
"""

import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tfdist import collectives  # noqa: E402
from tfdist.tuning import gpu
from precision_checks import Record  # noqa: E402  (loss scale and weights after every step)

keras = keras_module()
STEPS, BATCH, BAD_STEP = 6, 16, 2  # global batch; 0-based step whose last row (rank 1's) holds an inf


def device_facts(strategy):
    import tensorflow as tf

    return {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "tf_visible_gpus": [d.name for d in tf.config.get_visible_devices("GPU")],
        "in_effect": gpu.in_effect(),
        "replica_device": strategy.extended.worker_devices[0],
        "tuning": strategy.tuning_plan.summary() if strategy.tuning_plan else None,
        "transport": collectives.transport(strategy.extended.worker_devices[0]),
        "auto_policy": keras.mixed_precision.global_policy().name,  # HorovodStrategy(precision="auto")
    }


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(STEPS * BATCH, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")


def model_of(seed):
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", kernel_initializer=init),
                             keras.layers.Dense(1, kernel_initializer=init)])


def timeline_activities(path):
    """The collective activities Horovod's timeline recorded (NCCL_ALLREDUCE, GLOO_ALLREDUCE, ...)."""
    text = "".join(open(p).read() for p in glob.glob(path + "*"))
    return sorted(set(re.findall(r'"((?:NCCL|GLOO|MPI|CCL)_[A-Z_]+)"', text)))


def float32_training(strategy, out, reference, results, jit_compile=False):
    """fit on the global batch: weights on every rank equal one process's; NCCL carries the exchange.

    With `jit_compile`, XLA compiles the step around the allreduce (tfdist.exchange.xla); the results go
    under "xla_weights" (one process compiles the whole step)."""
    keras.mixed_precision.set_global_policy("float32")
    x, y = data()
    with strategy.scope():
        model = model_of(seed=strategy.rank if not reference else 0)  # ranks start apart: broadcast aligns them
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", jit_compile=jit_compile)
    if jit_compile:
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        results["xla_weights"] = [w.tolist() for w in model.get_weights()]
        return
    timeline = os.path.join(out, "timeline.json")
    recording = not reference and collectives.timeline_mode() == "dynamic"
    if recording:
        collectives.start_timeline(timeline)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    if recording:
        collectives.stop_timeline()
        if strategy.rank == 0:
            results["timeline_activities"] = timeline_activities(timeline)
    results["weights"] = [w.tolist() for w in model.get_weights()]
    results["variable_devices"] = sorted({getattr(v, "device", None) or v.value.device for v in model.trainable_variables})


def loss_scaling(strategy, results):
    """mixed_float16 with an inf in rank 1's part of one global batch: every rank skips that step."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(seed=1)
    if strategy.rank == 1:
        x[BAD_STEP * BATCH + BATCH - 1] = np.inf  # the last row of a global batch is rank 1's
    with strategy.scope():
        model = model_of(seed=3)
        optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=optimizer, loss="mse")
    record = Record(optimizer)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    results["compute_dtype"] = model.layers[0].compute_dtype
    results["loss_scaling"] = record.steps
    keras.mixed_precision.set_global_policy("float32")


def main():
    parser = worker_parser(reference=True)
    parser.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    args = parser.parse_args()
    device = "gpu" if args.device == "gpu" else "/cpu:0"
    strategy = tfdist.HorovodStrategy(device, precision="auto" if args.device == "gpu" else None)
    results = {"facts": device_facts(strategy)}
    float32_training(strategy, args.out, args.reference, results)
    float32_training(strategy, args.out, args.reference, results, jit_compile=True)
    if not args.reference:
        loss_scaling(strategy, results)
    write_results(args.out, strategy.rank, results)


if __name__ == "__main__":
    main()
