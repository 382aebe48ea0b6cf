"""`HorovodStrategy`: a `tf.distribute.Strategy` with one replica per Horovod process.

Keras (3 and tf-keras) and custom training loops drive it like MultiWorkerMirroredStrategy:
datasets are batched by the global batch and split across ranks, variables (also those created
lazily inside `strategy.run`) start from rank 0's values, gradients are summed with fused Horovod
allreduces, and the loss and metrics Keras reports are global across ranks.

Example (run with `horovodrun -np 2 --gloo python train.py`, or plain `python train.py`):

```python
import keras, numpy as np, tfdist
strategy = tfdist.HorovodStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x, y = np.random.rand(256, 4), np.random.rand(256, 1)
model.fit(x, y, batch_size=32)   # global batch 32: 16 per rank on 2 ranks, each example once
```
"""

import logging
import os
import tempfile

import tensorflow as tf

from tfdist import _compat, collectives, consistency, input_contract
from tfdist.keras import chief_saves
from tfdist.exchange import gradients as gradient_exchange
from tfdist.keras import callback_writes as keras_callbacks
from tfdist.keras import recognise
from tfdist.keras.recognise import multi_rank_strategy_of  # noqa: F401  (this module's name for it since 0.1)
from tfdist import rank_variables
from tfdist.keras import metrics as keras_metrics
from tfdist.keras import predictions as keras_predict
from tfdist.keras import progress as quiet_ranks
from tfdist.exchange import compression as compression_lib
from tfdist import watchdog as watchdog_lib
from tfdist import gpu as gpu_lib
from tfdist import precision as precision_lib
from tfdist.tuning import plan as tuning_lib
from tfdist.cluster_resolver import HorovodClusterResolver
from tfdist.errors import RankMismatchError
from tfdist.keras_flavour import legacy_requested

log = logging.getLogger("tfdist")

_REDUCE_OPS = {tf.distribute.ReduceOp.SUM: "sum", tf.distribute.ReduceOp.MEAN: "average"}


