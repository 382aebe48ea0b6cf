"""Horovod collectives behind a small interface: init, allreduce, adasum, broadcast, allgather, reducescatter.

Everything in tfdist (strategy, callbacks, pipelines) that talks to other ranks goes through this
module, so the rest of the package never imports Horovod directly and a missing or half-built
Horovod fails in one place with one clear message. `process_rank()` / `process_size()` and the
object exchanges (`broadcast_object`, `allgather_object`: JSON-able values of any size) also
work in a single process without Horovod initialised, where they are the identity.

```python
from tfdist import collectives
collectives.init()
total = collectives.allreduce([tf.constant(1.0)], op="sum")[0]   # == size
config = collectives.broadcast_object({"lr": 0.1} if collectives.rank() == 0 else None)
```

In the TensorFlow profiler's trace each collective is named (`named()`): its ops sit under
`tfdist_allreduce/`, `tfdist_adasum/`, `tfdist_broadcast/`, `tfdist_allgather/`, `tfdist_reducescatter/` or the scope its
caller gives (`tfdist_metric_sync`, `tfdist_loss_scale_agreement`). `start_timeline()` /
`stop_timeline()` record Horovod's own timeline for chosen steps (callbacks.ProfileSteps). Run
eagerly, each collective is also marked for the hang detector (`tfdist.faults.hang`).
"""

import contextlib
import functools
import glob
import json
import os
import shutil

import numpy as np
import tensorflow as tf

from tfdist import _compat
from tfdist.faults import hang
from tfdist.exchange import sparse_rows, xla
from tfdist.errors import HorovodNotAvailableError

INSTALL_HINT = (
    "Install it into this environment with `tfdist-install-horovod` (builds Horovod 0.28.1 against "
    "the installed TensorFlow once, then reuses the cached wheel; no root needed); in a tfdist "
    "checkout, `bash scripts/bootstrap.sh` sets up .venv with everything (see README.md, "
    "'Install into your own environment')."
)

# Reduction names accepted by allreduce(), mapped to Horovod op attributes.
_OPS = {"sum": "Sum", "average": "Average", "adasum": "Adasum", "min": "Min", "max": "Max"}

_hvd = None
# A custom-call target registered only by horovod/tensorflow/xla_mpi_ops.cc.
_XLA_MARKER = b"CallbackHVDAllreduceDone"


def horovod_version():
    """The installed Horovod's version from its package metadata (no import), or "none"."""
    from importlib import metadata

    try:
        return metadata.version("horovod")
    except metadata.PackageNotFoundError:
        return "none"


def horovod():
    """Return the `horovod.tensorflow` module, raising a clear error when it is unusable."""
    global _hvd
    if _hvd is None:
        try:
            import horovod.tensorflow as hvd
        except ImportError as e:
            raise HorovodNotAvailableError(
                f"tfdist needs Horovod with TensorFlow support, but importing "
                f"horovod.tensorflow failed: {e}. {INSTALL_HINT}"
            ) from e
        _hvd = hvd
    return _hvd


def init():
    """Initialise Horovod once (size 1 without a launcher); returns the Horovod module.

    Under Slurm's `srun` without horovodrun or MPI, and in a cluster that `TF_CONFIG` describes,
    `tfdist.launch.start.prepare()` first runs the Gloo rendezvous and sets the variables `hvd.init()` reads.
    """
    hvd = horovod()
    if not hvd.is_initialized():
        from tfdist.launch import start as launch, thread_names

        launch.prepare(mpi_built=hvd.mpi_built())
        with thread_names.started_as(thread_names.EXCHANGE):  # Horovod's threads, named apart from TF's
            hvd.init()
    return hvd


def rank():
    return horovod().rank()


def size():
    return horovod().size()


def local_rank():
    return horovod().local_rank()


def local_size():
    return horovod().local_size()


def is_initialized():
    """Whether Horovod runs in this process (False also when Horovod is not installed)."""
    try:
        return horovod().is_initialized()
    except HorovodNotAvailableError:
        return False


def process_rank():
    """This process's rank, or 0 when Horovod is not initialised (then it is the only process)."""
    return rank() if is_initialized() else 0


def process_size():
    """The number of ranks, or 1 when Horovod is not initialised."""
    return size() if is_initialized() else 1


