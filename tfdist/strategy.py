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

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfdist import _compat, collectives, input_contract
from tfdist.faults import consistency
from tfdist.faults import hang_detector
from tfdist.keras import flavour as keras_flavour
from tfdist.horovod_build import versions
from tfdist.exchange import xla
from tfdist.tuning import gpu as gpu_lib
from tfdist import precision as precision_lib
from tfdist.faults import watchdog as watchdog_lib
from tfdist.errors import KerasHookError
from tfdist.exchange import casts
from tfdist.exchange import gradients as gradient_exchange
from tfdist.keras import callback_writes as keras_callbacks
from tfdist.keras import adopted_strategy, chief_saves, fit_callbacks, model_build, recognise
from tfdist.keras import preemption as keras_preemption
from tfdist.keras import sharded_optimizer
from tfdist.keras import metrics as keras_metrics
from tfdist.keras import predictions as keras_predict
from tfdist.keras import progress as quiet_ranks
from tfdist.keras import step_clock, step_marks, step_outputs
from tfdist.keras.recognise import multi_rank_strategy_of  # noqa: F401  (this module's name for it since 0.1)
from tfdist.keras.flavour import legacy_requested
from tfdist.launch import start as launch_start
from tfdist.strategy_extended import HorovodExtended
from tfdist.strategy_options import StrategyOptions
from tfdist.tuning import cycle, horovod_env
from tfdist.tuning import plan as tuning_lib

if TYPE_CHECKING:
    from tfdist.exchange.compression import Compressor


