"""Build a rank's tf.data pipeline from a manifest: shard, shuffle, interleave, parse, batch, prefetch.

```python
from tfdist.pipelines import read_dataset
ds, plan = read_dataset("/scratch/digits/train", batch_size=32, input_context=ctx, training=True)
model.fit(ds, steps_per_epoch=plan.steps_per_epoch)
```

Every record is read exactly once per pass over all pipelines. When the shard count divides by
the number of input pipelines, each pipeline reads whole shards (`mode="file"`); otherwise each
reads one contiguous range of the global record sequence (`mode="range"`, at most two partial
shards per pipeline), so no record is lost or doubled. With `skip_corrupt=True` in training, a
counting pass before training finds the records that can be read, and the epochs are planned
from those (see `read_dataset`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

import tensorflow as tf

from tfdist.pipelines import manifest as manifest_lib
from tfdist.pipelines.records import (  # noqa: F401  (parser_for, explain_record: public here too)
    SkippedRecords, block_parser_for, checked_records, count_bad_records, explain_record, parser_for,
)

if TYPE_CHECKING:
    from tfdist.pipelines.manifest import Manifest

log = logging.getLogger("tfdist.pipelines")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """What one input pipeline reads: (file, first record, record count) segments.

    Args:
        mode: "file" (whole shards: the shard count divides by the pipeline count) or "range"
            (a contiguous range of the global record sequence).
        segments: (shard path, first record, record count) per segment, in reading order.
        records: the records in all segments.
        steps_per_epoch: training steps per epoch, the same on every pipeline.
        skipped: with `skip_corrupt`, the per-shard counts of dropped records; else None.
        good_records: with `skip_corrupt` in training, this pipeline's readable records; else None.
    """

    mode: str
    segments: tuple[tuple[str, int, int], ...]
    records: int
    steps_per_epoch: int = 0
    skipped: SkippedRecords | None = None  # SkippedRecords in skip_corrupt mode
    good_records: int | None = None  # skip_corrupt in training: this pipeline's readable records


def plan_shards(manifest: Manifest, num_pipelines: int, pipeline_id: int, batch_size: int = 1,
                drop_remainder: bool = True) -> ShardPlan:
    """Assign records to pipeline `pipeline_id` of `num_pipelines`; every record to exactly one.

    Args:
        manifest: the dataset.
        num_pipelines: how many input pipelines share the dataset.
        pipeline_id: this pipeline, 0 to `num_pipelines - 1`.
        batch_size: the per-pipeline batch, for `steps_per_epoch`.
        drop_remainder: count only full batches in `steps_per_epoch` (else a last partial one too).

    Returns:
        This pipeline's plan; `steps_per_epoch` comes from the smallest pipeline's share.

    Raises:
        ValueError: `pipeline_id` is out of range.
    """
    if not 0 <= pipeline_id < num_pipelines:
        raise ValueError(f"pipeline_id {pipeline_id} out of range for {num_pipelines} pipelines")
    shards = manifest.shards
    if len(shards) % num_pipelines == 0:
        mode = "file"
        mine = [(manifest.path(s), 0, s.records) for s in shards[pipeline_id::num_pipelines]]
        per_pipeline = [sum(s.records for s in shards[p::num_pipelines]) for p in range(num_pipelines)]
    else:
        mode = "range"
        total = manifest.records
        bounds = [total * p // num_pipelines for p in range(num_pipelines + 1)]
        per_pipeline = [bounds[p + 1] - bounds[p] for p in range(num_pipelines)]
        start, stop, offset, mine = bounds[pipeline_id], bounds[pipeline_id + 1], 0, []
        for s in shards:
            lo, hi = max(start, offset), min(stop, offset + s.records)
            if lo < hi:
                mine.append((manifest.path(s), lo - offset, hi - lo))
            offset += s.records
    # Training steps must match on every rank (each step is a collective): use the smallest.
    fewest = min(per_pipeline)
    steps = fewest // batch_size if drop_remainder else -(-fewest // batch_size)
    return ShardPlan(mode, tuple(mine), sum(n for _, _, n in mine), steps)


def read_dataset(source: str | os.PathLike[str] | Manifest, batch_size: int, *,
                 input_context: tf.distribute.InputContext | None = None, training: bool = True,
                 map_fn: Callable[[dict[str, tf.Tensor]], Any] | None = None,
                 augment_fn: Callable[..., Any] | None = None, shuffle_buffer: int = 10_000,
                 seed: int | None = 0, cache: str | None = None, interleave_cycle: int | None = None,
                 deterministic: bool | None = None, private_threads: int | None = None,
                 ram_budget_mb: float | None = None, prefetch: bool = True, skip_corrupt: bool = False,
                 initial_epoch: int = 0) -> tuple[tf.data.Dataset, ShardPlan]:
    """The tf.data pipeline of one input pipeline (rank) and its `ShardPlan`.

    Args:
        source: dataset directory (with manifest.json), manifest file, a `Manifest`, or a glob
            pattern of TFRecord files without a manifest (records are counted first).
        batch_size: per-pipeline batch: per rank with `input_context`, else the global batch.
        input_context: a `tf.distribute.InputContext` (from `distribute_datasets_from_function`):
            this rank's records only, batched per rank; `HorovodStrategy` never splits or
            shards such a dataset again. Default: one pipeline over every record, with
            `auto_shard_policy=DATA`, so a strategy's `experimental_distribute_dataset` (or
            `fit`) splits each global batch across ranks and every record is still read once.
        training: shuffle files and records (seeded, different every epoch), repeat with
            `plan.steps_per_epoch` batches per epoch, drop the last partial batch. False:
            evaluation order, one pass, nothing dropped. Each step is a collective, so the
            step count is the same on every pipeline: the smallest share decides it. A pipeline
            with more records uses a shuffled `steps_per_epoch * batch_size` of them each epoch
            (a different subset every epoch); nothing is read twice within an epoch.
        map_fn: applied to each parsed example (a dict: feature name -> tensor; deterministic
            work: decode, cast), in parallel, before the cache.
        augment_fn: applied after the cache and the shuffle (random per-epoch work: crops,
            flips; also the place for decoding large images, so the shuffle buffer holds
            small encoded records), in parallel.
        shuffle_buffer: records in the shuffle buffer (training).
        seed: epoch e shuffles with a seed derived from (seed, e), so its order does not depend
            on how many epochs this process ran before, whatever `tf.random.set_seed` says
            (see `initial_epoch`). None: unseeded, a new order every run.
        cache: None, "memory", or a file path prefix: caches parsed (and `map_fn`'d) examples.
        interleave_cycle: segments read in parallel; default: as many as there are, at most 8.
        deterministic: keep the order of parallel reads and maps (`tf.data.Options`); default:
            deterministic reads in evaluation only, tf.data's default elsewhere.
        private_threads: size of a thread pool of this pipeline's own; default: tf.data's shared one.
        ram_budget_mb: tf.data autotuning's RAM budget, in MB; default: tf.data's.
        prefetch: end the pipeline with `prefetch(tf.data.AUTOTUNE)`.
        skip_corrupt: drop records that cannot be read or parsed instead of failing, and count
            them per shard in `plan.skipped` (see `callbacks.SkippedRecordsReport`). In training,
            a counting pass over this pipeline's part runs first (it reads the part once), so
            `plan.steps_per_epoch` counts readable records only, known when this returns, and
            every epoch holds each readable record at most once (exactly once when the shares
            are equal and divide by the batch). The pipelines agree on the smallest share: with
            Horovod running one rank per pipeline they exchange their counts (a collective:
            every rank must call `read_dataset` alike); otherwise this process counts every
            pipeline's share itself. `plan.good_records` is this pipeline's readable count, and
            `plan.skipped` reports the records each epoch drops (the same every epoch).
        initial_epoch: the number of the first epoch, which picks its shuffle: a run resumed
            with `initial_epoch=e` (e.g. `callbacks.Checkpointer(...).initial_epoch()`) reads what
            an uninterrupted run reads in epoch e (exactly, with `deterministic=True`).

    Returns:
        `(dataset, plan)`: batches of parsed examples (dicts: feature name -> tensor; or what
            `map_fn` / `augment_fn` return), and this pipeline's `ShardPlan`.

    Raises:
        ManifestError: the manifest is missing or malformed, or a shard's size differs from it.
        FileNotFoundError: a shard file is missing, or no file matches a glob `source`.

    Example:
        ```python
        from tfdist.pipelines import read_dataset
        ds, plan = read_dataset("/scratch/digits/train", batch_size=32, training=True)
        model.fit(ds, epochs=3, steps_per_epoch=plan.steps_per_epoch)
        ```
    """
    if isinstance(source, manifest_lib.Manifest):
        manifest = source
    elif any(ch in str(source) for ch in "*?["):
        manifest = manifest_lib.from_files(source)
    else:
        manifest = manifest_lib.load(str(source))
    pipelines = input_context.num_input_pipelines if input_context else 1
    pipeline_id = input_context.input_pipeline_id if input_context else 0
    plan = plan_shards(manifest, pipelines, pipeline_id, batch_size, drop_remainder=training)
    _check_files(manifest, plan)
    log.info("pipeline %d/%d reads %d records from %d segment(s), mode=%s",
             pipeline_id, pipelines, plan.records, len(plan.segments), plan.mode)
    parse_block = block_parser_for(manifest)
    feature_names = list(manifest.features)
    cycle = interleave_cycle or min(len(plan.segments), 8)
    who, expected_bad = _who(), None
    if skip_corrupt and training:
        plan = _plan_readable(manifest, plan, pipelines, pipeline_id, batch_size, parse_block, cycle, who)
        expected_bad = tf.constant(plan.skipped.per_epoch or [0], tf.int64)
    elif skip_corrupt:
        plan = dataclasses.replace(plan, skipped=SkippedRecords(plan.segments))
    skipped = plan.skipped
    segments = tf.data.Dataset.from_tensor_slices((
        tf.range(len(plan.segments), dtype=tf.int64),
        tf.constant([s[0] for s in plan.segments]),
        tf.constant([s[1] for s in plan.segments], tf.int64),
        tf.constant([s[2] for s in plan.segments], tf.int64),
    ))

    def records(segments):
        ds = segments.interleave(
            lambda i, path, start, count: checked_records(
                i, path, start, count, parse_block, feature_names, skipped, expected_bad, who),
            cycle_length=max(cycle, 1), num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=not training if deterministic is None else deterministic,
        )
        return ds if map_fn is None else ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)

    def batches(ds):
        if augment_fn is not None:
            ds = ds.map(augment_fn, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(batch_size, drop_remainder=training)

    if not training:
        ds = records(segments)
        ds = batches(ds if cache is None else ds.cache("" if cache == "memory" else cache))
    else:
        cached = None if cache is None else records(segments).cache("" if cache == "memory" else cache)

        def one_epoch(epoch):
            if cached is not None:  # file order was fixed when the cache filled
                ds = cached
            elif len(plan.segments) > 1:
                ds = records(_shuffle_for_epoch(segments, len(plan.segments), seed, epoch))
            else:
                ds = records(segments)
            # same step count on every rank, every epoch
            return _shuffle_for_epoch(ds, shuffle_buffer, seed, epoch).take(plan.steps_per_epoch * batch_size)

        # Epochs counted from initial_epoch, each shuffled by its own number (see `seed` above).
        # augment_fn stays outside the per-epoch part, so its random state runs on across epochs.
        epochs = tf.data.Dataset.counter(int(initial_epoch)) if plan.steps_per_epoch else tf.data.Dataset.range(0)
        ds = batches(epochs.flat_map(one_epoch))
    if prefetch:
        ds = ds.prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    if deterministic is not None:
        options.deterministic = deterministic
    if private_threads:
        options.threading.private_threadpool_size = private_threads
    if ram_budget_mb:
        options.autotune.ram_budget = int(ram_budget_mb) << 20
    if input_context is None:
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = ds.with_options(options)
    if input_context is not None:
        ds.tfdist_per_rank = True  # split already: tfdist.HorovodStrategy leaves it as it is
    ds.manifest_identity = manifest_identity(manifest)  # compared across ranks by tfdist.faults.consistency
    return ds, plan


def _plan_readable(manifest, plan, pipelines, pipeline_id, batch_size, parse_block, cycle, who):
    """`plan` with its steps per epoch from the readable records (skip_corrupt in training).

    Counts this pipeline's bad records in one pass, then takes the smallest readable share of
    all pipelines: from the other ranks (one Horovod rank per pipeline), or by counting the
    other shares here (no Horovod, or another pipeline count than ranks).
    """
    bad = count_bad_records(plan.segments, parse_block, cycle)
    good = plan.records - sum(bad)
    if pipelines == 1:
        goods = [good]
    elif _horovod_ranks()[1] == pipelines:
        from tfdist import collectives

        goods = collectives.allgather_object(good, name="tfdist.pipelines.readable")
    else:
        log.info("%scounting all %d pipelines' shares here (Horovod runs %d rank(s)), to agree on "
                 "the step count", who, pipelines, _horovod_ranks()[1])
        goods = []
        for p in range(pipelines):
            if p == pipeline_id:
                goods.append(good)
                continue
            other = plan_shards(manifest, pipelines, p)
            _check_files(manifest, other)
            goods.append(other.records - sum(count_bad_records(other.segments, parse_block, cycle)))
    steps = min(goods) // batch_size
    log.info("%s%d of %d records in this share are readable (%d skipped every epoch); "
             "steps_per_epoch=%d (batch %d, smallest readable share %d)",
             who, good, plan.records, sum(bad), steps, batch_size, min(goods))
    if steps == 0 and _horovod_ranks()[0] == 0:  # the same count on every rank: the chief says it
        log.warning("%sno training steps: the smallest readable share holds %d records, fewer than "
                    "one batch of %d", who, min(goods), batch_size)
    return dataclasses.replace(plan, steps_per_epoch=steps, good_records=good,
                               skipped=SkippedRecords(plan.segments, per_epoch=bad))


def _horovod_ranks():
    """(rank, size) of the running Horovod job; (0, 1) where Horovod is not imported or not started."""
    if "horovod.tensorflow" not in sys.modules:
        return 0, 1
    from tfdist import collectives

    return collectives.process_rank(), collectives.process_size()


def _who():
    """'rank R: ' in a multi-rank Horovod job (to start messages with), else ''."""
    rank, size = _horovod_ranks()
    return f"rank {rank}: " if size > 1 else ""


def manifest_identity(manifest: Manifest) -> tuple[str, str]:
    """(sha256 of the manifest's contents, description): equal iff two ranks read the same dataset.

    Args:
        manifest: the dataset.

    Returns:
        The hex digest and a one-line description naming the directory, records and shards.
    """
    digest = hashlib.sha256(json.dumps(manifest.to_json(), sort_keys=True).encode()).hexdigest()
    return digest, (f"{manifest.directory} ({manifest.records} records, {len(manifest.shards)} shards, "
                    f"manifest sha256 {digest[:12]})")


_GRAPH_SEED = 1_234_567


def _shuffle_for_epoch(ds, buffer_size, seed, epoch):
    """`ds.shuffle` seeded by (seed, epoch) only (seed None: unseeded, a new order every run)."""
    if seed is None:
        return ds.shuffle(buffer_size)
    epoch_seed = tf.constant(int(seed), tf.int64) * 1_000_003 + tf.cast(epoch, tf.int64)
    # tf.data pairs an op seed with the graph's seed, i.e. the user's tf.random.set_seed, and
    # fails on a tensor op seed when that is 0: pin the graph seed while the op is made.
    graph = tf.compat.v1.get_default_graph()
    saved, graph.seed = graph.seed, _GRAPH_SEED
    try:
        return ds.shuffle(buffer_size, seed=epoch_seed)
    finally:
        graph.seed = saved


def _check_files(manifest, plan):
    """Missing or truncated shard files fail here, by name, before any reading starts."""
    by_path = {manifest.path(s): s for s in manifest.shards}
    for path, _, _ in plan.segments:
        if not os.path.exists(path):
            raise FileNotFoundError(f"dataset {manifest.directory}: shard file missing: {path}")
        size = os.path.getsize(path)
        if size != by_path[path].bytes:
            raise manifest_lib.ManifestError(
                f"shard {path} has {size} bytes but the manifest says {by_path[path].bytes} "
                "(truncated or rewritten since the manifest was made)"
            )
