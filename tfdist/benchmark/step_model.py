"""`tfdist-predict`: step time and scaling efficiency at N ranks, from one measured rank and a link.

    tfdist-predict --compute_ms 198 --gradient_mb 102 --bandwidth_gbit 25 --latency_us 5 \\
        --ranks 2 8 16 32 64 --ranks_per_node 8 --batch_per_rank 32 --png scaling.png

The model (alpha-beta cost of a ring allreduce, minus what the bucket schedule hides):

- One rank's step is `compute_ms`; its backward pass is the last `backward_fraction` of it, and
  produces the gradients (`gradient_mb`) at an even rate, last layer first.
- Gradients go out in buckets of `bucket_mb` (0: one collective after the last gradient, as
  tfdist's one-collective mode). A bucket is ready when its last gradient is; the link sends one
  bucket at a time, so bucket i starts at max(ready_i, end of bucket i-1).
- A ring allreduce of m bytes over N ranks costs 2(N-1) alpha + 2(N-1)/N m / beta, alpha being
  the link latency and beta its bandwidth. With several ranks per node only the hops between
  nodes cross the network; those between ranks of one node use `intra_node_gbit` (default:
  shared memory/NVLink, 20x the link). A ring visits each node once, so with `ranks_per_node` = M
  there are N/M network hops per direction and N - N/M node-local ones: the slowest hop paces
  the ring, so the bandwidth term uses the network's beta whenever there is more than one node.
- Step time at N = max(compute, end of the last bucket) (+ nothing else: the optimizer update
  is inside `compute_ms`, as it is in the measured step). Efficiency = step(1) / step(N), the
  same per-rank batch (weak scaling); exposed communication = step(N) - compute.

It prints a table per rank count and writes a PNG plot (images/s against ranks, ideal line).

Sparse gradients (`--sparse_mb`: a rank's rows and ids a step, from embeddings; their tables stay
out of `--gradient_mb`) are not allreduced but gathered: every rank receives every other's. They
count as the allreduce that moves as much, N/2 times their bytes at N ranks (`gathered_bytes`), and
no compressor touches them.

Compression (`--compression none fp16 bf16 powersgd:4 topk:0.01`, one table row per method and rank
count): the gradient bytes become what the method puts on the wire for the model's gradient
shapes (`--model resnet50` or `--shapes 3072x2048 2048 ...`; `tfdist.exchange.compression_plan`), as
allreduce-equivalent bytes (top-k's allgather grows with the rank count), and its compute
(flops / `--compress_gflops`) is added to the step, unhidden.

Sharded optimizer state (`--exchange allreduce sharded`, `HorovodStrategy(shard_optimizer_state=True)`):
each bucket is a ring reduce-scatter when ready and a ring allgather once its slices are updated
(the two halves of the allreduce, in the link's order of readiness); each rank runs 1/N of the
optimizer update (`--update_ms`, its share of `--compute_ms`); the state MB column is the
optimizer state per rank (`--state_slots` copies of the gradient, 1/N of them plus the working
copy of the slice when sharded).

The exchange's CPU on CPU nodes (`--exchange_cpu_ms_per_mb X --cores_per_node C`): a rank spends X
CPU-ms a gradient MB copying and summing what it exchanges (X as measured on 2 ranks, where each
rank sends and receives its gradient's size; 2(N-1)/N of that at N ranks), on cores that are
computing, so its step grows by that CPU time over its C / ranks_per_node cores (the `cpu ms`
column). `scripts/benchmarks/ranks_per_node.py` measures X (ResNet50 on a 2-core Zen 4: 4.5 CPU-ms a MB).

Calibration: `--calibrate_one_collective_ms S --calibrate_ranks N` replaces the link's nominal
bandwidth by the one that makes the one-collective prediction at N ranks equal a measured step S
(`effective_bandwidth`). It folds in what the nominal rate leaves out (per-collective overhead,
protocol and copying costs, compute slowed by communication sharing its cores). On emulated
1 Gbit/s links it brought the bucketed predictions from 12-22% low to within 15%
(docs/benchmarks/records-2026-11-23-multihost.md).
"""

import argparse
import dataclasses
import heapq
import math
import sys

