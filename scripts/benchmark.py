"""tf_cnn_benchmarks-style training throughput: ResNet50 (and smaller models) with tfdist or peers.

    horovodrun -np 2 --gloo python scripts/benchmark.py --model resnet50 --batch_size 32
    python scripts/benchmark.py --variable_update none          # one process, TF defaults

Prints a header (hardware, versions, precision, global batch, data, tuning), per-interval
`images/sec: X +/- Y (jitter = Z)` and `total images/sec` with warm-up batches excluded, and
writes every step time to --json. With --data_dir (TFRecords written by pipelines) the input
pipeline is included in the timing; --eval also reports test accuracy on --eval_dir.

--variable_update:
  tfdist   HorovodStrategy + model.fit (Keras 3, or tf-keras with --keras tf_keras)
  horovod  Horovod's documented TF2 loop: hvd.DistributedGradientTape + hvd.broadcast_variables,
           on a tf-keras model (Horovod's own Keras layer fails on both Keras flavours with TF 2.21)
  none     one process, plain model.fit, TensorFlow's default threading (the baseline)
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

PARSER = argparse.ArgumentParser(description=__doc__.splitlines()[0])
PARSER.add_argument("--model", default="resnet50", choices=["resnet50", "mnist_cnn", "trivial"])
PARSER.add_argument("--batch_size", type=int, default=32, help="per replica")
PARSER.add_argument("--image_size", type=int, default=224)
PARSER.add_argument("--num_classes", type=int, default=1000)
PARSER.add_argument("--num_warmup_batches", type=int, default=2)
PARSER.add_argument("--num_batches", type=int, default=10)
PARSER.add_argument("--display_every", type=int, default=5)
PARSER.add_argument("--data_dir", help="TFRecord dataset (pipelines manifest); default: synthetic")
PARSER.add_argument("--precision", default="float32", help="float32, mixed_float16, mixed_bfloat16 or auto")
PARSER.add_argument("--xla", action="store_true", help="jit_compile the train step (one rank only)")
PARSER.add_argument("--num_intra_threads", type=int)
PARSER.add_argument("--num_inter_threads", type=int)
PARSER.add_argument("--variable_update", default="tfdist", choices=["tfdist", "horovod", "none"])
PARSER.add_argument("--keras", default="keras3", choices=["keras3", "tf_keras"])
PARSER.add_argument("--no_tuning", action="store_true", help="tfdist: HorovodStrategy(tuning=False)")
PARSER.add_argument("--json", help="write the result (every step time) here (rank 0)")


def build_model(keras, name, image_size, num_classes):
    from tfdist.precision import float32_softmax

    if name == "resnet50":
        logits = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3),
                                             classes=num_classes, classifier_activation=None)
    elif name == "mnist_cnn":
        logits = keras.Sequential([
            keras.Input((image_size, image_size, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"), keras.layers.Dense(num_classes),
        ])
    else:  # trivial: measures the input pipeline and framework overhead
        logits = keras.Sequential([keras.Input((image_size, image_size, 3)), keras.layers.Flatten(),
                                   keras.layers.Dense(num_classes)])
    return float32_softmax(logits)


def input_dataset(args, input_context=None):
    from pipelines import preprocessing, read_dataset

    if not args.data_dir:
        ds = preprocessing.synthetic_dataset(args.batch_size, image_size=args.image_size,
                                             num_classes=args.num_classes)
        return ds, "synthetic (one batch made once, no I/O)"
    mapper = preprocessing.example_mapper(training=True, image_size=args.image_size)
    ds, plan = read_dataset(args.data_dir, args.batch_size, input_context=input_context,
                            augment_fn=mapper)
    return ds, f"{args.data_dir} ({plan.records} records/rank, mode={plan.mode})"


class StepTimer:
    """Wall time of every step, the step's loss fetched so the step has really finished."""

    def __init__(self):
        self.times, self._start = [], None

    def begin(self):
        self._start = time.perf_counter()

    def end(self, loss):
        float(loss)
        self.times.append(time.perf_counter() - self._start)