def broadcast_object(value, root_rank=0, name="tfdist.object"):
    """`root_rank`'s JSON-able `value` on every rank (other ranks pass anything); any size.

    One process (or Horovod not initialised) returns `value` itself. A collective otherwise:
    every rank must call it, in the same order.
    """
    if process_size() == 1:
        return value
    data = json.dumps(value).encode() if rank() == root_rank else b""
    length = int(broadcast(tf.constant([len(data)], tf.int64), root_rank, name=f"{name}.length").numpy()[0])
    buffer = np.frombuffer(data, np.uint8) if rank() == root_rank else np.zeros(length, np.uint8)
    received = broadcast(tf.constant(buffer), root_rank, name=f"{name}.data")
    return json.loads(received.numpy().tobytes())


def allgather_object(value, name="tfdist.objects"):
    """Every rank's JSON-able `value`, as a list in rank order; any size. A collective."""
    if process_size() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = allgather(tf.constant([data.size], tf.int64), name=f"{name}.lengths").numpy()
    joined = allgather(tf.constant(data), name=f"{name}.data").numpy().tobytes()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [json.loads(joined[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


@contextlib.contextmanager
def named(scope, kind=None, name=None):
    """Name the collective ops built inside as `scope` in the profiler's trace viewer.

    ```python
    with collectives.named("tfdist_metric_sync"):
        totals = collectives.allreduce(values)
    ```

    In a graph (`tf.function`, `model.fit`) it is a `tf.name_scope`, so the ops are
    `.../scope/HorovodAllreduce...`; run eagerly, where ops have no scope, it is a profiler range
    of that name around them (free when the profiler is off), and a `tfdist.faults.hang` mark (`kind`
    and `name`: the collective, e.g. "allreduce", "tfdist.metrics", as the hang detector names it).
    Every Horovod op tfdist builds is inside one, so a graph trace checks here, once for all,
    that XLA is not asked to compile it (`check_not_in_xla`).
    """
    if tf.executing_eagerly():
        mark = hang.enter(hang.collective(kind, name, scope))
        try:
            with tf.profiler.experimental.Trace(scope):
                yield
        finally:
            hang.leave(mark)
    else:
        check_not_in_xla(f"the collective {scope!r}")
        with tf.name_scope(scope):
            yield


def graph_name(kind, name=None):
    """The Horovod name for a collective: `name` if given; in a graph, `kind`; eagerly, None.

    Horovod names an unnamed collective built in a graph after its input tensors, and a tensor a
    `tf.function` captures from eager code is named by a process-wide counter (`725_0`). One rank
    that ran one more eager op (a chief-only log, a save) then enqueues a name its peers never
    will, and the job waits forever. The node's own name in the graph (scope + `kind`, made
    unique by TensorFlow in trace order) is the same on every rank that traced the same code.
    `kind` is Horovod's op name ("HorovodAllgather"), so profiles and timelines still say Horovod.
    """
    return name if name is not None or tf.executing_eagerly() else kind


def _op(name):
    try:
        return getattr(horovod(), _OPS[name])
    except KeyError:
        raise ValueError(f"unknown reduction {name!r}; expected one of {sorted(_OPS)}") from None


def allreduce(tensors, op="sum", name=None, compression=None, scope="tfdist_allreduce"):
    """Reduce a list of tensors (dense or `tf.IndexedSlices`) across ranks, fused by dtype.

    The list order must be the same on every rank. Tensors of one dtype go into one grouped
    allreduce, which Horovod fuses into as few collectives as its fusion buffer allows.
    An average of integer tensors is a floor division of the sum, keeping the dtype.
    `scope` names it in the profiler's trace viewer (see `named`).
    """
    with named(scope, "allreduce", name):
        return _allreduce(list(tensors), op, name, compression)


def _allreduce(tensors, op, name, compression):
    hvd = horovod()
    out = [None] * len(tensors)
    rows = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices) and op in ("sum", "average")]
    if rows:  # Horovod gathers a tf.IndexedSlices in two allgathers, rows and ids; packed, in one
        gather = functools.partial(hvd.grouped_allgather, **_group_name("HorovodGroupedAllgather", name, "rows"))
        for i, g in zip(rows, sparse_rows.gathered([tensors[i] for i in rows], gather,
                                                   hvd.size() if op == "average" else None)):
            out[i] = g
    by_dtype = {}
    for i, t in enumerate(tensors):
        if out[i] is None:
            by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        group_op = "sum" if op == "average" and dtype.is_integer else op
        kwargs = {"op": _op(group_op), **_group_name("HorovodGroupedAllreduce", name, dtype.name)}
        if compression is not None and dtype.is_floating:
            kwargs["compression"] = compression
        reduced = hvd.grouped_allreduce([tensors[i] for i in indices], **kwargs)
        for i, r in zip(indices, reduced):
            out[i] = r // hvd.size() if group_op != op else r
    return out


def _group_name(kind, name, part):
    """{"name": ...} for one part of a grouped collective named as `graph_name` says; {} eagerly unnamed."""
    group = graph_name(kind, name)
    return {} if group is None else {"name": f"{group}.{part}"}


def adasum_refusal(size=None):
    """Why `op="adasum"` cannot run in this job (a message naming the fix), or None when it can.

    Horovod's Adasum runs only on its MPI controller (a Gloo job fails inside the first
    collective), and only on a power-of-2 number of ranks.
    """
    hvd = horovod()
    size = hvd.size() if size is None else size
    if not hvd.mpi_built():
        return ("op='adasum': Horovod's Adasum runs on its MPI controller, and this Horovod was "
                "built with Gloo only. Install an MPI (e.g. Debian's libopenmpi-dev), run "
                "`tfdist-install-horovod` again (it then builds with MPI) and launch with "
                "`tfdist-run --launcher mpirun`; or use op='average'.")
    if size > 1 and not hvd.mpi_enabled():
        return ("op='adasum': Horovod's Adasum runs on its MPI controller, and this job runs on Gloo "
                "(started by horovodrun --gloo, or srun without MPI). Launch with "
                "`tfdist-run --launcher mpirun -np N ...` (or `horovodrun --mpi`); or use op='average'.")
    if size & (size - 1):
        return (f"op='adasum': Horovod's Adasum needs a power-of-2 number of ranks, and this job has "
                f"{size}. Launch 1, 2, 4, 8, ... ranks; or use op='average'.")
    return None


def adasum(tensors, num_replicas, compression=None, scope="tfdist_adasum"):
    """Combine gradients across ranks with Horovod's Adasum, one tensor at a time.

    For two ranks' gradients a, b of one tensor: (1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b
    (the sum when they are orthogonal, a itself when a == b); more ranks combine pairwise in a
    tree. Keras divides each replica's loss by `num_replicas` before differentiating, and Adasum
    is homogeneous of degree 1, so the result is multiplied by `num_replicas` once: it is the
    Adasum of the ranks' unscaled gradients. `tf.IndexedSlices` are densified (Horovod's Adasum
    is dense only); tensors Horovod queues separately still share its fusion buffer.
    """
    hvd = horovod()
    kwargs = {"op": hvd.Adasum}
    if compression is not None:
        kwargs["compression"] = compression
    with named(scope, "adasum"):
        out = []
        for t in tensors:
            t = tf.convert_to_tensor(t)  # IndexedSlices -> dense
            if not t.dtype.is_floating:
                raise ValueError(f"op='adasum' combines floating gradients; got a {t.dtype.name} tensor")
            # Per tensor: hvd.grouped_allreduce's Adasum branch reads an unbound variable (0.28.1).
            reduced = hvd.allreduce(t, name=graph_name("HorovodAdasum"), **kwargs)
            out.append(reduced * tf.constant(num_replicas, reduced.dtype))
        return out


def broadcast(tensor, root_rank=0, name=None, scope="tfdist_broadcast"):
    with named(scope, "broadcast", name):
        return horovod().broadcast(tensor, root_rank=root_rank, name=graph_name("HorovodBroadcast", name))


def allgather(tensor, name=None, scope="tfdist_allgather"):
    with named(scope, "allgather", name):
        return horovod().allgather(tensor, name=graph_name("HorovodAllgather", name))


def grouped_allgather(tensors, name=None, scope="tfdist_allgather"):
    """Every rank's `tensors`, each concatenated on its first dimension: one grouped collective."""
    with named(scope, "allgather", name):
        return horovod().grouped_allgather(list(tensors), name=graph_name("HorovodGroupedAllgather", name))


def reducescatter(tensors, name=None, compression=None, scope="tfdist_reducescatter"):
    """Sum `tensors` (one dtype; first dimensions equal on every rank, divisible by N) across ranks;
    each rank keeps its 1/N of the first dimension, in rank order. One (grouped) collective; the
    grouped form takes no name (Horovod names it by its inputs)."""
    hvd, extra = horovod(), {} if compression is None else {"compression": compression}
    with named(scope, "reducescatter", name):
        if len(tensors) == 1:
            return [hvd.reducescatter(tensors[0], op=hvd.Sum, name=graph_name("HorovodReducescatter", name), **extra)]
        return hvd.grouped_reducescatter(list(tensors), op=hvd.Sum, **extra)


def transport(device):
    """How this rank's collectives travel, for the tuning line: "collectives NCCL 2.32.3 on GPU
    (controller Gloo)", "collectives Gloo through host memory (Horovod built without NCCL)" on a
    GPU with a Horovod built without NCCL, "collectives Gloo on CPU"; with several CPU ranks on
    a node it names Open MPI's shared memory where that is there (docs/LAUNCH.md)."""
    hvd = horovod()
    controller = "MPI" if hvd.mpi_enabled() else "Gloo" if hvd.gloo_enabled() else "none"
    if "gpu" not in str(device).lower():
        open_mpi = shutil.which("mpirun") and shutil.which("ompi_info")  # tfdist-run's mpirun flags are Open MPI's
        if controller == "Gloo" and local_size() > 1 and hvd.mpi_built() and open_mpi:
            return (f"collectives Gloo on CPU ({local_size()} ranks on this node over loopback TCP; "
                    "mpirun exchanges through shared memory: tfdist-run --launcher mpirun)")
        return f"collectives {controller} on CPU"
    code = hvd.nccl_built()
    if not code:
        return f"collectives {controller} through host memory (Horovod built without NCCL)"
    return f"collectives NCCL {code // 10000}.{code // 100 % 100}.{code % 100} on GPU (controller {controller})"


def timeline_mode():
    """How this job can record Horovod's timeline, from `HOROVOD_TIMELINE` as `hvd.init()` read it:
    "dynamic" (`HOROVOD_TIMELINE=DYNAMIC`): nothing is recorded until `start_timeline()`; "file":
    a timeline of the whole job goes to that path; None: unset, Horovod refuses `start_timeline()`."""
    value = os.environ.get("HOROVOD_TIMELINE", "")
    if not value:
        return None
    return "dynamic" if value == "DYNAMIC" else "file"


def start_timeline(path):
    """Record Horovod's timeline (a Chrome trace) into `path` until `stop_timeline()`.

    ```python
    collectives.start_timeline("runs/job/horovod_timeline.json")   # every rank calls it
    ```

    Horovod's coordinator (rank 0) writes the file, with every rank's readiness for each
    collective. Needs `timeline_mode() == "dynamic"`; otherwise raises ValueError saying so.
    """
    if timeline_mode() != "dynamic":
        raise ValueError(
            f"start_timeline({path!r}): Horovod records a timeline on demand only when the job starts "
            f"with HOROVOD_TIMELINE=DYNAMIC (now {os.environ.get('HOROVOD_TIMELINE')!r}); set it in the "
            "environment or pass HorovodStrategy(horovod={'timeline': 'DYNAMIC'})")
    horovod().start_timeline(path, mark_cycles=False)


def stop_timeline():
    """Stop the timeline started by `start_timeline()` and close its file."""
    horovod().stop_timeline()


def xla_ops_available():
    """Whether this Horovod build has XLA kernels for its collectives.

    tfdist's Horovod build (`tfdist-install-horovod`) leaves out `xla_mpi_ops.cc` (it does not
    compile against TF 2.21), so `jit_compile=True` functions are compiled around the collectives
    (`tfdist.exchange.xla`).
    """
    hvd_dir = os.path.dirname(horovod().__file__)
    for lib in glob.glob(os.path.join(hvd_dir, "tensorflow", "mpi_lib*.so")):
        with open(lib, "rb") as f:
            if _XLA_MARKER in f.read():
                return True
    return False


def check_not_in_xla(what):
    """Raise `xla.CollectiveInXlaError` for a collective traced under XLA's must-compile rule on 2+ ranks."""
    if _compat.in_xla_context(tf.compat.v1.get_default_graph()) and size() > 1 and not xla_ops_available():
        raise xla.CollectiveInXlaError(
            f"{what} needs a Horovod collective inside an XLA-compiled function "
            "(jit_compile=True), and this Horovod build has no XLA ops (Horovod's xla_mpi_ops.cc "
            "covers CUDA allreduce only and does not compile against TensorFlow 2.21). tfdist "
            "compiles a jit_compile=True tf.function as XLA clusters around its collectives when "
            "the function is called after HorovodStrategy() was made, but not in this use "
            "(experimental_get_compiler_ir, a concrete function taken earlier, ...). Call the "
            "tf.function itself after making the strategy, or compile without XLA."
        )
