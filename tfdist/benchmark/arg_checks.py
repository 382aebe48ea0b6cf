"""tfdist-benchmark's checks across its arguments, made before TensorFlow loads: each names the flags.

    from tfdist.benchmark.train_benchmark import PARSER
    args = PARSER.parse_args(["--variable_update", "mwms"])
    check(args, PARSER.error)        # passes; sets args.keras to "tf_keras", the Keras mwms runs on
"""

from tfdist.benchmark.models import synthetic_only


def check(args, error):
    """Settle what the flags imply (args.keras for Horovod's loop and MWMS) and call `error` with the
    first combination that cannot run, naming its flags."""
    if args.variable_update in ("horovod", "mwms"):
        args.keras = "tf_keras"
    if args.epochs and not args.data_dir:
        error("--epochs needs --data_dir (a real dataset to reach an accuracy on)")
    if args.lr_decay != "none" and not args.epochs:
        error("--lr_decay needs --epochs (it decays to 0 at the last step of the last epoch)")
    if args.epochs and args.variable_update in ("horovod", "mwms"):
        error(f"--epochs (accuracy runs) is for --variable_update tfdist or none, not {args.variable_update}")
    if args.compression:
        from tfdist.exchange import compression_plan

        try:
            compression_plan.parse(args.compression)
        except ValueError as e:
            error(f"--compression: {e}")
        if args.variable_update != "tfdist":
            error(f"--compression is for --variable_update tfdist, not {args.variable_update}")
    if args.profile_steps and not args.profile_dir:
        error("--profile_steps needs --profile_dir (where to write the profile)")
    if args.bucket_mb is not None and args.variable_update != "tfdist":
        error(f"--bucket_mb is for --variable_update tfdist, not {args.variable_update}")
    if args.loss_scale and args.variable_update == "horovod":
        error("--loss_scale is for the Keras modes (tfdist, mwms, none), not Horovod's own loop")
    if synthetic_only(args.model) and (args.data_dir or args.epochs):
        error(f"--model {args.model} trains on synthetic inputs: no --data_dir or --epochs")
    if args.shard_optimizer_state and args.variable_update != "tfdist":
        error(f"--shard_optimizer_state is for --variable_update tfdist, not {args.variable_update}")
    if args.steps_per_execution > 1:
        if args.variable_update == "horovod":
            error("--steps_per_execution is for the Keras modes (tfdist, mwms, none), not Horovod's own loop")
        if args.num_warmup_batches % args.steps_per_execution or args.num_batches % args.steps_per_execution:
            error(f"--steps_per_execution {args.steps_per_execution}: --num_warmup_batches "
                  f"({args.num_warmup_batches}) and --num_batches ({args.num_batches}) must be multiples of it")
        if args.profile_dir:
            error("--steps_per_execution with --profile_dir: the profiled steps are not a call's (not supported)")
    if args.model == "tfrs_retrieval" and args.keras != "tf_keras":
        error("--model tfrs_retrieval runs on tf-keras, TFRS's Keras: add --keras tf_keras")
    if args.precision == "auto" and args.variable_update != "tfdist":
        error(f"--precision auto is for --variable_update tfdist; name a policy for {args.variable_update}")
