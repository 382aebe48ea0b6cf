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


def _segment_dataset(segments):
    """A dataset of segments, each read as a TFRecordDataset with skip/take."""
    files = tf.constant([s[0] for s in segments])
    starts = tf.constant([s[1] for s in segments], tf.int64)
    counts = tf.constant([s[2] for s in segments], tf.int64)
    return tf.data.Dataset.from_tensor_slices((files, starts, counts))


def read_dataset(source, batch_size, *, input_context=None, training=True, map_fn=None,
                 shuffle_buffer=10_000, seed=0, cache=None, interleave_cycle=None,
                 deterministic=None, private_threads=None, ram_budget_mb=None, prefetch=True):
    """The tf.data pipeline of one input pipeline (rank) and its `ShardPlan`.

    Args:
        source: dataset directory (with manifest.json) or manifest file.
        batch_size: per-pipeline (per-rank) batch.
        input_context: a `tf.distribute.InputContext` (from `distribute_datasets_from_function`);
            default: one pipeline.
        training: shuffle files and records (seeded, different every epoch), repeatable across
            epochs, drop the last partial batch. False: evaluation order, nothing dropped.
        map_fn: applied to each parsed example dict (decode/augment), in parallel.
        cache: None, "memory", or a file path prefix; caches parsed (and `map_fn`'d) examples
            before shuffling, so put augmentation in a later `.map` if it must differ per epoch.
    """
    manifest = manifest_lib.load(source)
    pipelines = input_context.num_input_pipelines if input_context else 1
    pipeline_id = input_context.input_pipeline_id if input_context else 0
    plan = plan_shards(manifest, pipelines, pipeline_id, batch_size, drop_remainder=training)
    missing = [path for path, _, _ in plan.segments if not os.path.exists(path)]
    if missing:
        raise FileNotFoundError(f"dataset {manifest.directory}: shard file(s) missing: {missing}")
    log.info("pipeline %d/%d reads %d records from %d segment(s), mode=%s",
             pipeline_id, pipelines, plan.records, len(plan.segments), plan.mode)

    segments = _segment_dataset(plan.segments)
    if training and len(plan.segments) > 1:
        segments = segments.shuffle(len(plan.segments), seed=seed, reshuffle_each_iteration=True)
    cycle = interleave_cycle or min(len(plan.segments), 8)
    records = segments.interleave(
        lambda f, start, count: tf.data.TFRecordDataset(f).skip(start).take(count),
        cycle_length=max(cycle, 1), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=not training if deterministic is None else deterministic,
    )
    parse = parser_for(manifest)
    ds = records.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
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