@recognise.register
class HorovodStrategy(tf.distribute.OneDeviceStrategy):
    """Data-parallel strategy over Horovod: one replica per process, on this rank's device.

    Args:
        batch_convention: "global" (default, as MultiWorkerMirroredStrategy): a dataset given to
            `experimental_distribute_dataset` or `fit` is batched by the global batch, and each
            rank gets its part of every batch (rebatched and auto-sharded by the dataset's
            `auto_shard_policy`, exactly as MWMS does); `predict` returns every rank's rows.
            "per_rank" (Horovod's convention, for ported Horovod scripts): each rank's dataset is
            its own, batched per rank, and used as given. `distribute_datasets_from_function`
            and `pipelines.read_dataset(input_context=...)` datasets are per rank either way.
        device: device for this rank's replica; default: this rank's GPU (the one `tfdist.gpu`
            left visible to it, or `GPU:<local_rank>` of the visible GPUs) or else the CPU.
            "gpu" insists on this rank's GPU: with none visible, `GPUNotFoundError` names what
            was found (driver, CUDA_VISIBLE_DEVICES, TensorFlow's build and devices); so does
            any other GPU device name ("/gpu:0").
        compression: gradient compression: None or "none"; "fp16" (floating gradients cast to
            float16 before and back after; halves the bytes sent) or a
            `horovod.tensorflow.Compression`; "powersgd:<rank>" or "topk:<density>" (or a
            `tfdist.exchange.compression.PowerSGD` / `TopK`): low-rank or sparse gradients with error
            feedback, per-rank state that `callbacks.Checkpointer` saves; they replace the
            optimizer's gradient sum only (docs/COMMUNICATION.md).
        op: how gradients combine across ranks: "average" (Keras' loss scaling by
            1/num_replicas_in_sync turns the sum into the average), or "adasum" (Horovod's
            Adasum of the ranks' unscaled gradients, per tensor; needs an MPI-built Horovod,
            its MPI controller (`tfdist-run --launcher mpirun`) and 1, 2, 4, ... ranks, and is
            refused naming the fix otherwise). Adasum replaces the Keras optimizers' gradient
            sum only (`fit`, `optimizer.apply_gradients`); `strategy.reduce`,
            `ReplicaContext.all_reduce` (synchronized BatchNormalization) and metrics stay
            sums. Example, under
            `tfdist-run --launcher mpirun -np 2 python train.py`:
            `HorovodStrategy(op="adasum")`, with the single-rank learning rate (not scaled by
            the rank count).
        check_variables: compare every new variable's shape and dtype across ranks before
            broadcasting it, and raise naming the first mismatch (costs one small collective
            per variable at creation).
        precision: None (leave Keras' dtype policy alone), "auto" (pick for the hardware, see
            `tfdist.precision.choose_policy`), or a policy name ("mixed_float16", ...).
        tuning: True (default) applies `tfdist.tuning.plan`'s per-rank plan (threads, core pinning,
            oneDNN/OpenMP, one GPU per local rank; on CPU-only nodes a 10 ms Horovod cycle unless
            HOROVOD_CYCLE_TIME or `horovod=` says otherwise), or the choice `tfdist-tune` cached for
            this machine; "measure" first runs `tfdist-tune` for this job's ranks per node when
            nothing is cached (oneDNN's choice takes effect from the next start); False leaves the
            process as it is; a dict overrides choices (`intra_op_threads`, `inter_op_threads`,
            `pin`, `onednn`). Settings TensorFlow reads when it loads are applied by `import tfdist`
            before `import tensorflow` or by `tfdist-run`; the chief prints what is in effect.
        horovod: Horovod knobs set before `hvd.init()` unless already in the environment:
            `fusion_threshold_mb`, `cycle_time_ms`, `timeline` (a file path), `autotune` (bool).
        watchdog: with more than one rank, a dead or stalled rank makes every other rank exit
            naming it (`tfdist.watchdog`): True (timeout from `TFDIST_WATCHDOG_TIMEOUT`, default
            20 s), a number of seconds, or False.
        check_consistency: compare versions, tfdist's source, the main script and `fingerprint`
            across ranks now, and the first distributed dataset's batch size, structure and
            manifest (`tfdist.consistency`); a difference raises `RankMismatchError`.
        fingerprint: any string that must be equal on every rank (a config hash, a git commit).
        bucket_mb: how gradients are scheduled. None (default): each gradient is an allreduce
            of its own, issued the moment backprop produces it, and Horovod fuses whatever is
            ready on every rank each cycle (readiness-driven fusion, as Horovod's own
            `DistributedGradientTape` loop). A size in MB: buckets of about that size, last layers
            first, each one grouped allreduce issued when its gradients exist. 0: each dtype's
            gradients as one grouped allreduce once the last gradient exists. Every schedule
            overlaps the exchange with the rest of backprop except 0 (docs/PERFORMANCE.md has the
            measurements on emulated 1 Gbit/s links).
        fused_batchnorm: on Keras 3, run 4-D `BatchNormalization` layers with TensorFlow's fused
            kernel, as tf-keras does (`tfdist.keras.fused_batchnorm`: same results, falls back
            where it would differ); False leaves Keras' own implementation.
    """

    def __init__(self, device=None, *, batch_convention="global", compression=None, op="average", check_variables=True,
                 precision=None, tuning=True, horovod=None, watchdog=True, check_consistency=True,
                 fingerprint=None, fused_batchnorm=True, bucket_mb=None):
        tuning_lib.set_horovod_knobs(horovod or {})
        if tuning == "measure":
            from tfdist.tuning import startup
            from tfdist.tuning import tuner as tune

            tune.ensure_measured(*startup.local_layout())
        horovod_defaults = tuning_lib.set_horovod_defaults() if tuning is not False else {}
        collectives.init()
        self.tuning_plan = tuning_lib.tune_this_rank(tuning, horovod_defaults) if tuning is not False else None
        # After tuning: these run the first TensorFlow ops, which fix the thread pools.
        if check_consistency:
            consistency.check_start(fingerprint)
        if watchdog is not False:
            watchdog_lib.start(None if watchdog is True else float(watchdog))
        input_contract.agree_on_tf_seed()
        if batch_convention not in ("global", "per_rank"):
            raise ValueError(f"batch_convention={batch_convention!r}: expected 'global' (the "
                             "tf.distribute contract) or 'per_rank' (Horovod's)")
        compression, compressor = compression_lib.parse(compression)
        if op not in ("average", "adasum"):
            raise ValueError(f"op={op!r}: HorovodStrategy supports op='average' or op='adasum'")
        if op == "adasum":
            if compressor is not None:
                raise ValueError(f"op='adasum' with compression={compressor.describe()!r}: Adasum combines whole "
                                 "gradients; use one or the other")
            if collectives.adasum_refusal():
                raise ValueError(collectives.adasum_refusal())
        gradient_exchange.install_gradient_marker()
        if gpu_lib.is_gpu_request(device):
            device = gpu_lib.require_gpu(device, collectives.rank(), collectives.local_rank())
        if device is None:
            gpus = tf.config.list_logical_devices("GPU")
            device = gpus[collectives.local_rank() % len(gpus)].name if gpus else "/cpu:0"
        if bucket_mb is not None and bucket_mb < 0:
            raise ValueError(f"bucket_mb={bucket_mb}: expected None (each gradient as it is ready), 0 (one "
                             "collective) or a size in MB")
        extended = HorovodExtended(
            self, device, compression=compression, check_variables=check_variables,
            check_datasets=check_consistency, global_batch=batch_convention == "global",
            bucket_bytes=None if bucket_mb is None else int(bucket_mb * (1 << 20)), adasum=op == "adasum",
            compressor=compressor,
        )
        # Skip OneDeviceStrategy.__init__, which would build a OneDeviceExtended.
        tf.distribute.Strategy.__init__(self, extended)
        keras_metrics.install()
        keras_predict.install()
        keras_callbacks.install()
        chief_saves.install()
        quiet_ranks.install()  # only the chief prints Keras' progress bars and warnings
        if fused_batchnorm and not legacy_requested():
            from tfdist.keras import fused_batchnorm as keras_fused_batchnorm

            keras_fused_batchnorm.install()
        precision_lib.install()
        if precision is not None:
            precision_lib.set_policy(precision)
        if self.tuning_plan is not None:
            tuning_lib.announce(self.tuning_plan, (gpu_lib.absence(self.tuning_plan.effect["gpu"]),
                                                   collectives.transport(device), precision_lib.policy_name()))

    # Horovod topology, for user code (data sharding, logging, chief-only work).
    @property
    def rank(self):
        return collectives.rank()

    @property
    def size(self):
        return collectives.size()

    @property
    def local_rank(self):
        return collectives.local_rank()

    @property
    def local_size(self):
        return collectives.local_size()

    @property
    def compressor(self):
        """The `tfdist.exchange.compression.Compressor` of the gradient exchange, or None."""
        return self.extended._compressor

    @property
    def is_chief(self):
        return self.rank == 0

    def chief_path(self, path):
        """Where this rank may write `path`: `path` itself on the chief, a private temp dir elsewhere.

        Lets every rank run the same saving code (as Keras callbacks do) without two ranks ever
        writing the same file.
        """
        if self.is_chief:
            return path
        scratch = tempfile.mkdtemp(prefix=f"tfdist-rank{self.rank}-")
        return os.path.join(scratch, os.path.basename(os.path.normpath(str(path))))

    def __repr__(self):
        return f"HorovodStrategy(rank={self.rank}, size={self.size}, device={self.extended.worker_devices[0]!r})"