@recognise.register
class HorovodStrategy(tf.distribute.OneDeviceStrategy):
    """Data-parallel strategy over Horovod: one replica per process, on this rank's device.

    Args:
        device: device for this rank's replica; default: this rank's GPU (the one `tfdist.tuning.gpu`
            left visible to it, or `GPU:<local_rank>` of the visible GPUs) or else the CPU.
            "gpu" insists on this rank's GPU: with none visible, `GPUNotFoundError` names what
            was found (driver, CUDA_VISIBLE_DEVICES, TensorFlow's build and devices); so does
            any other GPU device name ("/gpu:0").
        batch_convention: "global" (default, as MultiWorkerMirroredStrategy): a dataset given to
            `experimental_distribute_dataset` or `fit` is batched by the global batch, and each
            rank gets its part of every batch (rebatched and auto-sharded by the dataset's
            `auto_shard_policy`, exactly as MWMS does); `predict` returns every rank's rows.
            "per_rank" (Horovod's convention, for ported Horovod scripts): each rank's dataset is
            its own, batched per rank, and used as given. `distribute_datasets_from_function`
            and `pipelines.read_dataset(input_context=...)` datasets are per rank either way.
        compression: gradient compression: None or "none"; "bf16" (floating gradients travel as
            bfloat16 and are summed in float32, rounded once; half the bytes of float32, float32's
            range, so no loss scaling; CPU replicas, and a Horovod built by
            `tfdist-install-horovod` with its bfloat16 patch, else refused naming the fix); "fp16"
            (cast to float16 before and back after; half the bytes, range up to 65504) or a
            `horovod.tensorflow.Compression`; `"powersgd:<rank>"` or `"topk:<density>"` (or a
            `tfdist.exchange.compression.PowerSGD` / `TopK`): low-rank or sparse gradients with error
            feedback, per-rank state that `callbacks.Checkpointer` saves. Every compression
            applies to the optimizer's gradient sum only (docs/COMMUNICATION.md).
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
            HOROVOD_CYCLE_TIME or `horovod=` says otherwise, which each enqueued collective starts
            at once: HOROVOD_CYCLE_ON_ENQUEUE), or the choice `tfdist-tune` cached for
            this machine; "measure" first runs `tfdist-tune` for this job's ranks per node when
            nothing is cached (oneDNN's choice takes effect from the next start); False leaves the
            process as it is; a dict overrides choices (`intra_op_threads`, `inter_op_threads`,
            `pin`, `onednn`). Settings TensorFlow reads when it loads are applied by `import tfdist`
            before `import tensorflow` or by `tfdist-run`; the chief prints what is in effect.
        horovod: Horovod knobs set before `hvd.init()` unless already in the environment:
            `fusion_threshold_mb`, `cycle_time_ms`, `timeline` (a file path), `autotune` (bool).
        watchdog: with more than one rank, a dead or stalled rank makes every other rank exit
            naming it (`tfdist.faults.watchdog`): True (timeout from `TFDIST_WATCHDOG_TIMEOUT`, default
            20 s), a number of seconds, or False.
        check_consistency: compare versions, tfdist's source, the main script and `fingerprint`
            across ranks now, and the first distributed dataset's batch size, structure and
            manifest (`tfdist.faults.consistency`); a difference raises `RankMismatchError`.
        fingerprint: any string that must be equal on every rank (a config hash, a git commit).
        bucket_mb: how gradients are scheduled. None (default): each gradient is an allreduce
            of its own, issued the moment backprop produces it, and Horovod fuses whatever is
            ready on every rank each cycle (readiness-driven fusion, as Horovod's own
            `DistributedGradientTape` loop). A size in MB (2**20 bytes): buckets of about that size, last layers
            first, each one grouped allreduce issued when its gradients exist. 0: each dtype's
            gradients as one grouped allreduce once the last gradient exists. Every schedule
            overlaps the exchange with the rest of backprop except 0 (measured on emulated 1 Gbit/s
            links: docs/benchmarks/records-2026-11-23-multihost.md and
            records-2026-11-24-exchange-compression.md).
        fused_batchnorm: on Keras 3, run 4-D `BatchNormalization` layers with TensorFlow's fused
            kernel, as tf-keras does (`tfdist.keras.fused_batchnorm`: same results, falls back
            where it would differ); False leaves Keras' own implementation.
        shard_optimizer_state: each rank keeps the optimizer state (momentum, Adam's moments) of
            its 1/N slice of every variable (ZeRO stages 1 and 2): gradients are reduce-scattered,
            each rank updates its slices, the slices are all-gathered into the whole weights (the
            bytes of an allreduce). Results equal the unsharded strategy's (1e-5); saves hold the
            whole state and load on any rank count (every rank must make a save that holds the
            optimizer). Keras 3 and tf-keras; optimizers whose update is elementwise (SGD, Adam,
            AdamW, RMSprop, ..., tfdist's LARS and LARC), others raise `ShardedStateError`
            naming them; refused with `op="adasum"` or PowerSGD/top-k compression
            (docs/COMMUNICATION.md).

    Raises:
        ValueError: an argument it cannot use, named in the message; checked before Horovod
            starts (`tfdist.strategy_options`). Also `op="adasum"` where this launch cannot run it,
            and `compression="bf16"` where this Horovod build or a GPU replica lacks bfloat16.
        TypeError: an argument of the wrong type, named in the message.
        HorovodNotAvailableError: Horovod is not installed, or was built without TensorFlow.
        KerasHookError: `keras` is older than 3.5 (Keras 2 with TensorFlow 2.15 and older; the
            message names the versions and tfdist's range), or a Keras hook cannot be installed.
        GPUNotFoundError: `device` asks for a GPU and this rank sees none.
        RankMismatchError: ranks run different versions, code or `fingerprint` (`check_consistency`).
        WatchdogError: rank 0 cannot listen for the other ranks' heartbeats.

    Example:
        Under `tfdist-run -np 2 python train.py`:

        ```python
        strategy = tfdist.HorovodStrategy(bucket_mb=25, precision="auto")
        print(strategy.rank, strategy.size, strategy.options.batch_convention)
        ```
    """

    def __init__(self, device: str | None = None, *, batch_convention: str = "global",
                 compression: str | Compressor | Any | None = None, op: str = "average",
                 check_variables: bool = True, precision: str | None = None,
                 tuning: bool | str | dict[str, Any] = True, horovod: dict[str, Any] | None = None,
                 watchdog: bool | float = True, check_consistency: bool = True, fingerprint: str | None = None,
                 fused_batchnorm: bool = True, bucket_mb: float | None = None,
                 shard_optimizer_state: bool = False) -> None:
        if not legacy_requested():  # before anything starts: Keras 2 and 3.4 lack hooks installed below
            refusal = versions.keras_refusal(tf.__version__, keras_flavour.keras_module().__version__)
            if refusal:
                raise KerasHookError(refusal)
        options = StrategyOptions.from_arguments(
            device, batch_convention=batch_convention, compression=compression, op=op,
            check_variables=check_variables, precision=precision, tuning=tuning, horovod=horovod,
            watchdog=watchdog, check_consistency=check_consistency, fingerprint=fingerprint,
            fused_batchnorm=fused_batchnorm, bucket_mb=bucket_mb, shard_optimizer_state=shard_optimizer_state)
        self.options = options
        horovod_env.set_horovod_knobs(options.horovod)
        if options.tuning == "measure":
            from tfdist.tuning import environment
            from tfdist.tuning import tuner

            tuner.ensure_measured(*environment.local_layout())
        horovod_defaults = horovod_env.set_horovod_defaults() if options.tuning is not False else {}
        collectives.init()
        cycle_on_enqueue = cycle.starts_on_enqueue()  # Horovod's word: patch 0017 and the variable
        if horovod_defaults.get(horovod_env.CYCLE_ON_ENQUEUE) and not cycle_on_enqueue:
            horovod_defaults[horovod_env.CYCLE_ON_ENQUEUE] = ("1", horovod_env.ON_ENQUEUE_MISSING)
        self.tuning_plan = (tuning_lib.tune_this_rank(options.tuning, horovod_defaults)
                            if options.tuning is not False else None)
        if options.op == "adasum" and collectives.adasum_refusal():  # depends on the launch: known now
            raise ValueError(collectives.adasum_refusal())
        # After tuning: these run the first TensorFlow ops, which fix the thread pools.
        if options.check_consistency:
            consistency.check_start(options.fingerprint)
        if options.watchdog is not False:
            watchdog_lib.start(None if options.watchdog is True else float(options.watchdog))
            hang_detector.start()  # ranks that wait in different collectives: named, then stopped
        input_contract.agree_on_tf_seed()
        gradient_exchange.install_gradient_marker()
        gradient_exchange.install_clipping_after_sum()
        if collectives.size() > 1 and not collectives.xla_ops_available():
            xla.install()  # jit_compile=True: XLA clusters around the collectives
        device = options.device
        if gpu_lib.is_gpu_request(device):
            device = gpu_lib.require_gpu(device, collectives.rank(), collectives.local_rank())
        if device is None:
            gpus = tf.config.list_logical_devices("GPU")
            device = gpus[collectives.local_rank() % len(gpus)].name if gpus else "/cpu:0"
        if casts.is_bf16(options.horovod_compression) and casts.bf16_refusal(device):
            raise ValueError(casts.bf16_refusal(device))  # a GPU replica: NCCL has no bfloat16 here
        # Skip OneDeviceStrategy.__init__, which would build a OneDeviceExtended.
        tf.distribute.Strategy.__init__(self, HorovodExtended(self, device, options))
        keras_metrics.install()
        step_outputs.install()  # what a custom train/test step returns: reduced across ranks, as Keras reduces replicas
        keras_predict.install()
        model_build.install()  # Keras 3 builds the model from the dataset's spec, reading no batch
        keras_callbacks.install()
        step_marks.install()  # each fit's batches marked for the hang detector
        if horovod_env.cycle_is_cpu_default(horovod_defaults) and collectives.size() > 1 and not cycle_on_enqueue:
            cycle.follow_steps(horovod_env.CPU_CYCLE_TIME_MS)
            step_clock.install()  # the cycle set from the first train steps' length
        chief_saves.install()
        fit_callbacks.install()
        keras_preemption.install()  # after keras_callbacks: it wraps BackupAndRestore's chief-only save
        quiet_ranks.install()  # only the chief prints Keras' progress bars and warnings
        adopted_strategy.install()  # last, outermost: a model built outside the scope adopts it first
        if options.fused_batchnorm and not legacy_requested():
            from tfdist.keras import fused_batchnorm as fused_batchnorm_hook

            fused_batchnorm_hook.install()
        precision_lib.install()
        if options.shard_optimizer_state:
            sharded_optimizer.install()  # Keras 3 optimizers keep state for their rank's slices (2+ ranks)
            if _compat.tf_keras_in_use():
                from tfdist.keras import sharded_tf_keras

                sharded_tf_keras.install()  # and tf-keras
        if options.precision is not None:
            precision_lib.set_policy(options.precision)
        launch_fact = launch_start.startup_fact()  # a TF_CONFIG cluster joined, or a TF_CONFIG ignored
        if self.tuning_plan is not None:
            tuning_lib.announce(self.tuning_plan, (gpu_lib.absence(self.tuning_plan.effect["gpu"]),
                                                   collectives.transport(device), precision_lib.policy_name(),
                                                   launch_fact))
        elif launch_fact and collectives.rank() == 0:
            print(f"tfdist launch: {launch_fact}", flush=True)

    # Horovod topology, for user code (data sharding, logging, chief-only work).
    @property
    def rank(self) -> int:
        """This process's Horovod rank (0 is the chief)."""
        return collectives.rank()

    @property
    def size(self) -> int:
        """The number of ranks (replicas) in the job."""
        return collectives.size()

    @property
    def local_rank(self) -> int:
        """This process's rank among the ranks on its node."""
        return collectives.local_rank()

    @property
    def local_size(self) -> int:
        """The number of ranks on this node."""
        return collectives.local_size()

    @property
    def compressor(self) -> Compressor | None:
        """The `tfdist.exchange.compression.Compressor` of the gradient exchange, or None."""
        return self.extended._compressor

    @property
    def is_chief(self) -> bool:
        """Whether this rank is the chief (rank 0), the one that writes shared files."""
        return self.rank == 0

    def chief_path(self, path: str | os.PathLike) -> str:
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
