"""`HorovodExtended`: the implementation behind `HorovodStrategy` (`strategy.extended`).

OneDevice placement on this rank's device plus Horovod collectives: variables start from rank 0's
values (checked across ranks), datasets are split like MultiWorkerMirroredStrategy's (or used per
rank), reductions and gathers are Horovod collectives, and the gradient sum follows the chosen
schedule and compressor (`tfdist.exchange`).

```python
import tfdist
strategy = tfdist.HorovodStrategy()
print(strategy.extended.batch_convention)   # "global"
```
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from tfdist import _compat, collectives, input_contract, rank_variables
from tfdist.faults import consistency
from tfdist.cluster_resolver import HorovodClusterResolver
from tfdist.errors import RankMismatchError
from tfdist.exchange import gradients as gradient_exchange
from tfdist.exchange import sharded
from tfdist.keras import chief_saves, step_outputs
from tfdist.keras.flavour import legacy_requested
from tfdist.strategy_options import StrategyOptions

log = logging.getLogger("tfdist")

_REDUCE_OPS = {tf.distribute.ReduceOp.SUM: "sum", tf.distribute.ReduceOp.MEAN: "average"}


class HorovodExtended(_compat.one_device_strategy.OneDeviceExtended):
    """The strategy's implementation: OneDevice placement plus Horovod collectives."""

    def __init__(self, container_strategy: tf.distribute.Strategy, device: str, options: StrategyOptions) -> None:
        super().__init__(container_strategy, device)
        # What Strategy.cluster_resolver returns: every rank a "worker", task_id = rank.
        self._cluster_resolver = HorovodClusterResolver.for_this_job()
        self._adasum = options.op == "adasum"
        self._check_next_dataset = options.check_consistency and collectives.size() > 1
        self._compression = options.horovod_compression
        self._compressor = options.compressor
        self._bucket_bytes = options.bucket_bytes
        self._shard_optimizer_state = options.shard_optimizer_state
        self._check_variables = options.check_variables
        self.batch_convention = options.batch_convention
        # As MWMS: ranks step through a distributed dataset together, and a rank whose shard ended
        # early gets empty batches until every rank's has (TensorFlow's partial-batch handling,
        # one small allreduce per batch). Without it, uneven FILE shards left the ranks' loops
        # apart by a step. Keras 3's fit asks for it itself (get_next_as_optional). A global-batch
        # dataset whose ranks surely end together skips it (input_contract.ranks_end_together).
        self.experimental_enable_get_next_as_optional = collectives.size() > 1 and self.batch_convention == "global"
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
        in_save = chief_saves.in_save()
        if (collectives.size() > 1 and kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ
                and not in_save):
            kwargs["initial_value"] = self._broadcast_initial_value(kwargs)
        if isinstance(kwargs.get("colocate_with"), tf.distribute.DistributedValues):
            kwargs["colocate_with"] = None  # an optimizer slot beside its variable: one device holds both
        if not in_save and rank_variables.is_distributed_kind(kwargs.get("synchronization"), kwargs.get("colocate_with")):
            # As MWMS with one replica per worker: a MirroredVariable (SyncOnReadVariable for
            # ON_READ) whose one component is this rank's.
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
        row = _signature([len(shape), value.dtype.as_datatype_enum, *shape])
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
        if input_contract.is_per_rank(dataset) or self.batch_convention != "global" or collectives.size() == 1:
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
        plain = self._iterator_options(options)
        if plain is options:  # OneDeviceStrategy's way (it refuses PER_REPLICA options)
            return super()._experimental_distribute_dataset(dataset, options)
        return _compat.input_util.get_distributed_dataset(
            input_contract.prefetched(dataset, plain), self._input_workers_with_options(plain),
            self._container_strategy(), options=plain)

    def _distribute_global_dataset(self, dataset, options):
        """As MWMS: split every global batch across ranks (rebatch), then auto-shard."""
        size = collectives.size()
        # Raises for unbatched elements; the chief warns once per uneven batch size (watching the
        # first batch where the size is known only at run time, as in Keras' array datasets).
        watched = input_contract.warn_uneven_global_batch(dataset, size, self._noted_uneven)
        policy = dataset.options().experimental_distribute.auto_shard_policy
        graph = input_contract.dataset_graph(dataset)  # read once: both checks below look into it
        if (not self._noted_presharded and collectives.rank() == 0 and policy != tf.data.experimental.AutoShardPolicy.OFF
                and input_contract.is_sharded(dataset, graph)):
            self._noted_presharded = True
            log.warning(
                "tfdist: rank %d: this dataset already calls shard() and is auto-sharded again "
                "across %d ranks (each rank reads 1/%d of its shard). If it is split per rank "
                "already, as in Horovod scripts, use HorovodStrategy(batch_convention='per_rank') "
                "or set options.experimental_distribute.auto_shard_policy = OFF.",
                collectives.rank(), size, size)
        options = self._iterator_options(options)
        # TF reads the partial-batch switch when it builds the dataset: off where ranks end together
        check = self.experimental_enable_get_next_as_optional
        self.experimental_enable_get_next_as_optional = check and not input_contract.ranks_end_together(dataset, graph)
        try:
            return _compat.input_util.get_distributed_dataset(
                watched,
                self._input_workers_with_options(options),
                self._container_strategy(),
                num_replicas_in_sync=size,
                input_context=self._input_context(),
                options=options,
            )
        finally:
            self.experimental_enable_get_next_as_optional = check

    def _check_first_dataset(self, dataset):
        # Only the first: later datasets may be chief-only (predict), and a check would then wait.
        if self._check_next_dataset:
            self._check_next_dataset = False
            consistency.check_dataset(dataset)

    def _iterator_options(self, options):
        return input_contract.iterator_options(options, self._device)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        given, options = options, self._iterator_options(options)
        context = self._input_context()
        built = []

        def dataset_fn_recorded(input_context):
            built.append(dataset_fn(input_context))
            return built[-1] if options is given else input_contract.prefetched(built[-1], options)

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
        step_outputs.step_begins()
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
        gradient_sum = gradient_exchange.is_gradient_sum(reduce_op, value_destination_pairs)
        variables = gradient_exchange.gradient_variables(value_destination_pairs) if gradient_sum else None
        # fp16/bf16 compress the optimizer's gradient sum only: strategy.reduce and other sums stay
        # exact (a float16 sum of counts overflows at 65504).
        return gradient_exchange.exchange(
            values, _REDUCE_OPS[reduce_op], compression=self._compression if gradient_sum else None,
            bucket_bytes=self._bucket_bytes,
            adasum=self._adasum and gradient_sum, variables=variables,
            compressor=self._compressor if variables is not None else None,
            merge_sparse=gradient_sum and legacy_requested())  # tf-keras' optimizers sum repeated rows

    @property
    def shard_optimizer_state(self):
        """Whether Keras optimizers built under this strategy keep state for this rank's slices only."""
        return self._shard_optimizer_state and collectives.size() > 1

    def reduce_scatter(self, grads, variables):
        """Each gradient (of the variable beside it) summed across ranks, as this rank's flat
        slice, on the gradient schedule."""
        return sharded.reduce_scatter(grads, variables, self._bucket_bytes, self._compression)

    def allgather_slices(self, slices):
        """Every rank's slices of each variable, flat and padded, on the gradient schedule."""
        return sharded.allgather(slices, self._bucket_bytes)

    def _gather_to_implementation(self, value, destinations, axis, options):
        value = _compat.distribute_utils.select_replica(0, value)
        if collectives.size() == 1:
            return value
        try:
            return _allgather_along(value, axis)
        except tf.errors.FailedPreconditionError as e:
            # Eagerly (inside a graph the error surfaces when the function runs): MWMS's error for
            # values whose rank or other dimensions differ across replicas, with Horovod's detail
            # (Horovod's own API keeps its FailedPreconditionError)
            raise tf.errors.InvalidArgumentError(
                None, None, f"Shape mismatch: gathering along axis {axis} needs the same rank and the same "
                f"other dimensions on every replica. Horovod: {e.message}") from e

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
        # TensorFlow's name, which Keras reads: whether batches handed to fit() are global.
        return self.batch_convention == "global"


