"""GPUs: one per local rank, chosen before TensorFlow loads, and what TensorFlow then reports.

```python
from tfdist.tuning import gpu
gpu.visible_ids()                     # ("0", "1", "2", "3"): what this node lets the job use
gpu.early_env(local_rank=1, ids=("0", "1", "2", "3"))
# {"CUDA_VISIBLE_DEVICES": "1", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
print(gpu.describe(gpu.in_effect()))  # GPU 1 = NVIDIA H100 80GB HBM3 (cc 9.0), memory growth on
```

`tfdist.tuning.startup` sets `early_env` for this rank when it runs before TensorFlow loads (`import
tfdist` first, `tfdist-run`, or `python -m tfdist --` under srun/mpirun): each local rank then
sees only its own GPU, so TensorFlow creates no context on the others, and allocates GPU memory
as it needs it. A list the launcher already narrowed to one device (Slurm's `--gpus-per-task=1`)
is kept. Where TensorFlow loaded first, `tfdist.tuning.plan.apply` does the same through `tf.config`
(visible devices, memory growth) while it still can, and says so where it cannot.

`require_gpu` is what a job that asked for a GPU (`HorovodStrategy(device="gpu")`,
`tfdist-benchmark --device gpu`) runs: with none visible it raises `GPUNotFoundError` naming the
rank, the host and everything that was found (driver, `CUDA_VISIBLE_DEVICES`, TensorFlow's
build and device list).
"""

import glob
import os
import socket

from tfdist.errors import GPUNotFoundError

VISIBLE = "CUDA_VISIBLE_DEVICES"
GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"
DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"


def visible_ids(env=None, device_files=None):
    """The GPU ids this process may use, without importing TensorFlow.

    `CUDA_VISIBLE_DEVICES` where set (its entries as given: indices or UUIDs; "" or "-1" means
    none), else one id per `/dev/nvidiaN` device file.
    """
    env = os.environ if env is None else env
    if VISIBLE in env:
        ids = []
        for entry in (e.strip() for e in env[VISIBLE].split(",")):
            if not entry or entry.startswith("-"):
                break  # CUDA stops at the first invalid entry
            ids.append(entry)
        return tuple(ids)
    files = glob.glob("/dev/nvidia[0-9]*") if device_files is None else device_files
    numbers = sorted(int(os.path.basename(f)[len("nvidia"):]) for f in files
                     if os.path.basename(f)[len("nvidia"):].isdigit())
    return tuple(str(n) for n in numbers)


def early_env(local_rank, ids):
    """Variables for the rank with `local_rank` on a node whose job may use GPUs `ids`.

    More than one id: this rank's (`local_rank % len(ids)`: ranks share GPUs round-robin when
    there are more ranks than GPUs). Memory growth whenever there is a GPU.
    """
    if not ids:
        return {}
    env = {GROWTH: "true"}
    if len(ids) > 1:
        env[VISIBLE] = ids[local_rank % len(ids)]
    return env


def driver_version():
    """The loaded NVIDIA kernel driver's version line, or None where no driver is loaded."""
    try:
        with open(DRIVER_VERSION_FILE) as f:
            return f.readline().strip() or None
    except OSError:
        return None


def cuda_libraries():
    """The CUDA runtime and cuDNN wheels TensorFlow's GPU stack installs (`tensorflow[and-cuda]`),
    e.g. "CUDA 12.9.79, cuDNN 9.28.0.42", or None where they are absent (the CPU stack: TensorFlow's
    wheels are all CUDA builds, so the build alone does not tell)."""
    from importlib import metadata

    try:
        return (f"CUDA {metadata.version('nvidia-cuda-runtime-cu12')}, "
                f"cuDNN {metadata.version('nvidia-cudnn-cu12')}")
    except metadata.PackageNotFoundError:
        return None


