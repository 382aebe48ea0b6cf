"""tf_cnn_benchmarks-style training throughput: ResNet50 (and smaller models) with tfdist or peers.

    horovodrun -np 2 --gloo tfdist-benchmark --model resnet50 --batch_size 32
    tfdist-benchmark --variable_update none          # one process, TF defaults

Prints a header (hardware, versions, precision, global batch, data, tuning), per-interval
`images/sec: X +/- Y (jitter = Z)` and `total images/sec` with warm-up batches excluded, and
writes every step time to --json. With --data_dir (TFRecords written by pipelines) the input
pipeline is included in the timing. With --epochs, it trains whole epochs of --data_dir instead,
evaluates on --eval_dir after each one, and reports the final test accuracy and the wall time to
reach --target_accuracy (stopping there).

--variable_update:
  tfdist   HorovodStrategy + model.fit (Keras 3, or tf-keras with --keras tf_keras)
  horovod  Horovod's documented TF2 loop: hvd.DistributedGradientTape + hvd.broadcast_variables,
           on a tf-keras model (Horovod's own Keras layer fails on both Keras flavours with TF 2.21)
  mwms     tf.distribute.MultiWorkerMirroredStrategy + tf-keras model.fit (its fit fails on Keras 3,
           keras-team/keras#20585); workers from TF_CONFIG, or derived from horovodrun's environment
           (ranks on one host, each on a port the OS gave it, swapped through Gloo's rendezvous
           store) when TF_CONFIG is unset
  none     one process, plain model.fit, TensorFlow's default threading (the baseline)
"""

import argparse
import gc
import json
import os
import sys
import time

from tfdist.benchmark import arg_checks, argtypes
from tfdist.tuning import startup
from tfdist.benchmark import thread_cpu, transformers
from tfdist.benchmark.inputs import distributed_input, input_dataset
from tfdist.benchmark.models import (MODELS, build_model, model_name, synthetic_description,
                                     training_loss)
from tfdist.benchmark.modes import mwms_tf_config, start
from tfdist.benchmark.timing import StepTimer, accuracy_summary, report

PARSER = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
PARSER.add_argument("--model", default="resnet50", type=model_name,
                    help=f"one of {', '.join(MODELS)}, or module:function(image_size, num_classes) returning "
                         "an uncompiled Keras model")
PARSER.add_argument("--batch_size", type=argtypes.positive_int, default=32, help="per replica")
PARSER.add_argument("--image_size", type=argtypes.positive_int, default=224)
PARSER.add_argument("--num_classes", type=argtypes.positive_int, default=1000)
PARSER.add_argument("--seq_len", type=argtypes.positive_int, default=128, help="tokens a sequence (transformer models)")
PARSER.add_argument("--optimizer", choices=["momentum", "adamw", "sgd", "adagrad"], default="momentum",
                    help="SGD with momentum 0.9 (tf_cnn_benchmarks'), AdamW (what transformers train with), "
                    "plain SGD, or Adagrad (TFRS's tutorials': both update only the embedding rows looked up)")
PARSER.add_argument("--matmul_gflops", type=argtypes.positive_float, help="this machine's matmul rate in the "
                    "run's precision (scripts/benchmarks/matmul_rate.py): transformer models report their "
                    "model FLOP rate as a fraction of it")
PARSER.add_argument("--num_warmup_batches", type=argtypes.nonnegative_int, default=2)
PARSER.add_argument("--num_batches", type=argtypes.positive_int, default=10)
PARSER.add_argument("--display_every", type=argtypes.positive_int, default=5)
PARSER.add_argument("--data_dir", help="TFRecord dataset (pipelines manifest); default: synthetic")
PARSER.add_argument("--eval_dir", help="TFRecord test set for --epochs: accuracy after every epoch")
PARSER.add_argument("--epochs", type=argtypes.positive_int,
                    help="train whole epochs of --data_dir (instead of --num_batches)")
PARSER.add_argument("--target_accuracy", type=argtypes.fraction,
                    help="with --epochs: stop once test accuracy reaches it")
