"""Build a rank's tf.data pipeline from a manifest: shard, shuffle, interleave, parse, batch, prefetch.

```python
from pipelines import read_dataset
ds, plan = read_dataset("/scratch/digits/train", batch_size=32, input_context=ctx, training=True)
model.fit(ds, steps_per_epoch=plan.steps_per_epoch)
```

Every record is read exactly once per pass over all pipelines. When the shard count divides by
the number of input pipelines, each pipeline reads whole shards (`mode="file"`); otherwise each
reads one contiguous range of the global record sequence (`mode="range"`, at most two partial
shards per pipeline), so no record is lost or doubled.
"""

import dataclasses
import logging
import os

import tensorflow as tf

from pipelines import manifest as manifest_lib

log = logging.getLogger("tfdist.pipelines")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """What one input pipeline reads: (file, first record, record count) segments."""

    mode: str
    segments: tuple
    records: int
    steps_per_epoch: int = 0
    skipped: object = None  # SkippedRecords in skip_corrupt mode


def plan_shards(manifest, num_pipelines, pipeline_id, batch_size=1, drop_remainder=True):
    """Assign records to pipeline `pipeline_id` of `num_pipelines`; every record to exactly one."""
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


def parser_for(manifest):
    """A function parsing one serialized record into a dict of tensors, per the manifest's spec."""
    spec = {}
    for name, f in manifest.features.items():
        kind = {"int64": tf.int64, "float": tf.float32}.get(f.encoding, tf.string)
        spec[name] = tf.io.FixedLenFeature([], kind)

    def parse(record):
        parsed = tf.io.parse_single_example(record, spec)
        out = {}
        for name, f in manifest.features.items():
            value = parsed[name]
            if f.encoding == "raw":
                value = tf.reshape(tf.io.decode_raw(value, tf.dtypes.as_dtype(f.dtype)), f.shape)
            elif f.encoding in ("int64", "float"):
                value = tf.cast(value, tf.dtypes.as_dtype(f.dtype))
            out[name] = value
        return out

    return parse


class SkippedRecords:
    """Per-shard counts of records dropped in `skip_corrupt` mode (unreadable or unparsable).

    `read_dataset(..., skip_corrupt=True)` returns one in its plan; `report()` lists the counts
    since the last `reset()`, and `callbacks.SkippedRecordsReport` logs them every epoch.
    """

    def __init__(self, segments):
        self.files = [path for path, _, _ in segments]
        with tf.init_scope():
            # ON_READ: replica-local state, never broadcast or synced by a strategy.
            self.counts = tf.Variable(
                tf.zeros([len(self.files)], tf.int64), trainable=False, name="skipped_records",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
            )

    def add(self, segment, count):
        return self.counts.scatter_add(tf.IndexedSlices(tf.reshape(count, [1]), tf.reshape(segment, [1])))

    def report(self):
        counts = self.counts.numpy()
        totals = {}
        for path, n in zip(self.files, counts):
            if n:
                totals[path] = totals.get(path, 0) + int(n)
        return totals

    def reset(self):
        self.counts.assign(tf.zeros_like(self.counts))


def _checked_records(segment, path, start, count, parse, skipped):
    """Records [start, start+count) of one shard, parsed; a record that cannot be read or parsed
    raises an error naming the shard and record (or, with `skipped`, is counted and dropped).

    TFRecord reading stops at a corrupt record and parse errors drop the record, so each
    failure shows up as a gap in the record indices; a sentinel after the last record checks
    the tail.
    """
    def parse_indexed(index, record):
        return index, parse(record)

    records = tf.data.TFRecordDataset(path).skip(start).take(count).enumerate(start)
    parsed = records.map(parse_indexed).ignore_errors()
    sentinel = tf.data.Dataset.from_tensors(start + count).map(
        lambda i: (i, tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype), parsed.element_spec[1]))
    )

    def track(expected, element):
        index, example = element
        return index + 1, (index, expected, example)

    def keep(index, expected, example):
        gap = index - expected
        if skipped is not None:
            with tf.control_dependencies([skipped.add(segment, tf.maximum(gap, 0))]):
                return index < start + count
        message = tf.strings.format(
            "shard {}: record {} could not be read or parsed (corrupt or truncated file, or a "
            "feature missing or not matching the manifest); pipelines.explain_record names the "
            "feature; read with skip_corrupt=True to skip and count such records",
            (path, expected),
        )
        with tf.control_dependencies([tf.debugging.Assert(gap <= 0, [message], summarize=1)]):
            return index < start + count

    stream = parsed.concatenate(sentinel).scan(tf.cast(start, tf.int64), track).filter(keep)
    return stream.map(lambda index, expected, example: example)