class _HorovodReplicaContext(tf.distribute.ReplicaContext):
    def __init__(self, strategy):
        # The replica's global id (its rank), as MWMS numbers replicas across workers.
        tf.distribute.ReplicaContext.__init__(self, strategy, replica_id_in_sync_group=collectives.rank())

    @property
    def devices(self):
        return self._strategy.extended.worker_devices


def _allgather_along(value, axis):
    if axis != 0:
        perm = [axis] + [d for d in range(len(value.shape)) if d != axis]
        gathered = collectives.allgather(tf.transpose(value, perm))
        inverse = [perm.index(d) for d in range(len(perm))]
        return tf.transpose(gathered, inverse)
    return collectives.allgather(value)


def _shapes_agree(tensors):
    """Whether every rank's `tensors` have the same shapes (a collective: call it on every rank)."""
    sizes = [tf.constant([len(tensors)], tf.int64)] + [tf.shape(t, out_type=tf.int64) for t in tensors]
    gathered = collectives.allgather(tf.concat(sizes, 0)[None])
    return tf.reduce_all(tf.equal(gathered, gathered[0]))


def _signature(values, width=12):
    """Encode small ints (ndim, dtype enum, dims) as a fixed-width int64 row for allgather."""
    row = np.full([1, width], -2, dtype=np.int64)
    row[0, : len(values)] = values
    return row


def _describe_signature(row):
    ndim, dtype_enum = int(row[0]), int(row[1])
    shape = tuple(int(d) for d in row[2 : 2 + ndim])
    return f"shape {shape} dtype {tf.dtypes.as_dtype(dtype_enum).name}"