PARSER.add_argument("--seed", type=argtypes.nonnegative_int, help="keras.utils.set_random_seed before the model is built "
                    "(weights, dropout): runs that differ only in precision or compression start alike")
PARSER.add_argument("--learning_rate", type=argtypes.positive_float, default=0.01,
                    help="per replica (scaled by the replica count)")
PARSER.add_argument("--lr_decay", choices=["none", "polynomial"], default="none", help="with --epochs: polynomial "
                    "(power 2) to 0 at the last step, so the last epochs' accuracies settle and compare")
PARSER.add_argument("--precision", default="float32",
                    choices=["float32", "mixed_float16", "mixed_bfloat16", "fp16", "bf16", "auto"],
                    help="fp16/bf16: mixed_float16/mixed_bfloat16; auto: tfdist only (HorovodStrategy picks by hardware)")
PARSER.add_argument("--steps_per_execution", type=argtypes.positive_int, default=1,
                    help="Keras modes: steps a call of the step function (compile's); each call's time is split "
                    "evenly over its steps, so the warm-up and timed batches must be multiples of it")
PARSER.add_argument("--xla", action="store_true", help="jit_compile the train step (on 2+ ranks XLA compiles around the allreduce)")
PARSER.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                    help="auto: this rank's GPU where one is visible, else the CPU; gpu: fail, naming what "
                    "was found, where none is")
PARSER.add_argument("--num_intra_threads", type=argtypes.nonnegative_int, help="0: TensorFlow's default")
PARSER.add_argument("--num_inter_threads", type=argtypes.nonnegative_int, help="0: TensorFlow's default")
PARSER.add_argument("--variable_update", default="tfdist", choices=["tfdist", "horovod", "mwms", "none"])
PARSER.add_argument("--keras", default="keras3", choices=["keras3", "tf_keras"])
PARSER.add_argument("--no_tuning", action="store_true", help="tfdist: HorovodStrategy(tuning=False)")
PARSER.add_argument("--onednn", choices=["default", "on", "off"], default="default",
                    help="TF_ENABLE_ONEDNN_OPTS before TensorFlow loads (default: leave it as TF/tuning decide)")
PARSER.add_argument("--loss_scale", action="store_true", help="wrap the optimizer in Keras' LossScaleOptimizer (a "
                    "float16 policy does so by itself): its cost in float32, or its exchange during backprop")
PARSER.add_argument("--fused_batchnorm", choices=["on", "off"], default="on",
                    help="tfdist on Keras 3: BatchNormalization on TensorFlow's fused kernel (HorovodStrategy's default)")
PARSER.add_argument("--compression", default=None, help="tfdist: HorovodStrategy(compression=...): fp16, "
                    "bf16, powersgd[:rank], topk[:density]")
PARSER.add_argument("--bucket_mb", type=argtypes.nonnegative_float,
                    help="tfdist: HorovodStrategy(bucket_mb=...): 0 one collective after backprop, else buckets "
                    "of about that many MB (default: each gradient as it is ready)")
PARSER.add_argument("--shard_optimizer_state", action="store_true",
                    help="tfdist: HorovodStrategy(shard_optimizer_state=True), each rank keeps 1/N of the optimizer state")
PARSER.add_argument("--horovod_cycle_time_ms", type=argtypes.positive_float,
                    help="Horovod's background cycle (tfdist, horovod)")
PARSER.add_argument("--profile_dir", help="TF-profile the steps after the warm-up on rank 0 (callbacks.ProfileSteps); "
                    "summarise with tfdist-profile. Those steps run slower: compare profiles, not speeds")
PARSER.add_argument("--profile_steps", type=argtypes.positive_int,
                    help="with --profile_dir: how many steps to profile (default 3; at most --num_batches). "
                    "Short steps need more of them for a difference of a millisecond to stand out")
PARSER.add_argument("--global_input", action="store_true",
                    help="strategies: fit a finite dataset batched by the global batch (experimental_distribute_dataset, "
                         "split as MWMS splits it) instead of per-replica batches (distribute_datasets_from_function)")
PARSER.add_argument("--json", help="write the result (every step time) here (rank 0)")