def report(args, timer, global_batch, rank):
    timed = timer.times[args.num_warmup_batches:]
    speeds = [global_batch / t for t in timed]
    if rank == 0:
        for start in range(0, len(speeds), args.display_every):
            chunk = speeds[start : start + args.display_every]
            mean = statistics.mean(chunk)
            std = statistics.pstdev(chunk) if len(chunk) > 1 else 0.0
            mad = statistics.median([abs(s - statistics.median(chunk)) for s in chunk])
            print(f"{start + len(chunk)}\timages/sec: {mean:.2f} +/- {std:.2f} (jitter = {mad:.2f})")
        print(f"total images/sec: {len(timed) * global_batch / sum(timed):.2f}")
    return len(timed) * global_batch / sum(timed)


def run_keras_fit(args, keras, strategy):
    timer = StepTimer()

    class Timing(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            timer.begin()

        def on_train_batch_end(self, batch, logs=None):
            timer.end(logs["loss"])

    scope = strategy.scope() if strategy else _nullcontext()
    with scope:
        model = build_model(keras, args.model, args.image_size, args.num_classes)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", jit_compile=args.xla)
    if strategy:
        sources = []

        def dataset_fn(ctx):
            ds, source = input_dataset(args, ctx)
            sources.append(source)
            return ds

        ds = strategy.distribute_datasets_from_function(dataset_fn)
        source = sources[0]
    else:
        ds, source = input_dataset(args)
    steps = args.num_warmup_batches + args.num_batches
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[Timing()])
    return timer, source


def run_horovod_loop(args, keras):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    model = build_model(keras, args.model, args.image_size, args.num_classes)
    optimizer = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    ds, source = input_dataset(args)

    @tf.function
    def step(images, labels, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables(), root_rank=0)
        return loss

    timer = StepTimer()
    for i, (images, labels) in enumerate(ds.take(args.num_warmup_batches + args.num_batches)):
        timer.begin()
        timer.end(step(images, labels, i == 0))
    return timer, source


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def main():
    args = PARSER.parse_args()
    if args.variable_update == "horovod":
        args.keras = "tf_keras"
    os.environ["TF_USE_LEGACY_KERAS"] = "1" if args.keras == "tf_keras" else "0"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import tensorflow as tf

    import tfdist
    from tfdist.keras_flavour import keras_module

    keras = keras_module()
    strategy, tuning, size, rank = None, "TensorFlow defaults", 1, 0
    if args.variable_update == "tfdist":
        overrides = {k: v for k, v in (("intra_op_threads", args.num_intra_threads),
                                       ("inter_op_threads", args.num_inter_threads)) if v}
        strategy = tfdist.HorovodStrategy(precision=args.precision,
                                          tuning=False if args.no_tuning else (overrides or True))
        size, rank = strategy.size, strategy.rank
        tuning = strategy.tuning_plan.summary() if strategy.tuning_plan else "off"
    elif args.variable_update == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
        size, rank = hvd.size(), hvd.rank()
    if args.variable_update != "tfdist" and args.precision != "float32":
        keras.mixed_precision.set_global_policy(args.precision)
    global_batch = args.batch_size * size
    if rank == 0:
        import horovod

        print(f"Model: {args.model}  Keras: {keras.__name__} {keras.__version__}  TF: {tf.__version__}  "
              f"Horovod: {horovod.__version__}")
        print(f"Hardware: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
              f"GPUs: {len(tf.config.list_physical_devices('GPU'))}")
        print(f"Mode: {args.variable_update}  ranks: {size}  batch/replica: {args.batch_size}  "
              f"global batch: {global_batch}  precision: {keras.mixed_precision.global_policy().name}  "
              f"xla: {args.xla}")
        print(f"Data: {args.data_dir or 'synthetic (one batch made once, no I/O)'}")
        print(f"Tuning: {tuning}")
        print(f"Warm-up batches (excluded): {args.num_warmup_batches}, timed batches: {args.num_batches}",
              flush=True)

    if args.variable_update == "horovod":
        timer, source = run_horovod_loop(args, keras)
    else:
        timer, source = run_keras_fit(args, keras, strategy)
    total = report(args, timer, global_batch, rank)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": size, "global_batch": global_batch,
                       "total_images_per_sec": total, "step_seconds": timer.times,
                       "data": source, "tuning": tuning, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)


if __name__ == "__main__":
    main()
