"""fp16 and bf16 on the wire: floating gradients cast to 16 bits for the allreduce and back after.

```python
import tfdist
strategy = tfdist.HorovodStrategy(compression="bf16")  # bfloat16: float32's range, 8 significant bits
strategy = tfdist.HorovodStrategy(compression="fp16")  # float16: 11 significant bits, up to 65504
```

Both halve the bytes of float32 gradients and are Horovod Compressions (`hvd.Compression.fp16`,
`hvd.Compression.bf16`) applied to the optimizer's gradient sum only. bfloat16 needs a Horovod
whose CPU collectives take bfloat16 (tfdist's patch `0008-bfloat16-cpu-collectives.patch`: Gloo
and MPI add the ranks' values in float32 and round once); `bf16_refusal()` says why it cannot run
where the build or the device lacks it. Asked of Horovod itself (`hvd.bfloat16_built()`), never
read from a version string.
"""

from __future__ import annotations

from typing import Any

from tfdist import collectives

CASTS = ("fp16", "bf16")
BF16_PATCH = "0008-bfloat16-cpu-collectives.patch"


def horovod_compression(value: str | Any | None) -> Any:
    """The Horovod Compression for None, "none", "fp16", "bf16" or a Compression object.

    Raises:
        ValueError: "bf16" where this Horovod build has no bfloat16 collectives (the message
            names the build and how to rebuild it), or an unknown string.
    """
    hvd = collectives.horovod()
    if value is None or value == "none":
        return None
    if value == "fp16":
        return hvd.Compression.fp16
    if value == "bf16":
        refusal = bf16_refusal()
        if refusal:
            raise ValueError(refusal)
        return hvd.Compression.bf16
    if isinstance(value, str):
        raise ValueError(f"compression={value!r}: expected None, 'none', 'fp16' or 'bf16'")
    return value


def is_bf16(compression: Any) -> bool:
    """Whether `compression` (a Horovod Compression) sends bfloat16."""
    return compression is not None and compression is getattr(collectives.horovod().Compression, "bf16", None)


def bf16_refusal(device: str | None = None) -> str | None:
    """Why `compression="bf16"` cannot run here (a message naming the fix), or None when it can.

    Args:
        device: this rank's replica device, once known: a GPU replica sums on NCCL where Horovod
            was built with it, and this build's NCCL path has no bfloat16.
    """
    hvd = collectives.horovod()
    built = getattr(hvd, "bfloat16_built", None)
    if built is None or not built():
        return (f"compression='bf16': this Horovod ({collectives.horovod_version()} at {hvd.__file__}) was "
                f"built without bfloat16 collectives (tfdist's patch {BF16_PATCH}: Gloo and MPI sums in "
                "float32). Rebuild it with `tfdist-install-horovod` (in a tfdist checkout, `bash "
                "scripts/bootstrap.sh`), which applies the patch and caches the new wheel apart; or use "
                "compression='fp16'.")
    if device is not None and "gpu" in device.lower() and hvd.nccl_built():
        return (f"compression='bf16': this rank's replica is on {device}, where Horovod sums with NCCL, and "
                "this Horovod build's NCCL path has no bfloat16 (only its Gloo and MPI CPU sums do). Use "
                "compression='fp16' on GPUs, or a CPU replica (device='/cpu:0').")
    return None