class HorovodExtended(_compat.one_device_strategy.OneDeviceExtended):
    """The strategy's implementation: OneDevice placement plus Horovod collectives."""

    def __init__(self, container_strategy, device, compression=None, check_variables=True,
                 check_datasets=True, global_batch=True, bucket_bytes=0, adasum=False, compressor=None):
        super().__init__(container_strategy, device)
        # What Strategy.cluster_resolver returns: every rank a "worker", task_id = rank.
        self._cluster_resolver = HorovodClusterResolver.for_this_job()
        self._adasum = adasum
        self._check_next_dataset = check_datasets and collectives.size() > 1
        self._compression = compression
        self._compressor = compressor
        self._bucket_bytes = bucket_bytes
        self._check_variables = check_variables
        self._global_batch = global_batch
        self._variable_count = 0
        self._noted_unsharded = False
        self._noted_presharded = False
        self._noted_uneven = set()

    # --- variables -------------------------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        # Replica-local state (metric accumulators) stays local; everything else starts from
        # rank 0's value, so models built with different seeds are identical. The broadcast is
        # part of the initial value (as MWMS does it), so a variable created inside a traced
        # strategy.run (lazily built layers, optimizer slots) is initialised the same way when
        # tf.function lifts its initialiser.
        # A variable a save creates (a checkpoint's save_counter) is the saving rank's own: the
        # chief may save alone, so no collective there.
        if (collectives.size() > 1 and kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ
                and not chief_saves.in_save()):
            kwargs["initial_value"] = self._broadcast_initial_value(kwargs)
        if rank_variables.is_distributed_kind(kwargs.get("synchronization"), kwargs.get("aggregation")):
            # Sync-on-read (metrics) and SUM/MEAN mirrored variables: MWMS's semantics, one component.
            return rank_variables.create(self._container_strategy(),
                                         lambda **kw: super(HorovodExtended, self)._create_variable(next_creator, **kw),
                                         **kwargs)
        return super()._create_variable(next_creator, **kwargs)

    def _broadcast_initial_value(self, kwargs):
        index = self._variable_count
        self._variable_count += 1
        initial_value, dtype = kwargs["initial_value"], kwargs.get("dtype")
        name = kwargs.get("name")

        def broadcast_initial_value():
            value = initial_value() if callable(initial_value) else initial_value
            value = tf.convert_to_tensor(getattr(value, "wrapped_value", value), dtype=dtype)
            if self._check_variables:
                with tf.init_scope():  # shapes and dtypes are static: compare them now, eagerly
                    self._check_same_variable(value, name, index)
            return collectives.broadcast(value, 0, name=f"tfdist.init.{index}")

        return broadcast_initial_value

    def _check_same_variable(self, value, name, index):
        if not tf.executing_eagerly():
            raise RuntimeError("HorovodStrategy needs TF2 eager execution (tf.compat.v1 graph mode is not supported)")
        shape = value.shape.as_list() if value.shape.rank is not None else None
        if shape is None or len(shape) > 8 or any(d is None for d in shape):
            return  # not comparable in a fixed-width row; the broadcast still checks shapes
        row = collectives.signature([len(shape), value.dtype.as_datatype_enum, *shape])
        rows = collectives.allgather(tf.constant(row), name=f"tfdist.check.{index}").numpy()
        if (rows == rows[0]).all():
            return
        described = [_describe_signature(r) for r in rows]
        first_bad = next(r for r, d in enumerate(described) if d != described[0])
        raise RankMismatchError(
            f"ranks built different models: variable #{index} (named {name!r} on rank "
            f"{collectives.rank()}) is {described[0]} on rank 0 but {described[first_bad]} on rank "
            f"{first_bad}. Every rank must create the same variables in the same order."
        )

    # --- input -----------------------------------------------------------------------------
    def _input_context(self):
        size = collectives.size()
        return tf.distribute.InputContext(
            num_input_pipelines=size, input_pipeline_id=collectives.rank(), num_replicas_in_sync=size)

    def _experimental_distribute_dataset(self, dataset, options):
        self._check_first_dataset(dataset)
        if input_contract.is_per_rank(dataset) or not self._global_batch or collectives.size() == 1:
            return self._distribute_per_rank_dataset(dataset, options)
        return self._distribute_global_dataset(dataset, options)

    def _distribute_per_rank_dataset(self, dataset, options):
        # Horovod convention: each rank iterates its own per-rank batches; nothing is split or
        # sharded here, so an unsharded dataset feeds every rank the same records.
        if (collectives.size() > 1 and not self._noted_unsharded and not input_contract.is_per_rank(dataset)
                and not input_contract.is_sharded(dataset)):
            self._noted_unsharded = True
            log.info(
                "tfdist: rank %d: dataset has no shard(); it is used as given on this rank (fine if "
                "you split the data per rank yourself, else every rank reads the same records)",
                collectives.rank(),
            )
        return super()._experimental_distribute_dataset(dataset, options)

    def _distribute_global_dataset(self, dataset, options):
        """As MWMS: split every global batch across ranks (rebatch), then auto-shard."""
        size = collectives.size()
        # Raises for unbatched elements; the chief warns once per uneven batch size (watching the
        # first batch where the size is known only at run time, as in Keras' array datasets).
        watched = input_contract.warn_uneven_global_batch(dataset, size, self._noted_uneven)
        policy = dataset.options().experimental_distribute.auto_shard_policy
        if (not self._noted_presharded and collectives.rank() == 0 and policy != tf.data.experimental.AutoShardPolicy.OFF
                and input_contract.is_sharded(dataset)):
            self._noted_presharded = True
            log.warning(
                "tfdist: rank %d: this dataset already calls shard() and is auto-sharded again "
                "across %d ranks (each rank reads 1/%d of its shard). If it is split per rank "
                "already, as in Horovod scripts, use HorovodStrategy(batch_convention='per_rank') "
                "or set options.experimental_distribute.auto_shard_policy = OFF.",
                collectives.rank(), size, size)
        return _compat.input_util.get_distributed_dataset(
            watched,
            self._input_workers_with_options(options),
            self._container_strategy(),
            num_replicas_in_sync=size,
            input_context=self._input_context(),
            options=options,
        )

    def _check_first_dataset(self, dataset):
        # Only the first: later datasets may be chief-only (predict), and a check would then wait.
        if self._check_next_dataset:
            self._check_next_dataset = False
            consistency.check_dataset(dataset)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        context = self._input_context()
        built = []

        def dataset_fn_recorded(input_context):
            built.append(dataset_fn(input_context))
            return built[-1]

        distributed = _compat.input_util.get_distributed_datasets_from_function(
            dataset_fn_recorded,
            self._input_workers_with_options(options),
            [context],
            self._container_strategy(),
            options=options,
        )
        if built:
            self._check_first_dataset(built[0])
        return distributed

    # --- replicas and collectives ----------------------------------------------------------
    def _call_for_each_replica(self, fn, args, kwargs):
        # Input iterators hand over one-replica PerReplica values: unwrap them to this rank's.
        args, kwargs = _compat.distribute_utils.select_replica(0, (args, kwargs))
        with tf.device(self._device), _HorovodReplicaContext(self._container_strategy()):
            return fn(*args, **kwargs)

    def _reduce_to(self, reduce_op, value, destinations, options):
        flat = tf.nest.flatten(value, expand_composites=False)
        if not any(isinstance(v, tf.distribute.DistributedValues) for v in flat):
            # Python numbers too (`v.assign_add(1.0)` on a SUM variable inside strategy.run).
            flat = [v if isinstance(v, tf.IndexedSlices) else tf.convert_to_tensor(v) for v in flat]
            reduced = self._batch_reduce_to(reduce_op, [(v, destinations) for v in flat], options)
            return tf.nest.pack_sequence_as(value, reduced)
        # Only input iterators produce PerReplica values here (run() returns plain tensors).
        # Their parts of a partial batch may differ in shape across ranks (3 + 2), where no
        # elementwise reduction exists; Keras 3 reduces a first batch only to learn its shapes,
        # so such a batch keeps this rank's part. Equal shapes are reduced as under MWMS.
        value = _compat.distribute_utils.select_replica(0, value)
        flat = tf.nest.flatten(value, expand_composites=False)
        if collectives.size() == 1:
            return value

        def reduce():
            reduced = self._batch_reduce_to(reduce_op, [(v, destinations) for v in flat], options)
            return tf.nest.pack_sequence_as(value, reduced)

        agree = _shapes_agree(flat)
        if tf.executing_eagerly():
            return reduce() if bool(agree) else value
        return tf.cond(agree, reduce, lambda: value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        values = [value for value, _ in value_destination_pairs]
        if collectives.size() == 1:
            return values
        collectives.check_not_in_xla("HorovodStrategy's allreduce")
        gradient_sum = gradient_exchange.is_gradient_sum(reduce_op, value_destination_pairs)
        variables = gradient_exchange.gradient_variables(value_destination_pairs) if gradient_sum else None
        return gradient_exchange.exchange(
            values, _REDUCE_OPS[reduce_op], compression=self._compression, bucket_bytes=self._bucket_bytes,
            adasum=self._adasum and gradient_sum, variables=variables,
            compressor=self._compressor if variables is not None else None)

    def _gather_to_implementation(self, value, destinations, axis, options):
        value = _compat.distribute_utils.select_replica(0, value)
        if collectives.size() == 1:
            return value
        if axis != 0:
            perm = [axis] + [d for d in range(len(value.shape)) if d != axis]
            gathered = collectives.allgather(tf.transpose(value, perm))
            inverse = [perm.index(d) for d in range(len(perm))]
            return tf.transpose(gathered, inverse)
        return collectives.allgather(value)

    def _local_results(self, value):
        if isinstance(value, tf.distribute.DistributedValues):  # incl. distributed variables
            return tuple(value.values)
        return (_compat.distribute_utils.select_replica(0, value),)

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        # As MirroredStrategy: the update context names the local replica (0), which distributed
        # variables index their components by (OneDeviceStrategy puts a device string there).
        del colocate_with
        with tf.device(self._device), _compat.distribute_lib.UpdateContext(0):
            result = fn(*args, **kwargs)
            return result if group else tf.nest.map_structure(self._local_results, result)

    def read_var(self, replica_local_var):
        if _compat.distribute_utils.is_sync_on_read(replica_local_var):
            return replica_local_var._get_cross_replica()
        if _compat.distribute_utils.is_mirrored(replica_local_var):
            return tf.identity(replica_local_var._get())
        return tf.identity(replica_local_var)

    def value_container(self, value):
        return _compat.distribute_utils.value_container(value)

    def _experimental_distribute_values_from_function(self, value_fn):
        # One replica per rank, numbered globally, as MWMS numbers them.
        context = tf.distribute.experimental.ValueContext(collectives.rank(), collectives.size())
        return _compat.distribute_utils.regroup([value_fn(context)], always_wrap=True)

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group - collectives.rank()

    def _get_replica_id_in_sync_group(self, replica_id):
        return replica_id + collectives.rank()

    def _in_multi_worker_mode(self):
        return collectives.size() > 1

    @property
    def _num_replicas_in_sync(self):
        return collectives.size()

    # tf-keras' ModelCheckpoint / BackupAndRestore name non-chief scratch dirs after the task.
    @property
    def _task_type(self):
        return "worker"

    @property
    def _task_id(self):
        return collectives.rank()

    @property
    def should_checkpoint(self):
        return collectives.rank() == 0

    @property
    def should_save_summary(self):
        return collectives.rank() == 0

    @property
    def _global_batch_size(self):
        # Whether batches handed to fit() are global (tf.distribute) or per rank (Horovod).
        return self._global_batch


class _HorovodReplicaContext(tf.distribute.ReplicaContext):
    def __init__(self, strategy):
        # The replica's global id (its rank), as MWMS numbers replicas across workers.
        tf.distribute.ReplicaContext.__init__(self, strategy, replica_id_in_sync_group=collectives.rank())

    @property
    def devices(self):
        return self._strategy.extended.worker_devices


def _shapes_agree(tensors):
    """Whether every rank's `tensors` have the same shapes (a collective: call it on every rank)."""
    sizes = [tf.constant([len(tensors)], tf.int64)] + [tf.shape(t, out_type=tf.int64) for t in tensors]
    gathered = collectives.allgather(tf.concat(sizes, 0)[None])
    return tf.reduce_all(tf.equal(gathered, gathered[0]))


def _describe_signature(row):
    ndim, dtype_enum = int(row[0]), int(row[1])
    shape = tuple(int(d) for d in row[2 : 2 + ndim])
    return f"shape {shape} dtype {tf.dtypes.as_dtype(dtype_enum).name}"
