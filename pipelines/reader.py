"""Build a rank's tf.data pipeline from a manifest: shard, shuffle, interleave, parse, batch, prefetch.

```python
from tfdist.pipelines import read_dataset
ds, plan = read_dataset("/scratch/digits/train", batch_size=32, input_context=ctx, training=True)
model.fit(ds, steps_per_epoch=plan.steps_per_epoch)
```

Every record is read exactly once per pass over all pipelines. When the shard count divides by
the number of input pipelines, each pipeline reads whole shards (`mode="file"`); otherwise each
reads one contiguous range of the global record sequence (`mode="range"`, at most two partial
shards per pipeline), so no record is lost or doubled.
"""

import dataclasses
import hashlib
import json
import logging
import os

import numpy as np
import tensorflow as tf

from tfdist.pipelines import manifest as manifest_lib

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


PARSE_BLOCK = 64  # records parsed together: vectorised parsing, per-record error checks


def block_parser_for(manifest):
    """Parse a block of serialized records without failing on a bad record.

    Returns `parse_block(records) -> (problems [n, features] bool, examples dict of [n, ...])`:
    a record with a feature missing, repeated, or of the wrong byte size gets zeros and a
    problem flag instead of an error. (A feature stored with another proto type, e.g. an int64
    list where the manifest says bytes, still fails the whole block; the caller handles that.)
    """
    features = list(manifest.features.items())
    spec = {}
    for name, f in features:
        spec[name] = tf.io.RaggedFeature({"int64": tf.int64, "float": tf.float32}.get(f.encoding, tf.string))

    def parse_block(records):
        parsed = tf.io.parse_example(records, spec)
        n = tf.shape(records)[0]
        problems, out = [], {}
        for name, f in features:
            values = parsed[name]
            ok = tf.equal(values.row_lengths(), 1)
            default = "" if values.dtype == tf.string else 0
            flat = values.to_tensor(default_value=default, shape=[None, 1])[:, 0]
            if f.encoding == "raw":
                dtype = tf.dtypes.as_dtype(f.dtype)
                nbytes = int(np.prod(f.shape, dtype=np.int64)) * dtype.size
                ok &= tf.equal(tf.strings.length(flat), nbytes)
                flat = tf.where(ok, flat, tf.fill([n], tf.constant(b"\0" * nbytes)))
                value = tf.reshape(tf.io.decode_raw(flat, dtype), tf.concat([[n], f.shape], 0))
            elif f.encoding in ("int64", "float"):
                value = tf.cast(flat, tf.dtypes.as_dtype(f.dtype))
            else:
                value = flat
            problems.append(~ok)
            out[name] = value
        return tf.stack(problems, axis=1), out

    return parse_block


def _zeros_like_spec(spec):
    return tf.nest.map_structure(
        lambda s: tf.zeros([0 if d is None else d for d in s.shape], s.dtype), spec
    )