def explain_record(source, path, index):
    """Why record `index` of shard file `path` fails: names the feature (or the read error)."""
    manifest = manifest_lib.load(source) if not isinstance(source, manifest_lib.Manifest) else source
    try:
        record = next(iter(tf.data.TFRecordDataset(path).skip(index).take(1)), None)
    except tf.errors.DataLossError as e:
        return f"shard {path}: record {index} is unreadable: {e.message}"
    if record is None:
        return f"shard {path}: record {index} does not exist (the file is truncated)"
    for name, feature in manifest.features.items():
        single = manifest_lib.Manifest(manifest.directory, {name: feature}, manifest.shards)
        try:
            parser_for(single)(record)
        except (tf.errors.InvalidArgumentError, ValueError) as e:
            return f"shard {path}: record {index}: feature {name!r} ({feature.to_json()}): {e}".strip()
    return f"shard {path}: record {index} parses fine"


def read_dataset(source, batch_size, *, input_context=None, training=True, map_fn=None,
                 shuffle_buffer=10_000, seed=0, cache=None, interleave_cycle=None,
                 deterministic=None, private_threads=None, ram_budget_mb=None, prefetch=True,
                 skip_corrupt=False):
    """The tf.data pipeline of one input pipeline (rank) and its `ShardPlan`.

    Args:
        source: dataset directory (with manifest.json), manifest file, a `Manifest`, or a glob
            pattern of TFRecord files without a manifest (records are counted first).
        batch_size: per-pipeline (per-rank) batch.
        input_context: a `tf.distribute.InputContext` (from `distribute_datasets_from_function`);
            default: one pipeline.
        training: shuffle files and records (seeded, different every epoch), repeat with
            `plan.steps_per_epoch` batches per epoch, drop the last partial batch. False:
            evaluation order, one pass, nothing dropped.
        map_fn: applied to each parsed example dict (decode/augment), in parallel.
        cache: None, "memory", or a file path prefix; caches parsed (and `map_fn`'d) examples
            before shuffling, so put augmentation in a later `.map` if it must differ per epoch.
        skip_corrupt: drop records that cannot be read or parsed instead of failing, and count
            them per shard in `plan.skipped` (see `callbacks.SkippedRecordsReport`).
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
    skipped = SkippedRecords(plan.segments) if skip_corrupt else None
    plan = dataclasses.replace(plan, skipped=skipped)
    log.info("pipeline %d/%d reads %d records from %d segment(s), mode=%s",
             pipeline_id, pipelines, plan.records, len(plan.segments), plan.mode)

    parse = parser_for(manifest)
    segments = tf.data.Dataset.from_tensor_slices((
        tf.range(len(plan.segments), dtype=tf.int64),
        tf.constant([s[0] for s in plan.segments]),
        tf.constant([s[1] for s in plan.segments], tf.int64),
        tf.constant([s[2] for s in plan.segments], tf.int64),
    ))
    if training and len(plan.segments) > 1:
        segments = segments.shuffle(len(plan.segments), seed=seed, reshuffle_each_iteration=True)
    cycle = interleave_cycle or min(len(plan.segments), 8)
    ds = segments.interleave(
        lambda i, path, start, count: _checked_records(i, path, start, count, parse, skipped),
        cycle_length=max(cycle, 1), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=not training if deterministic is None else deterministic,
    )
    if map_fn is not None and cache is not None:
        ds = ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
    if cache is not None:
        ds = ds.cache("" if cache == "memory" else cache)
    if training:
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if map_fn is not None and cache is None:
        ds = ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size, drop_remainder=training)
    if training:
        ds = ds.take(plan.steps_per_epoch).repeat()  # same step count on every rank, every epoch
    if prefetch:
        ds = ds.prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    if deterministic is not None:
        options.deterministic = deterministic
    if private_threads:
        options.threading.private_threadpool_size = private_threads
    if ram_budget_mb:
        options.autotune.ram_budget = int(ram_budget_mb) << 20
    return ds.with_options(options), plan


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
