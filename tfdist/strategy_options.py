"""`HorovodStrategy`'s arguments, checked before anything starts.

Every argument is validated here, before Horovod starts, the tuning plan is applied, the ranks
compare their versions or the watchdog listens: a misspelt option fails at once, naming itself,
on every rank alike, instead of after a collective that another rank may never reach.

```python
from tfdist.strategy_options import StrategyOptions
options = StrategyOptions.from_arguments(batch_convention="per_rank", bucket_mb=25)
print(options.splits_global_batches, options.bucket_bytes)   # False 26214400
```
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from typing import Any

from tfdist.tuning import horovod_env
from tfdist.tuning import plan as tuning_plan
from tfdist.units import MB

BATCH_CONVENTIONS = ("global", "per_rank")
OPS = ("average", "adasum")
# What `tuning=` and `horovod=` accept is what the plan takes: make_plan's keyword arguments and
# the knobs set_horovod_knobs knows.
TUNING_OVERRIDES = tuple(name for name, p in inspect.signature(tuning_plan.make_plan).parameters.items()
                         if p.kind is p.KEYWORD_ONLY)
HOROVOD_KNOBS = tuple(horovod_env.HOROVOD_KNOBS)


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """`HorovodStrategy`'s arguments, validated and in the form the strategy uses.

    Args:
        device: the replica's device as given (None: this rank's GPU, else the CPU).
        batch_convention: "global" (batches are global and split across ranks, as
            MultiWorkerMirroredStrategy) or "per_rank" (Horovod's: each rank's batches are its own).
        horovod_compression: a `horovod.tensorflow.Compression` for the gradient allreduce.
        compressor: a `tfdist.exchange.compression.Compressor`, or None.
        op: "average" or "adasum".
        check_variables: compare every new variable across ranks before broadcasting it.
        precision: None, "auto" or a Keras dtype policy name.
        tuning: True, False, "measure" or a dict of overrides.
        horovod: Horovod knobs (`fusion_threshold_mb`, `cycle_time_ms`, `timeline`, `autotune`).
        watchdog: True (the default timeout), False (none) or a timeout in seconds.
        check_consistency: compare versions, source and the first dataset across ranks.
        fingerprint: a string every rank must agree on, or None.
        fused_batchnorm: run Keras 3 BatchNormalization on TensorFlow's fused kernel.
        bucket_bytes: None (each gradient as it is ready), 0 (one collective) or a bucket size in bytes.
        shard_optimizer_state: each rank keeps the optimizer state of its slice of every variable.
    """

    device: str | None
    batch_convention: str
    horovod_compression: Any
    compressor: Any
    op: str
    check_variables: bool
    precision: str | None
    tuning: bool | str | dict
    horovod: dict
    watchdog: bool | float
    check_consistency: bool
    fingerprint: str | None
    fused_batchnorm: bool
    bucket_bytes: int | None
    shard_optimizer_state: bool = False

    @property
    def splits_global_batches(self) -> bool:
        """Whether a dataset's batches are global batches that the strategy splits across ranks."""
        return self.batch_convention == "global"

    @classmethod
    def from_arguments(cls, device: str | None = None, *, batch_convention: str = "global",
                       compression: Any = None, op: str = "average", check_variables: bool = True,
                       precision: str | None = None, tuning: bool | str | dict = True,
                       horovod: dict | None = None, watchdog: bool | float = True,
                       check_consistency: bool = True, fingerprint: str | None = None,
                       fused_batchnorm: bool = True, bucket_mb: float | None = None,
                       shard_optimizer_state: bool = False) -> StrategyOptions:
        """Check `HorovodStrategy`'s arguments (same names and defaults) and convert them.

        Args:
            device: see `HorovodStrategy`.
            batch_convention: see `HorovodStrategy`.
            compression: see `HorovodStrategy`.
            op: see `HorovodStrategy`.
            check_variables: see `HorovodStrategy`.
            precision: see `HorovodStrategy`.
            tuning: see `HorovodStrategy`.
            horovod: see `HorovodStrategy`.
            watchdog: see `HorovodStrategy`.
            check_consistency: see `HorovodStrategy`.
            fingerprint: see `HorovodStrategy`.
            fused_batchnorm: see `HorovodStrategy`.
            bucket_mb: see `HorovodStrategy`.
            shard_optimizer_state: see `HorovodStrategy`.

        Returns:
            The validated options.

        Raises:
            ValueError: an argument has a value the strategy cannot use; the message names it
                and what it accepts.
            TypeError: an argument has the wrong type.
        """
        from tfdist.exchange import casts
        from tfdist.exchange import compression as compression_lib

        if device is not None and not isinstance(device, str):
            raise TypeError(f"device={device!r}: expected None, 'gpu' or a TensorFlow device name such as '/cpu:0'")
        if batch_convention not in BATCH_CONVENTIONS:
            raise ValueError(f"batch_convention={batch_convention!r}: expected 'global' (the "
                             "tf.distribute contract) or 'per_rank' (Horovod's)")
        if op not in OPS:
            raise ValueError(f"op={op!r}: HorovodStrategy supports op='average' or op='adasum'")
        horovod_compression, compressor = compression_lib.parse(compression)
        if op == "adasum" and compressor is not None:
            raise ValueError(f"op='adasum' with compression={compressor.describe()!r}: Adasum combines whole "
                             "gradients; use one or the other")
        if op == "adasum" and casts.is_bf16(horovod_compression):
            raise ValueError("op='adasum' with compression='bf16': Horovod's Adasum has no bfloat16 kernel; use "
                             "op='average' with bf16, or Adasum with compression=None or 'fp16'")
        if precision is not None and not isinstance(precision, str):
            raise TypeError(f"precision={precision!r}: expected None, 'auto' or a Keras dtype policy name")
        if precision not in (None, "auto"):
            from tfdist.precision import POLICIES

            if precision not in POLICIES:
                raise ValueError(f"precision={precision!r}: expected None, 'auto' or one of {POLICIES}")
        _check_tuning(tuning)
        horovod = dict(horovod or {})
        unknown = sorted(set(horovod) - set(HOROVOD_KNOBS))
        if unknown:
            raise ValueError(f"horovod={horovod!r}: unknown option(s) {unknown}; expected {list(HOROVOD_KNOBS)}")
        if not isinstance(watchdog, bool) and not (isinstance(watchdog, numbers.Real) and watchdog >= 0):
            raise ValueError(f"watchdog={watchdog!r}: expected True, False or a timeout in seconds (>= 0)")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise TypeError(f"fingerprint={fingerprint!r}: expected a string (a config hash, a git commit) or None")
        if bucket_mb is not None and (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real)
                                      or bucket_mb < 0):
            raise ValueError(f"bucket_mb={bucket_mb!r}: expected None (each gradient as it is ready), 0 (one "
                             "collective) or a size in MB")
        if not isinstance(shard_optimizer_state, bool):
            raise TypeError(f"shard_optimizer_state={shard_optimizer_state!r}: expected True or False")
        if shard_optimizer_state and (op == "adasum" or compressor is not None):
            what = "op='adasum'" if op == "adasum" else f"compression={compressor.describe()!r}"
            raise ValueError(f"shard_optimizer_state=True with {what}: the sharded exchange reduce-scatters "
                             "the summed gradients, which Adasum and low-rank or sparse compression do not "
                             "produce; use one or the other (compression='fp16' works with it)")
        return cls(
            device=device, batch_convention=batch_convention, horovod_compression=horovod_compression,
            compressor=compressor, op=op, check_variables=bool(check_variables), precision=precision,
            tuning=tuning, horovod=horovod, watchdog=watchdog,
            check_consistency=bool(check_consistency), fingerprint=fingerprint,
            fused_batchnorm=bool(fused_batchnorm),
            bucket_bytes=None if bucket_mb is None else int(bucket_mb * MB),
            shard_optimizer_state=shard_optimizer_state,
        )


def _check_tuning(tuning: Any) -> None:
    if isinstance(tuning, bool) or tuning == "measure":
        return
    if not isinstance(tuning, dict):
        raise ValueError(f"tuning={tuning!r}: expected True, False, 'measure' or a dict of overrides "
                         f"({', '.join(TUNING_OVERRIDES)})")
    unknown = sorted(set(tuning) - set(TUNING_OVERRIDES))
    if unknown:
        raise ValueError(f"tuning={tuning!r}: unknown override(s) {unknown}; expected {list(TUNING_OVERRIDES)}")