from tfdist.benchmark import argtypes
from tfdist.exchange import compression_plan
from tfdist.units import MB


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth_gbit: float
    latency_us: float
    intra_node_gbit: float = None

    def seconds(self, nbytes, ranks, ranks_per_node, phases=2):
        """One ring allreduce of `nbytes` over `ranks` ranks (`phases=1`: a ring reduce-scatter or
        allgather of the same tensor, half of it)."""
        if ranks <= 1:
            return 0.0
        nodes = math.ceil(ranks / max(ranks_per_node, 1))
        gbit = self.bandwidth_gbit if nodes > 1 else (self.intra_node_gbit or 20 * self.bandwidth_gbit)
        hops = phases * (ranks - 1)
        return hops * self.latency_us * 1e-6 + hops / ranks * nbytes * 8 / (gbit * 1e9)


@dataclasses.dataclass(frozen=True)
class Rank:
    compute_s: float
    gradient_bytes: float
    backward_fraction: float = 2 / 3


def bucket_schedule(rank, bucket_bytes):
    """(ready time, bytes) of each bucket, in the order backprop fills them."""
    if not bucket_bytes or bucket_bytes >= rank.gradient_bytes:
        return [(rank.compute_s, rank.gradient_bytes)]
    count = math.ceil(rank.gradient_bytes / bucket_bytes)
    backward = rank.compute_s * rank.backward_fraction
    start = rank.compute_s - backward
    buckets, sent = [], 0.0
    for i in range(count):
        size = min(bucket_bytes, rank.gradient_bytes - sent)
        sent += size
        buckets.append((start + backward * sent / rank.gradient_bytes, size))
    return buckets


def step_time(rank, link, ranks, ranks_per_node=1, bucket_bytes=0):
    """Predicted seconds per step at `ranks` ranks: (step, exposed communication, total communication)."""
    link_free, busy = 0.0, 0.0
    for ready, size in bucket_schedule(rank, bucket_bytes):
        cost = link.seconds(size, ranks, ranks_per_node)
        link_free = max(ready, link_free) + cost
        busy += cost
    step = max(rank.compute_s, link_free)
    return step, step - rank.compute_s, busy


def sharded_step_time(rank, link, ranks, ranks_per_node=1, bucket_bytes=0, update_s=0.0):
    """`step_time` for `shard_optimizer_state=True`: each bucket is reduce-scattered when ready and
    all-gathered once its slices are updated; the link sends one transfer at a time, oldest ready
    first. Each rank updates 1/N of the variables: `update_s` (the optimizer update's share of
    the one-rank step) shrinks to update_s / N."""
    if ranks <= 1:
        return step_time(rank, link, ranks, ranks_per_node, bucket_bytes)
    compute = rank.compute_s - update_s * (1 - 1 / ranks)
    pending = [(ready, 0, i, size) for i, (ready, size) in enumerate(bucket_schedule(rank, bucket_bytes))]
    link_free, busy, last = 0.0, 0.0, 0.0
    heapq.heapify(pending)
    while pending:
        ready, phase, i, size = heapq.heappop(pending)
        cost = link.seconds(size, ranks, ranks_per_node, phases=1)
        link_free = max(ready, link_free) + cost
        busy += cost
        if phase == 0:  # its allgather follows its update (1/N of the bucket's share of the update)
            update = update_s / ranks * size / rank.gradient_bytes
            heapq.heappush(pending, (link_free + update, 1, i, size))
        last = max(last, link_free)
    step = max(compute, last)
    return step, step - compute, busy


def state_bytes(rank, slots, ranks, sharded):
    """Optimizer state bytes per rank: `slots` copies of the gradient's size (Adam: 2), 1/N of
    it sharded (plus the working copy of this rank's slice of the weights)."""
    return rank.gradient_bytes * (slots + 1) / ranks if sharded and ranks > 1 else rank.gradient_bytes * slots