def run_keras_fit(args, keras, strategy, rank, horovod=None, processes=None):
    """model.fit under `strategy` (None: none, or with `horovod`, horovod.tensorflow.keras, Horovod's
    Keras path: its DistributedOptimizer and broadcast); returns (timer, data source, accuracy log).
    The timer takes the CPU a timed step of this process's threads and of `processes` ({name: pid})."""
    import contextlib

    timer = StepTimer(None if args.epochs else timed_steps(args), processes, steps_per_call=args.steps_per_execution)

    class Timing(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            timer.begin()

        def on_train_batch_end(self, batch, logs=None):
            timer.end(logs["loss"])

    replicas = strategy.num_replicas_in_sync if strategy else horovod.size() if horovod else 1
    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)
    train, source, plan = distributed_input(args, strategy, training=True)
    learning_rate = args.learning_rate * replicas
    if args.epochs and args.lr_decay == "polynomial":
        from tfdist.callbacks import polynomial_decay

        learning_rate = polynomial_decay(learning_rate, total_steps=args.epochs * plan.steps_per_epoch)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build_model(keras, args.model, args.image_size, args.num_classes, args.seq_len)
        optimizer = make_optimizer(keras, args, learning_rate)
        if args.loss_scale:
            optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
        optimizer = horovod.DistributedOptimizer(optimizer) if horovod else optimizer
        model.compile(optimizer=optimizer,
                      loss="sparse_categorical_crossentropy", jit_compile=args.xla,
                      steps_per_execution=args.steps_per_execution,
                      metrics=["accuracy"] if args.epochs else None)
    keep_iterators(model)
    fit_callbacks = [Timing()] + ([horovod.callbacks.BroadcastGlobalVariablesCallback(0)] if horovod else [])
    if args.profile_dir:
        from tfdist.callbacks import ProfileSteps

        first = args.num_warmup_batches
        profiled = min(args.profile_steps or 3, args.num_batches)
        fit_callbacks.append(ProfileSteps(args.profile_dir, steps=(first, first + profiled),
                                      batch_size=args.batch_size))
    if not args.epochs:
        steps = args.num_warmup_batches + args.num_batches
        model.fit(train, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=fit_callbacks)
        return timer, source, None
    test, _, test_plan = distributed_input(args, strategy, training=False) if args.eval_dir else (None, None, None)
    # tf-keras needs a step count for a distributed dataset: this rank's batches (ranks may differ)
    test_steps = -(-test_plan.records // args.batch_size) if test_plan and args.keras == "tf_keras" else None
    history, start = [], time.perf_counter()

    class EpochEnd(keras.callbacks.Callback):
        """After each epoch and Keras' evaluation of --eval_dir: record, print, stop at the target."""

        def on_epoch_end(self, epoch, logs=None):
            accuracy = float(logs["val_accuracy"]) if test is not None else None
            history.append({"epoch": epoch + 1, "test_accuracy": accuracy, "seconds": time.perf_counter() - start,
                            "learning_rate": logs["learning_rate"]})
            if rank == 0:
                print(f"epoch {epoch + 1}: test accuracy {accuracy}  ({history[-1]['seconds']:.1f} s)", flush=True)
            if args.target_accuracy and accuracy is not None and accuracy >= args.target_accuracy:
                self.model.stop_training = True

    from tfdist.callbacks import LearningRateLogger

    # One fit for every epoch, so one training iterator, held to the end (see _exit_now).
    model.fit(train, steps_per_epoch=plan.steps_per_epoch, epochs=args.epochs, validation_data=test,
              validation_steps=test_steps, verbose=0, callbacks=[*fit_callbacks, LearningRateLogger(), EpochEnd()])
    return timer, source, history


def make_optimizer(keras, args, learning_rate):
    if args.optimizer == "adamw":
        return keras.optimizers.AdamW(learning_rate, weight_decay=0.01)
    if args.optimizer == "adagrad":
        return keras.optimizers.Adagrad(learning_rate)
    return keras.optimizers.SGD(learning_rate, momentum=0.9 if args.optimizer == "momentum" else 0.0)


def timed_steps(args):
    """(warm-up steps, all steps): the window whose CPU a step the timer takes."""
    return args.num_warmup_batches, args.num_warmup_batches + args.num_batches


def run_horovod_loop(args, keras, processes=None):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    model = build_model(keras, args.model, args.image_size, args.num_classes, args.seq_len)
    optimizer = make_optimizer(keras, args, args.learning_rate * hvd.size())
    loss_fn = training_loss(keras, args.model)
    ds, source, _ = input_dataset(args)

    @tf.function
    def step(images, labels, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(model, images, labels)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables(), root_rank=0)
        return loss

    timer = StepTimer(timed_steps(args), processes)
    batches = iter(ds.take(args.num_warmup_batches + args.num_batches))
    KEPT.append(batches)
    for i, (images, labels) in enumerate(batches):
        timer.begin()
        timer.end(step(images, labels, i == 0))
    return timer, source, None


# Iterators held until the process ends (_exit_now): releasing one can stall for seconds.
KEPT = []


def keep_iterators(model):
    """Hold every iterator that fit and evaluate pass to the model's step functions (see _exit_now)."""
    for name in ("train_function", "test_function"):
        getattr(model, f"make_{name}")()  # sets model.train_function / test_function
        step = getattr(model, name)

        def holding(iterator, step=step):
            if not any(kept is iterator for kept in KEPT[-2:]):
                KEPT.append(iterator)
            return step(iterator)

        setattr(model, name, holding)


def main():
    """The tfdist-benchmark command: parse, run, print and write the results, then end the process (_exit_now)."""
    args = PARSER.parse_args()
    args.precision = {"fp16": "mixed_float16", "bf16": "mixed_bfloat16"}.get(args.precision, args.precision)
    arg_checks.check(args, PARSER.error)
    os.environ["TF_USE_LEGACY_KERAS"] = "1" if args.keras == "tf_keras" else "0"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.variable_update != "tfdist" or args.no_tuning:
        startup.undo()  # `import tfdist` applied tfdist's early settings; these modes compare against none
    if args.onednn != "default":
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if args.onednn == "on" else "0"
    if args.variable_update == "mwms":
        mwms_tf_config()
    if args.device == "cpu" and args.variable_update != "tfdist":
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # the peers place ops on a visible GPU by default

    import tensorflow as tf

    from tfdist import collectives
    from tfdist.tuning import plan as tuning_lib
    from tfdist.tuning.cache import cpu_model

    from tfdist.errors import GPUNotFoundError

    try:
        keras, strategy, tuning, size, rank = start(args)
    except GPUNotFoundError as e:
        sys.exit(f"tfdist-benchmark --device gpu: {e}")
    global_batch = args.batch_size * size
    effect = tuning_lib.in_effect()

    header = [
        f"Model: {args.model}  Keras: {keras.__name__} {keras.__version__}  TF: {tf.__version__}  "
        f"Horovod: {collectives.horovod_version()}",
        f"Hardware: {os.cpu_count()} CPUs ({cpu_model()}), GPUs: {len(tf.config.list_physical_devices('GPU'))}"
        + (f", oneDNN limited to ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}" if os.environ.get("ONEDNN_MAX_CPU_ISA") else ""),
        f"Mode: {args.variable_update}  ranks: {size}  batch/replica: {args.batch_size}  "
        f"global batch: {global_batch}  precision: {keras.mixed_precision.global_policy().name}  xla: {args.xla}"
        + (f"  steps a call: {args.steps_per_execution}" if args.steps_per_execution > 1 else ""),
        f"Data: {args.data_dir or synthetic_description(args.model)}",
        *([f"Tokens: {args.seq_len} a sequence, {global_batch * args.seq_len} a step; model FLOPs a training "
           f"token: {transformers.train_flops_per_token(args.model, args.seq_len) / 1e6:.1f} M; optimizer: "
           f"{args.optimizer}{', sharded state' if args.shard_optimizer_state else ''}"]
          if transformers.is_token_model(args.model) else []),
        f"Tuning: {tuning}",
        f"In effect (rank 0, as TensorFlow reports it): {tuning_lib.describe(effect)}",
        f"Warm-up batches (excluded): {args.num_warmup_batches}, timed batches: "
        f"{f'{args.epochs} epoch(s)' if args.epochs else args.num_batches}",
    ]
    if rank == 0:
        print("\n".join(header), flush=True)

    # As timeit does: no garbage collection while steps are timed. A collection there could free
    # an iterator left in a reference cycle, a stall of seconds (see _exit_now). Not turned back
    # on: the process ends right after the results.
    gc.disable()
    if args.variable_update == "horovod":
        timer, source, history = run_horovod_loop(args, keras)
    else:
        timer, source, history = run_keras_fit(args, keras, strategy, rank)
    tokens = transformers.is_token_model(args.model)
    total = report(args, timer, global_batch, rank, *(("tokens", args.seq_len) if tokens else ()))
    if rank == 0 and timer.thread_cpu:
        print(f"rank 0, timed steps: {thread_cpu.describe(timer.thread_cpu)}")
    result = {"args": vars(args), "argv": sys.argv, "header": header, "ranks": size, "global_batch": global_batch,
              "total_images_per_sec": total, "step_seconds": timer.times, "step_losses": timer.losses,
              "thread_cpu_per_step": timer.thread_cpu, "thread_cpu_by_name": timer.thread_cpu_by_name,
              "warmup_steps_excluded": args.num_warmup_batches, "data": source, "tuning": tuning,
              "in_effect": {**effect, "cpus": list(effect["cpus"])}, "early_settings": startup.state(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if tokens:
        result.update(token_rates(args, total, rank))
    if history is not None:
        result.update(accuracy_summary(args, history))
        if rank == 0:
            target = (f"  time to {args.target_accuracy}: {result['seconds_to_target']}"
                      if args.target_accuracy else "")
            print(f"final test accuracy: {result['final_test_accuracy']}{target}")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    _exit_now(0)


def token_rates(args, examples_per_sec, rank):
    """Tokens/s, the model's FLOP rate and (with --matmul_gflops) its fraction of the matmul rate."""
    flops = transformers.train_flops_per_token(args.model, args.seq_len)
    tokens_per_sec = examples_per_sec * args.seq_len
    gflops = tokens_per_sec * flops / 1e9
    rates = {"total_tokens_per_sec": tokens_per_sec, "train_flops_per_token": flops, "model_gflops_per_sec": gflops}
    line = f"model GFLOP/s: {gflops:.1f} ({flops / 1e6:.1f} MFLOP a token, all ranks)"
    if args.matmul_gflops:
        rates["efficiency"] = gflops / args.matmul_gflops
        line += f"; {100 * rates['efficiency']:.1f}% of the matmul rate given ({args.matmul_gflops:g} GFLOP/s)"
    if rank == 0:
        print(line, flush=True)
    return rates


def _exit_now(code):
    """End the process once every result is printed, written and flushed, skipping Python's teardown.

    Releasing a tf.data iterator joins its autotuning thread (`RootDataset::Iterator`'s model
    thread, in `Model::OptimizeLoop`), which sleeps between optimisations for a period that
    doubles up to a minute as the iterator ages. Cancellation wakes it, but tsl's
    `CancellationManager::StartCancelWithStatus` runs that wake-up callback before it sets
    `is_cancelled_`: a thread that wakes at once (likely on a rank pinned to one core, as
    tfdist's tuning does with 2 ranks on 2 cores) sees no cancellation and sleeps out the rest
    of its period while the main thread waits (TF_CPP_VMODULE=model=2 shows `Waiting for 5120
    ms.`, `Waiting for 5117 ms.`, then a 5.1 s stall). A fit per epoch left every epoch's
    iterator alive until Python's teardown: 19-22 s after 3 epochs, about 4.5 minutes after 20.
    So the benchmark runs one fit, holds its iterators (KEPT) and never releases them: exit
    handlers run (Horovod's shutdown, and the watchdog's goodbye, without which the other ranks
    would report this one as dead), then the process ends. Only this command ends so; the
    functions above return as usual.
    """
    import atexit

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