def in_effect():
    """This process's GPUs as TensorFlow reports them (after visibility was set)."""
    import tensorflow as tf

    devices = []
    for device in tf.config.get_visible_devices("GPU"):
        details = tf.config.experimental.get_device_details(device)
        try:  # TF_FORCE_GPU_ALLOW_GROWTH=true, set before TensorFlow loaded, is growth too
            growth = tf.config.experimental.get_memory_growth(device) or os.environ.get(GROWTH, "").lower() == "true"
        except (ValueError, RuntimeError):
            growth = None
        devices.append({"name": device.name, "device_name": details.get("device_name"),
                        "compute_capability": list(details.get("compute_capability") or []),
                        "memory_growth": growth})
    return {"gpus": devices, "cuda_visible_devices": os.environ.get(VISIBLE),
            "cuda_libraries": cuda_libraries()}


def describe(effect):
    """One phrase for the tuning line, e.g. "GPU 1 = NVIDIA H100 (cc 9.0), memory growth on"."""
    if not effect["gpus"]:
        return ""
    ids = visible_ids({VISIBLE: effect["cuda_visible_devices"]}) if effect["cuda_visible_devices"] else ()
    parts = []
    for i, device in enumerate(effect["gpus"]):
        physical = ids[i] if i < len(ids) else device["name"].rsplit(":", 1)[-1]
        cc = ".".join(str(c) for c in device["compute_capability"])
        growth = {True: "memory growth on", False: "memory growth off"}.get(device["memory_growth"], "")
        parts.append(f"GPU {physical} = {device['device_name'] or device['name']}"
                     + (f" (cc {cc})" if cc else "") + (f", {growth}" if growth else ""))
    return "; ".join(parts)


def absence(effect):
    """ "no GPU visible (CUDA ..., cuDNN ... installed)" where the GPU stack sees no GPU, else "". """
    if effect["gpus"] or not effect["cuda_libraries"]:
        return ""
    return f"no GPU visible ({effect['cuda_libraries']} installed)"


def is_gpu_request(device):
    """Whether a `device` argument asks for a GPU ("gpu", "GPU:1", "/gpu:0", "/job:x/device:GPU:0")."""
    return device is not None and "gpu" in str(device).lower()


def require_gpu(device, rank, local_rank):
    """The TensorFlow device for a `device` that asks for a GPU; raises `GPUNotFoundError` if none is visible.

    "gpu" (any case) means this rank's GPU: the only one it sees, or `local_rank % count`.
    """
    import tensorflow as tf

    logical = tf.config.list_logical_devices("GPU")
    if not logical:
        raise GPUNotFoundError(_not_found(device, rank))
    if str(device).strip().lower() in ("gpu", "/gpu"):
        return logical[local_rank % len(logical)].name
    return device


def _not_found(device, rank):
    import tensorflow as tf

    driver = driver_version()
    listed = [d.name for d in tf.config.list_physical_devices()]
    found = [
        f"NVIDIA driver: {driver}" if driver else f"no NVIDIA driver loaded ({DRIVER_VERSION_FILE} absent)",
        f"{VISIBLE}={os.environ[VISIBLE]!r}" if VISIBLE in os.environ else f"{VISIBLE} unset",
        f"device files: {', '.join(sorted(glob.glob('/dev/nvidia[0-9]*'))) or 'none'}",
        f"TensorFlow {tf.__version__} with {cuda_libraries()}" if cuda_libraries()
        else f"TensorFlow {tf.__version__} without its CUDA libraries (the CPU stack)",
        f"TensorFlow's devices: {', '.join(listed) or 'none'}",
    ]
    if not cuda_libraries():
        fix = ("install the GPU stack: `TFDIST_GPU=1 bash scripts/bootstrap.sh`, or "
               "`pip install 'tfdist[gpu]'` then `tfdist-install-horovod --gpu yes`")
    elif not driver:
        fix = "run on a node with an NVIDIA GPU and its driver, or drop the GPU request to train on the CPU"
    else:
        fix = (f"check {VISIBLE} and the GPUs your launcher or scheduler gave this job "
               "(e.g. srun --gpus-per-task=1), and TensorFlow's log for why it skipped them")
    return (f"rank {rank} (host {socket.gethostname()}) asked for a GPU (device={device!r}) and "
            f"TensorFlow sees none. Found: {'; '.join(found)}. Fix: {fix}.")