def _checked_records(segment, path, start, count, parse_block, feature_names, skipped):
    """Records [start, start+count) of one shard, parsed in blocks. A record that cannot be read
    or parsed raises an error naming the shard and record (with `skipped`: counted and dropped).

    TFRecord reading stops at a corrupt record (so the tail goes missing), a block whose parse
    fails is dropped (a gap in the block numbers), and bad records inside a block are flagged;
    a sentinel after the last block checks the tail.
    """
    def parse_numbered(k, records):
        return k, tf.shape(records, tf.int64)[0], parse_block(records)

    raw = tf.data.TFRecordDataset(path).skip(start).take(count).ignore_errors().batch(PARSE_BLOCK)
    blocks = raw.enumerate().map(parse_numbered).ignore_errors()
    sentinel = tf.data.Dataset.from_tensors(_zeros_like_spec(blocks.element_spec)).map(
        lambda k, n, parsed: (tf.constant(-1, tf.int64), n, parsed)
    )

    def track(state, element):
        expected_block, seen = state
        k, n, parsed = element
        return (k + 1, seen + n), (k, expected_block, seen, parsed)

    def check(k, expected_block, seen, parsed):
        problems, examples = parsed
        is_sentinel = tf.equal(k, -1)
        bad_rows = tf.reduce_any(problems, axis=1)
        if skipped is not None:
            lost = tf.where(is_sentinel, count - seen, tf.reduce_sum(tf.cast(bad_rows, tf.int64)))
            with tf.control_dependencies([skipped.add(segment, lost)]):
                return tf.identity(bad_rows), examples, is_sentinel
        unreadable = (
            "shard {}: records from {} on could not be read or parsed ({} of {} read): a corrupt "
            "record, a truncated file, or a feature stored with another type than the manifest "
            "says; `tfdist-data validate` or pipelines.explain_record names the cause; read with "
            "skip_corrupt=True to skip and count such records"
        )
        dropped = tf.strings.format(unreadable, (path, start + expected_block * PARSE_BLOCK, seen, count))
        # padded with an all-bad row so the argmax is defined for an empty (sentinel) block
        padded = tf.concat([problems, tf.ones([1, len(feature_names)], tf.bool)], 0)
        row = tf.argmax(tf.cast(tf.reduce_any(padded, axis=1), tf.int32), output_type=tf.int64)
        feature = tf.gather(tf.constant(feature_names), tf.argmax(tf.cast(tf.gather(padded, row), tf.int32)))
        invalid = tf.strings.format(
            "shard {}: record {}: feature {} is missing or does not match the manifest; read with "
            "skip_corrupt=True to skip and count such records", (path, start + k * PARSE_BLOCK + row, feature))
        truncated = tf.strings.format(unreadable, (path, start + seen, seen, count))
        checks = [
            tf.debugging.Assert(is_sentinel | tf.equal(k, expected_block), [dropped], summarize=1),
            tf.debugging.Assert(~tf.reduce_any(bad_rows), [invalid], summarize=1),
            tf.debugging.Assert(~is_sentinel | tf.equal(seen, count), [truncated], summarize=1),
        ]
        with tf.control_dependencies(checks):
            return tf.identity(bad_rows), examples, is_sentinel

    checked = blocks.concatenate(sentinel).scan((tf.constant(0, tf.int64), tf.constant(0, tf.int64)), track).map(check)
    def good_rows(bad, examples, is_sentinel):
        return tf.nest.map_structure(lambda t: tf.boolean_mask(t, ~bad), examples)

    # the sentinel block is empty, so it vanishes in unbatch()
    return checked.map(good_rows).unbatch()


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
                 augment_fn=None, shuffle_buffer=10_000, seed=0, cache=None, interleave_cycle=None,
                 deterministic=None, private_threads=None, ram_budget_mb=None, prefetch=True,
                 skip_corrupt=False, initial_epoch=0):
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
            evaluation order, one pass, nothing dropped.
        seed, initial_epoch: epoch e shuffles with a seed derived from (seed, e), so its order
            does not depend on how many epochs this process ran before: a run resumed with
            `initial_epoch=e` (e.g. `callbacks.Checkpointer(...).initial_epoch()`) reads what an
            uninterrupted run reads in epoch e (exactly, with `deterministic=True`), whatever
            `tf.random.set_seed` says.
        map_fn: applied to each parsed example (deterministic work: decode, cast), in parallel,
            before the cache.
        augment_fn: applied after the cache and the shuffle (random per-epoch work: crops,
            flips; also the place for decoding large images, so the shuffle buffer holds
            small encoded records), in parallel.
        cache: None, "memory", or a file path prefix: caches parsed (and `map_fn`'d) examples.
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

    parse_block = block_parser_for(manifest)
    feature_names = list(manifest.features)
    segments = tf.data.Dataset.from_tensor_slices((
        tf.range(len(plan.segments), dtype=tf.int64),
        tf.constant([s[0] for s in plan.segments]),
        tf.constant([s[1] for s in plan.segments], tf.int64),
        tf.constant([s[2] for s in plan.segments], tf.int64),
    ))
    cycle = interleave_cycle or min(len(plan.segments), 8)

    def records(segments):
        ds = segments.interleave(
            lambda i, path, start, count: _checked_records(i, path, start, count, parse_block, feature_names, skipped),
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
    ds.manifest_identity = manifest_identity(manifest)  # compared across ranks by tfdist.consistency
    return ds, plan


def manifest_identity(manifest):
    """(sha256 of the manifest's contents, description): equal iff two ranks read the same dataset."""
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