def effective_bandwidth(rank, link, measured_step_s, ranks, ranks_per_node=1):
    """Gbit/s at which one collective after backprop takes `measured_step_s` per step at `ranks`."""
    hops = 2 * (ranks - 1)
    transfer_s = measured_step_s - rank.compute_s - hops * link.latency_us * 1e-6
    if ranks < 2 or transfer_s <= 0:
        raise ValueError(f"a measured one-collective step of {measured_step_s * 1e3:.1f} ms at {ranks} ranks "
                         f"leaves no time for communication after {rank.compute_s * 1e3:.1f} ms of compute")
    return hops / ranks * rank.gradient_bytes * 8 / (transfer_s * 1e9)


def compressed(rank, shapes, spec, ranks, gflops):
    """`rank` as it runs with compression `spec` at `ranks`: its gradient bytes become the wire
    bytes for `shapes` (None: one flat tensor of the gradient's size), its compute grows by the
    compressor's flops at `gflops`. Returns (Rank, wire bytes, compress seconds)."""
    if spec == "none" or ranks < 2:
        return rank, rank.gradient_bytes, 0.0
    shapes = shapes or [[int(rank.gradient_bytes // 4)]]
    scale = rank.gradient_bytes / (4 * sum(_entries(s) for s in shapes))  # the shapes at the stated size
    wire, flops = compression_plan.wire_bytes(shapes, spec, ranks)
    extra = flops * scale / (gflops * 1e9)
    return dataclasses.replace(rank, compute_s=rank.compute_s + extra, gradient_bytes=wire * scale), wire * scale, extra


def _entries(shape):
    return math.prod(shape) if shape else 1


def exchange_cpu_s(wire_bytes, ranks, cpu_ms_per_mb, cores_per_rank):
    """Seconds a rank's step grows by when its cores also copy and sum its exchange (see the docstring)."""
    if ranks <= 1 or not cpu_ms_per_mb:
        return 0.0
    return cpu_ms_per_mb * 1e-3 * wire_bytes / MB * 2 * (ranks - 1) / ranks / cores_per_rank


def gathered_bytes(sparse_bytes, ranks):
    """The allreduce bytes that move as much as gathering a rank's `sparse_bytes` (sparse gradient
    rows and ids; Horovod and tfdist sum a `tf.IndexedSlices` so) on every one of `ranks` ranks:
    each rank's m bytes reach N - 1 others, which is what a ring allreduce of N m / 2 bytes moves."""
    return sparse_bytes * ranks / 2


def with_sparse(rank, sparse_bytes, ranks):
    """`rank` whose gradient bytes also carry a rank's `sparse_bytes`, gathered (`gathered_bytes`)."""
    return dataclasses.replace(rank, gradient_bytes=rank.gradient_bytes + gathered_bytes(sparse_bytes, ranks))


def table(rank, link, ranks_list, ranks_per_node, bucket_bytes, batch_per_rank, compression="none", shapes=None,
          gflops=20.0, sharded=False, update_s=0.0, slots=2, cpu_ms_per_mb=0.0, cores_per_node=None, sparse_bytes=0.0):
    rows = []
    for n in ranks_list:
        this, wire, extra = compressed(rank, shapes, compression, n, gflops)
        this = with_sparse(this, sparse_bytes, n)  # gathered as they are: compressors leave them alone
        wire += gathered_bytes(sparse_bytes, n)
        cpu = exchange_cpu_s(wire, n, cpu_ms_per_mb, (cores_per_node or 1) / min(ranks_per_node, n))
        this = dataclasses.replace(this, compute_s=this.compute_s + cpu)
        if sharded:
            step, exposed, busy = sharded_step_time(this, link, n, min(ranks_per_node, n), bucket_bytes, update_s)
        else:
            step, exposed, busy = step_time(this, link, n, min(ranks_per_node, n), bucket_bytes)
        rows.append({"ranks": n, "step_ms": step * 1e3, "exposed_ms": exposed * 1e3,
                     "comm_ms": busy * 1e3, "efficiency": rank.compute_s / step, "wire_mb": wire / MB,
                     "compress_ms": extra * 1e3, "cpu_ms": cpu * 1e3,
                     "state_mb": state_bytes(rank, slots, n, sharded) / MB,
                     "images_per_sec": n * batch_per_rank / step if batch_per_rank else None})
    return rows


def model_shapes(name):
    """The trainable variables' shapes of a tfdist-benchmark model (imports TensorFlow)."""
    from tfdist.benchmark.models import build_model
    from tfdist.keras.flavour import keras_module

    model = build_model(keras_module(), name, 224 if not name.startswith("mlp") else 32, 1000)
    return [list(v.shape) for v in model.trainable_variables]


def _shape(text):
    try:
        shape = [int(d) for d in text.lower().split("x")]
    except ValueError:
        shape = []
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a shape like 3072x2048 or 2048")
    return shape


def _spec(text):
    try:
        compression_plan.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tfdist-predict", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--compute_ms", type=argtypes.positive_float, required=True,
                        help="one rank's measured step (ms)")
    parser.add_argument("--gradient_mb", type=argtypes.positive_float, required=True,
                        help="gradient bytes per step, in MB (2**20 bytes)")
    parser.add_argument("--sparse_mb", type=argtypes.nonnegative_float, default=0.0,
                        help="a rank's sparse gradient rows and ids per step (embeddings), in MB, which every "
                             "rank gathers: count the tables' rows here, not in --gradient_mb")
    parser.add_argument("--backward_fraction", type=float, default=2 / 3)
    parser.add_argument("--bucket_mb", type=argtypes.nonnegative_float, default=25,
                        help="0: one collective after backprop")
    parser.add_argument("--bandwidth_gbit", type=argtypes.positive_float,
                        help="the link's rate (or calibrate it, below)")
    parser.add_argument("--calibrate_one_collective_ms", type=argtypes.positive_float,
                        help="a measured step (ms) with one collective after backprop: sets the effective bandwidth")
    parser.add_argument("--calibrate_ranks", type=argtypes.positive_int, default=2, help="ranks of that measured step")
    parser.add_argument("--latency_us", type=argtypes.nonnegative_float, default=5)
    parser.add_argument("--intra_node_gbit", type=argtypes.positive_float,
                        help="between ranks of one node (default 20x the link)")
    parser.add_argument("--ranks", type=argtypes.positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--ranks_per_node", type=argtypes.positive_int, default=1)
    parser.add_argument("--batch_per_rank", type=argtypes.positive_int, help="for images/s")
    parser.add_argument("--png", help="write a plot of images/s (or efficiency) against ranks here")
    parser.add_argument("--compression", type=_spec, nargs="+", default=["none"],
                        help="methods to model: none, fp16, bf16, powersgd[:rank], topk[:density]")
    parser.add_argument("--shapes", type=_shape, nargs="+", help="gradient shapes, e.g. 3072x2048 2048")
    parser.add_argument("--model", help="take the gradient shapes from this tfdist-benchmark model (resnet50, mlp:wide_mlp)")
    parser.add_argument("--compress_gflops", type=argtypes.positive_float, default=20.0,
                        help="the rate a rank runs a compressor's arithmetic at (default 20)")
    parser.add_argument("--exchange", nargs="+", choices=("allreduce", "sharded"), default=["allreduce"],
                        help="sharded: shard_optimizer_state=True (reduce-scatter, update 1/N, allgather)")
    parser.add_argument("--update_ms", type=argtypes.nonnegative_float, default=0.0,
                        help="the optimizer update's share of --compute_ms (sharded: each rank does 1/N)")
    parser.add_argument("--state_slots", type=argtypes.nonnegative_float, default=2,
                        help="optimizer slots per weight, for the state MB column (Adam 2, momentum 1)")
    parser.add_argument("--exchange_cpu_ms_per_mb", type=argtypes.nonnegative_float, default=0.0,
                        help="CPU nodes: a rank's CPU-ms per gradient MB for copying and summing its exchange "
                             "(measured on 2 ranks by scripts/benchmarks/ranks_per_node.py); needs --cores_per_node")
    parser.add_argument("--cores_per_node", type=argtypes.positive_int,
                        help="cores a node's ranks share (with --exchange_cpu_ms_per_mb)")
    args = parser.parse_args(argv)
    if args.exchange_cpu_ms_per_mb and not args.cores_per_node:
        parser.error("--exchange_cpu_ms_per_mb needs --cores_per_node (the ranks of a node share its cores)")
    if not 0 < args.backward_fraction <= 1:
        parser.error(f"--backward_fraction {args.backward_fraction}: expected a fraction in (0, 1]")
    rank = Rank(args.compute_ms / 1e3, args.gradient_mb * MB, args.backward_fraction)
    if args.calibrate_one_collective_ms:
        try:
            args.bandwidth_gbit = effective_bandwidth(
                rank, Link(1.0, args.latency_us), args.calibrate_one_collective_ms / 1e3, args.calibrate_ranks,
                min(args.ranks_per_node, args.calibrate_ranks))
        except ValueError as e:
            parser.error(f"--calibrate_one_collective_ms: {e}")
        print(f"calibrated: {args.bandwidth_gbit:.3f} Gbit/s effective, from a one-collective step of "
              f"{args.calibrate_one_collective_ms:g} ms at {args.calibrate_ranks} ranks")
    elif args.bandwidth_gbit is None:
        parser.error("give --bandwidth_gbit, or --calibrate_one_collective_ms to derive it")
    shapes = model_shapes(args.model) if args.model else args.shapes
    if any(compression_plan.parse(c)[0] == "powersgd" for c in args.compression) and not shapes:
        parser.error("--compression powersgd needs the gradient shapes: give --model or --shapes")
    link = Link(args.bandwidth_gbit, args.latency_us, args.intra_node_gbit)
    modes = {"one collective": 0, f"buckets of {args.bucket_mb:g} MB": args.bucket_mb * MB} if args.bucket_mb else {
        "one collective": 0}
    if "sharded" in args.exchange and any(compression_plan.parse(c)[0] in ("powersgd", "topk") for c in args.compression):
        parser.error("--exchange sharded reduce-scatters the summed gradient: combine it with none or fp16 only")
    if args.update_ms >= args.compute_ms:
        parser.error(f"--update_ms {args.update_ms:g}: expected less than --compute_ms")
    results = {}
    for exchange in args.exchange:
        for method in args.compression:
            for name, size in modes.items():
                label = (name if method == "none" else f"{name}, {method}") + (", sharded" if exchange == "sharded" else "")
                results[label] = table(rank, link, args.ranks, args.ranks_per_node, size, args.batch_per_rank,
                                       method, shapes, args.compress_gflops, exchange == "sharded",
                                       args.update_ms / 1e3, args.state_slots, args.exchange_cpu_ms_per_mb,
                                       args.cores_per_node, args.sparse_mb * MB)
    sparse = f" + {args.sparse_mb:g} MB sparse rows, gathered" if args.sparse_mb else ""
    print(f"{args.compute_ms:g} ms compute, {args.gradient_mb:g} MB gradients{sparse}, {args.bandwidth_gbit:g} Gbit/s, "
          f"{args.latency_us:g} us, {args.ranks_per_node} rank(s) per node")
    print("| schedule | ranks | step ms | exposed comm ms | comm ms | efficiency | images/s | wire MB | "
          "compress ms | cpu ms | state MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        for r in rows:
            images = f"{r['images_per_sec']:.1f}" if r["images_per_sec"] else "-"
            print(f"| {name} | {r['ranks']} | {r['step_ms']:.1f} | {r['exposed_ms']:.1f} | {r['comm_ms']:.1f} | "
                  f"{r['efficiency']:.1%} | {images} | {r['wire_mb']:.2f} | {r['compress_ms']:.1f} | "
                  f"{r['cpu_ms']:.1f} | {r['state_mb']:.1f} |")
    if args.png:
        plot(results, args)
    return 0


def plot(results, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    per_image = bool(args.batch_per_rank)
    for name, rows in results.items():
        ax.plot([r["ranks"] for r in rows], [r["images_per_sec"] if per_image else r["efficiency"] for r in rows],
                marker="o", label=name)
    if per_image:
        ideal = [n * args.batch_per_rank / (args.compute_ms / 1e3) for n in args.ranks]
        ax.plot(args.ranks, ideal, linestyle="--", color="grey", label="linear")
    ax.set_xlabel("ranks")
    ax.set_ylabel("images/s" if per_image else "efficiency")
    ax.set_title(f"{args.bandwidth_gbit:g} Gbit/s, {args.latency_us:g} us, {args.ranks_per_node} per node", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)
    print(f"plot: {args.png}")


if __name__ == "__main__":
    sys.exit(main())
