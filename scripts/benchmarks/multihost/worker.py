"""One rank of an emulated multi-host benchmark run: train N steps in one mode, write step times.

    # started by scripts/benchmarks/multihost_benchmark.py in each host namespace, with an srun step's SLURM_*
    # variables (tfdist, horovod) or TF_CONFIG (mwms):
    python scripts/benchmarks/multihost/worker.py --mode tfdist --bucket_mb 25 --model resnet50 --batch_size 8 \\
        --steps 5 --out /tmp/run1

Modes, all on tf-keras (or Keras 3 with --keras keras3) and the same model:
  tfdist   HorovodStrategy(bucket_mb=..., compression=...) + model.fit (bucket_mb 0: one collective
           per dtype, 'ready': each gradient as it exists); --cycle_ms sets Horovod's cycle
  horovod  Horovod's documented loop: hvd.DistributedGradientTape + hvd.broadcast_variables, after
           tfdist.launch.prepare() turned the SLURM_* variables into Horovod's Gloo environment
  horovod_fit  Horovod's Keras path, started the same way: model.fit with
           hvd.DistributedOptimizer and its BroadcastGlobalVariablesCallback (horovod.tensorflow.keras)
  mwms     tf.distribute.MultiWorkerMirroredStrategy + model.fit, workers from TF_CONFIG
  none     one process, plain model.fit (the 1-rank baseline; under none@each one per host, R from SLURM_PROCID)
Writes `rank<R>.json` in --out: every step time (warm-up included, and marked), the CPU a timed
step of the rank's threads by kind and of the emulated link's delay line, gradient bytes (a sparse
gradient as the rows it sends), the threads and cpus TensorFlow reports, and how the rank was launched.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # mlp:wide_mlp

LINK_PID = "EMULATED_LINK_PID"  # set by multihost_benchmark where a delay line joins the hosts
PARSER = argparse.ArgumentParser(description=__doc__.splitlines()[0])
PARSER.add_argument("--mode", required=True, choices=["tfdist", "horovod", "horovod_fit", "mwms", "none"])
PARSER.add_argument("--bucket_mb", default="0", help="MB, or 'ready' (each gradient as it exists)")
PARSER.add_argument("--cycle_ms", type=float, default=None, help="Horovod cycle for tfdist (default: tfdist's)")
PARSER.add_argument("--compression", default=None, help="HorovodStrategy(compression=...)")
PARSER.add_argument("--model", default="resnet50", help="a tfdist-benchmark model, or mlp:wide_mlp")
PARSER.add_argument("--batch_size", type=int, default=8, help="per rank")
PARSER.add_argument("--image_size", type=int, default=224)
PARSER.add_argument("--num_classes", type=int, default=1000)
PARSER.add_argument("--warmup", type=int, default=2)
PARSER.add_argument("--steps", type=int, default=5)
PARSER.add_argument("--keras", choices=["tf_keras", "keras3"], default="tf_keras")
PARSER.add_argument("--loss_scale", action="store_true", help="wrap the optimizer in Keras' LossScaleOptimizer")
PARSER.add_argument("--shard_optimizer_state", action="store_true", help="HorovodStrategy(shard_optimizer_state=True)")
PARSER.add_argument("--profile_dir", default=None, help="TF-profile steps after the warm-up on rank 0")
PARSER.add_argument("--profile_steps", help="with --profile_dir: how many (default: tfdist-benchmark's)")
PARSER.add_argument("--global_input", action="store_true",
                    help="strategies: a finite dataset batched by the global batch, split by the strategy")
PARSER.add_argument("--out", required=True)


def benchmark_args(args):
    """tfdist-benchmark's arguments (its defaults, so none is missing) for its loops, with this run's values."""
    from tfdist.benchmark.train_benchmark import PARSER

    bargs = PARSER.parse_args(["--model", args.model, "--batch_size", str(args.batch_size), "--image_size",
                               str(args.image_size), "--num_classes", str(args.num_classes),
                               "--num_warmup_batches", str(args.warmup), "--num_batches", str(args.steps),
                               *(["--loss_scale"] if args.loss_scale else []),
                               *(["--profile_dir", args.profile_dir] if args.profile_dir else []),
                               *(["--profile_steps", args.profile_steps] if args.profile_steps else []),
                               *(["--global_input"] if args.global_input else [])])
    return bargs


def main():
    args = PARSER.parse_args()
    if args.mode == "horovod_fit" and args.model == "tfrs_retrieval":
        # its train_step takes gradients from a tape: Horovod's optimizer would not average them
        PARSER.error("--model tfrs_retrieval: horovod_fit trains each rank alone (hvd.DistributedOptimizer "
                     "averages only gradients it computes; TFRS's train_step uses its own tape): use horovod")
    os.environ["TF_USE_LEGACY_KERAS"] = "1" if args.keras == "tf_keras" else "0"
    import tfdist  # noqa: F401  (early settings: the parent set threads; taskset set the core)
    import tensorflow as tf

    from tfdist.tuning import plan as tuning
    from tfdist.benchmark import train_benchmark as bench
    from tfdist.keras.flavour import keras_module

    keras, bargs = keras_module(), benchmark_args(args)
    launched, strategy = "one process", None
    if args.mode == "tfdist":
        bucket_mb = None if args.bucket_mb == "ready" else float(args.bucket_mb)
        knobs = {} if args.cycle_ms is None else {"cycle_time_ms": args.cycle_ms}
        strategy = tfdist.HorovodStrategy(bucket_mb=bucket_mb, horovod=knobs, compression=args.compression,
                                          shard_optimizer_state=args.shard_optimizer_state)
        launched = (f"HorovodStrategy(bucket_mb={bucket_mb}, horovod={knobs}, compression={args.compression}, "
                    f"shard_optimizer_state={args.shard_optimizer_state}), rank {strategy.rank} of {strategy.size} on "
                    f"{os.environ.get('HOROVOD_HOSTNAME')}, interface {os.environ.get('HOROVOD_GLOO_IFACE')}, "
                    f"rendezvous {os.environ.get('HOROVOD_GLOO_RENDEZVOUS_ADDR')}")
    elif args.mode in ("horovod", "horovod_fit"):
        import horovod.tensorflow as hvd

        from tfdist.launch import start as launch, thread_names

        launched = launch.prepare(mpi_built=hvd.mpi_built()).describe()
        with thread_names.started_as(thread_names.EXCHANGE):  # as tfdist names its Horovod threads
            hvd.init()
    elif args.mode == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        launched = f"MultiWorkerMirroredStrategy, TF_CONFIG {os.environ.get('TF_CONFIG')}"
    rank = rank_of(args.mode, strategy)
    start = time.time()
    # the emulated link's process takes its CPU from the cores the ranks run on: count it beside theirs
    link = {"delay line": int(os.environ[LINK_PID])} if os.environ.get(LINK_PID) else {}
    if args.mode == "horovod":
        timer, _, _ = bench.run_horovod_loop(bargs, keras, processes=link)
    elif args.mode == "horovod_fit":
        import horovod.tensorflow.keras as hvd_keras

        timer, _, _ = bench.run_keras_fit(bargs, keras, None, rank, horovod=hvd_keras, processes=link)
    else:
        timer, _, _ = bench.run_keras_fit(bargs, keras, strategy, rank, processes=link)
    effect = tuning.in_effect()
    gradients = dict(zip(("gradient_bytes", "sparse_gradient_bytes"),
                         gradient_bytes(keras, bargs, args.keras == "tf_keras") if args.mode == "none" else (None, None)))
    result = {"mode": args.mode, "bucket_mb": args.bucket_mb, "rank": rank, "argv": sys.argv,
              "launched": launched, "step_seconds": timer.times, "warmup_steps_excluded": args.warmup,
              "thread_cpu_per_step": timer.thread_cpu, "thread_cpu_by_name": timer.thread_cpu_by_name,
              **gradients, "started": start,
              "in_effect": {**effect, "cpus": list(effect["cpus"])},
              "affinity": sorted(os.sched_getaffinity(0)), "tf": tf.__version__,
              "horovod_cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME", "Horovod's default (1)"),
              "horovod_cycle_on_enqueue": os.environ.get("HOROVOD_CYCLE_ON_ENQUEUE", "unset")}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    timed = timer.times[args.warmup:]
    print(f"rank {rank} {args.mode}: median step {sorted(timed)[len(timed) // 2] * 1e3:.1f} ms", flush=True)


def rank_of(mode, strategy):
    if mode == "tfdist":
        return strategy.rank
    if mode in ("horovod", "horovod_fit"):
        import horovod.tensorflow as hvd

        return hvd.rank()
    if mode == "mwms":
        return strategy.cluster_resolver.task_id or 0
    return int(os.environ.get("SLURM_PROCID", 0))  # none@each: one copy in every host, each its own file


def gradient_bytes(keras, bargs, legacy):
    """(all, sparse): the bytes one rank's gradients of one step put into the exchange, and the part
    of them that is sparse. A dense gradient counts whole; an embedding's `tf.IndexedSlices` counts
    as the rows and ids it sends (on tf-keras its repeated rows merged, as tfdist merges them),
    which every rank gathers from every other instead of an allreduce."""
    import numpy as np
    import tensorflow as tf

    from tfdist.benchmark.inputs import input_dataset
    from tfdist.benchmark.models import build_model, training_loss
    from tfdist.exchange.gradients import merge_repeated_rows

    model = build_model(keras, bargs.model, bargs.image_size, bargs.num_classes)
    features, labels = next(iter(input_dataset(bargs)[0]))
    with tf.GradientTape() as tape:
        loss = training_loss(keras, bargs.model)(model, features, labels)
    dense = sparse = 0
    for g in tape.gradient(loss, model.trainable_variables):
        if isinstance(g, tf.IndexedSlices):
            sent = merge_repeated_rows(g) if legacy else g
            sparse += int(tf.size(sent.values)) * g.values.dtype.size + int(tf.size(sent.indices)) * g.indices.dtype.size
        else:
            dense += int(np.prod(g.shape)) * g.dtype.size
    return dense + sparse, sparse


if __name__ == "__main__":
    main()
