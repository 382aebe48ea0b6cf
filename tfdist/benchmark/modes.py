"""tfdist-benchmark's --variable_update modes set up: Keras, the strategy (or none), rank and size.

    from tfdist.benchmark.train_benchmark import PARSER
    keras, strategy, tuning, size, rank = start(PARSER.parse_args(["--variable_update", "none"]))
"""

import json
import os
import socket
import sys


def mwms_tf_config(timeout=120):
    """TF_CONFIG for MultiWorkerMirroredStrategy: as the user set it, or one worker per horovodrun
    rank on this host, each on a port the OS gave it, swapped through the Gloo rendezvous store
    (replacing the TF_CONFIG tfdist exported, whose ports no server is meant to use)."""
    from tfdist.launch import rendezvous, tf_config

    if tf_config.given() is not None or "HOROVOD_RANK" not in os.environ:
        return
    size, rank = int(os.environ["HOROVOD_SIZE"]), int(os.environ["HOROVOD_RANK"])
    if int(os.environ.get("HOROVOD_LOCAL_SIZE", size)) != size:
        sys.exit("--variable_update mwms derives TF_CONFIG for ranks on one host only; set TF_CONFIG "
                 "for multi-host runs")
    addr, port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        sys.exit("--variable_update mwms derives TF_CONFIG through Horovod's Gloo rendezvous: launch with "
                 "horovodrun --gloo or tfdist-run, or set TF_CONFIG")
    ports = rendezvous.exchange(addr, int(port), "tfdist-mwms-ports", rank, size, str(_free_port()), timeout)
    workers = [f"localhost:{p}" for p in ports]
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})


def _free_port():
    """A port the OS deems free now (a fixed offset from another port may be any process's)."""
    with socket.socket() as s:
        s.bind(("", 0))  # TensorFlow serves on every address
        return s.getsockname()[1]


def start(args):
    """Create the strategy of --variable_update; returns (keras, strategy, tuning text, size, rank)."""
    import tensorflow as tf

    from tfdist.keras.flavour import keras_module
    from tfdist.launch import thread_names
    from tfdist.strategy import HorovodStrategy

    keras = keras_module()
    if args.variable_update == "tfdist":
        overrides = {k: v for k, v in (("intra_op_threads", args.num_intra_threads),
                                       ("inter_op_threads", args.num_inter_threads)) if v}
        if args.onednn != "default":  # set before TensorFlow loaded (main); the plan must agree
            overrides["onednn"] = args.onednn == "on"
        knobs = {"cycle_time_ms": args.horovod_cycle_time_ms} if args.horovod_cycle_time_ms else {}
        device = {"auto": None, "cpu": "/cpu:0", "gpu": "gpu"}[args.device]
        strategy = HorovodStrategy(device, precision=args.precision, horovod=knobs, compression=args.compression,
                                   bucket_mb=args.bucket_mb, fused_batchnorm=args.fused_batchnorm == "on",
                                   shard_optimizer_state=args.shard_optimizer_state,
                                   tuning=False if args.no_tuning else (overrides or True))
        tuning = strategy.tuning_plan.summary() if strategy.tuning_plan else "off"
        from tfdist.keras import fused_batchnorm as keras_fused_batchnorm

        tuning += f"; fused BatchNormalization: {'on' if keras_fused_batchnorm.is_installed() else 'off'}"
        return keras, strategy, tuning, strategy.size, strategy.rank
    _set_threads(tf, args)
    if args.device == "gpu":
        from tfdist.tuning import gpu

        rank = int(os.environ.get("HOROVOD_RANK", "0"))
        gpu.require_gpu("gpu", rank, int(os.environ.get("HOROVOD_LOCAL_RANK", "0")))
    tuning = (f"TensorFlow defaults, except intra_op={args.num_intra_threads} inter_op={args.num_inter_threads}"
              if args.num_intra_threads or args.num_inter_threads else "TensorFlow defaults")
    if args.precision != "float32":
        keras.mixed_precision.set_global_policy(args.precision)
    if args.variable_update == "horovod":
        import horovod.tensorflow as hvd

        if args.horovod_cycle_time_ms:
            os.environ["HOROVOD_CYCLE_TIME"] = str(args.horovod_cycle_time_ms)
        with thread_names.started_as(thread_names.EXCHANGE):  # as tfdist's: its CPU is counted alike
            hvd.init()
        return keras, None, tuning, hvd.size(), hvd.rank()
    if args.variable_update == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        resolver = strategy.cluster_resolver
        return keras, strategy, tuning, strategy.num_replicas_in_sync, resolver.task_id or 0
    return keras, None, tuning, 1, 0


def _set_threads(tf, args):
    if args.num_intra_threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.num_intra_threads)
    if args.num_inter_threads:
        tf.config.threading.set_inter_op_parallelism_threads(args.num_inter_threads)
