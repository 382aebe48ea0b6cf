"""Read a shard's records checking each one: name the first bad record, or skip and count them.

```python
from tfdist.pipelines.records import block_parser_for, checked_records, explain_record
ds = checked_records(0, path, 0, 60, block_parser_for(manifest), list(manifest.features), None)
print(explain_record(manifest, path, 7))   # why record 7 of that shard fails
```

`pipelines.read_dataset` builds its pipelines from `checked_records`; `count_bad_records` is the
counting pass it runs before training with `skip_corrupt=True`, so that the step count of an
epoch comes from the records that can actually be read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from tfdist.pipelines import manifest as manifest_lib

if TYPE_CHECKING:
    from tfdist.pipelines.manifest import Manifest

PARSE_BLOCK = 64  # records parsed together: vectorised parsing, per-record error checks


def parser_for(manifest: Manifest) -> Callable[[tf.Tensor], dict[str, tf.Tensor]]:
    """A function parsing one serialized record into a dict of tensors, per the manifest's spec.

    Args:
        manifest: the dataset whose features the records hold.

    Returns:
        `parse(record)`: feature name -> tensor; a record that does not match raises.
    """
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
    """Per-shard counts of the records a `skip_corrupt` pipeline drops (unreadable or unparsable).

    `read_dataset(..., skip_corrupt=True)` returns one in its plan, and
    `callbacks.SkippedRecordsReport` logs `report()` every epoch, then calls `reset()`.
    Evaluation mode (one pass per iteration) counts the drops as it reads them; `reset()` clears
    the counts. Training mode knows them from the counting pass before training (`per_epoch`):
    every epoch drops the same records, so `report()` gives that epoch's drops whenever it is
    asked, never a sum over epochs or passes, and `reset()` has nothing to clear.

    Args:
        segments: the pipeline's (shard path, first record, record count) segments.
        per_epoch: the records each segment drops every epoch (training: from the counting
            pass); None counts drops as they happen, in a variable.
    """

    def __init__(self, segments: Sequence[tuple[str, int, int]], per_epoch: Sequence[int] | None = None):
        self.files = [path for path, _, _ in segments]
        self.per_epoch = None if per_epoch is None else [int(n) for n in per_epoch]
        self.counts = None
        if per_epoch is None:
            with tf.init_scope():
                # ON_READ: replica-local state, never broadcast or synced by a strategy.
                self.counts = tf.Variable(
                    tf.zeros([len(self.files)], tf.int64), trainable=False, name="skipped_records",
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                )

    def add(self, segment: tf.Tensor, count: tf.Tensor) -> tf.Operation:
        """Count `count` more records dropped from segment number `segment` (in-graph)."""
        return self.counts.scatter_add(tf.IndexedSlices(tf.reshape(count, [1]), tf.reshape(segment, [1])))

    def report(self) -> dict[str, int]:
        """{shard path: records dropped} for the shards with any (this pipeline's part only)."""
        counts = self.per_epoch if self.per_epoch is not None else self.counts.numpy()
        totals = {}
        for path, n in zip(self.files, counts):
            if n:
                totals[path] = totals.get(path, 0) + int(n)
        return totals

    def reset(self) -> None:
        """Clear the counts (evaluation mode; training mode's `per_epoch` counts stay)."""
        if self.counts is not None:
            self.counts.assign(tf.zeros_like(self.counts))


def block_parser_for(manifest: Manifest) -> Callable[[tf.Tensor], tuple[tf.Tensor, dict[str, tf.Tensor]]]:
    """Parse a block of serialized records without failing on a bad record.

    A record with a feature missing, repeated, or of the wrong byte size gets zeros and a
    problem flag instead of an error. (A feature stored with another proto type, e.g. an int64
    list where the manifest says bytes, still fails the whole block; the caller handles that.)

    Args:
        manifest: the dataset whose features the records hold.

    Returns:
        `parse_block(records) -> (problems [n, features] bool, examples dict of [n, ...])`.
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


def _blocks(path, start, count, parse_block):
    """Records [start, start+count) of one shard as parsed blocks, then an empty sentinel block.

    Each element is (k, expected_block, seen, bad_before, parsed): block k (-1 for the sentinel),
    the block number expected next, the records read and the bad rows found before it.
    TFRecord reading stops at a corrupt record (so the tail goes missing), and a block whose
    parse fails is dropped (a gap in the block numbers); the sentinel sees the total.
    """
    def parse_numbered(k, records):
        return k, tf.shape(records, tf.int64)[0], parse_block(records)

    raw = tf.data.TFRecordDataset(path).skip(start).take(count).ignore_errors().batch(PARSE_BLOCK)
    blocks = raw.enumerate().map(parse_numbered).ignore_errors()
    sentinel = tf.data.Dataset.from_tensors(_zeros_like_spec(blocks.element_spec)).map(
        lambda k, n, parsed: (tf.constant(-1, tf.int64), n, parsed)
    )

    def track(state, element):
        expected_block, seen, bad = state
        k, n, parsed = element
        bad_here = tf.reduce_sum(tf.cast(tf.reduce_any(parsed[0], axis=1), tf.int64))
        return (k + 1, seen + n, bad + bad_here), (k, expected_block, seen, bad, parsed)

    zero = tf.constant(0, tf.int64)
    return blocks.concatenate(sentinel).scan((zero, zero, zero), track)


def checked_records(segment: tf.Tensor, path: tf.Tensor, start: tf.Tensor, count: tf.Tensor,
                    parse_block: Callable[[tf.Tensor], tuple[tf.Tensor, dict[str, tf.Tensor]]],
                    feature_names: Sequence[str],
                    skipped: SkippedRecords | None, expected_bad: tf.Tensor | None = None,
                    who: str = "") -> tf.data.Dataset:
    """Records [start, start+count) of one shard, parsed in blocks, each checked.

    A record that cannot be read or parsed raises an error naming the shard and record; with
    `skipped` (a `SkippedRecords`) it is dropped, and counted in `skipped` unless
    `expected_bad` (a tensor: the drops per segment the counting pass found) is given: then
    a pass that drops another number of this segment's records raises instead (the file
    changed since it was counted), so an epoch always holds the records it was planned with.

    Args:
        segment: the segment's number (int64 scalar), its index in `skipped` and `expected_bad`.
        path: the shard file (string scalar).
        start: its first record to read (int64 scalar).
        count: how many records to read (int64 scalar).
        parse_block: from `block_parser_for`.
        feature_names: the manifest's feature names, in order (for error messages).
        skipped: drop bad records and count them here; None: raise on the first.
        expected_bad: the drops per segment the counting pass found (training with
            `skip_corrupt`), or None.
        who: a prefix for error messages ("rank R: ").

    Returns:
        The segment's good records, parsed: dicts of feature name -> tensor.
    """
    def check(k, expected_block, seen, bad_before, parsed):
        problems, examples = parsed
        is_sentinel = tf.equal(k, -1)
        bad_rows = tf.reduce_any(problems, axis=1)
        if skipped is not None and expected_bad is None:
            lost = tf.where(is_sentinel, count - seen, tf.reduce_sum(tf.cast(bad_rows, tf.int64)))
            with tf.control_dependencies([skipped.add(segment, lost)]):
                return tf.identity(bad_rows), examples
        if skipped is not None:
            dropped = bad_before + count - seen
            changed = tf.strings.format(
                who + "shard {}: records {} to {} held {} bad record(s) when counted before training "
                "but {} on this pass: was the file rewritten while training?",
                (path, start, start + count - 1, expected_bad[segment], dropped))
            same = tf.debugging.Assert(~is_sentinel | tf.equal(dropped, expected_bad[segment]), [changed], summarize=1)
            with tf.control_dependencies([same]):
                return tf.identity(bad_rows), examples
        unreadable = (
            who + "shard {}: records from {} on could not be read or parsed ({} of {} read): a corrupt "
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
            who + "shard {}: record {}: feature {} is missing or does not match the manifest; read "
            "with skip_corrupt=True to skip and count such records", (path, start + k * PARSE_BLOCK + row, feature))
        truncated = tf.strings.format(unreadable, (path, start + seen, seen, count))
        checks = [
            tf.debugging.Assert(is_sentinel | tf.equal(k, expected_block), [dropped], summarize=1),
            tf.debugging.Assert(~tf.reduce_any(bad_rows), [invalid], summarize=1),
            tf.debugging.Assert(~is_sentinel | tf.equal(seen, count), [truncated], summarize=1),
        ]
        with tf.control_dependencies(checks):
            return tf.identity(bad_rows), examples

    def good_rows(bad, examples):
        return tf.nest.map_structure(lambda t: tf.boolean_mask(t, ~bad), examples)

    # the sentinel block is empty, so it vanishes in unbatch()
    return _blocks(path, start, count, parse_block).map(check).map(good_rows).unbatch()


def count_bad_records(segments: Sequence[tuple[str, int, int]],
                      parse_block: Callable[[tf.Tensor], tuple[tf.Tensor, dict[str, tf.Tensor]]],
                      cycle: int = 8) -> list[int]:
    """How many records of each (path, start, count) segment cannot be read or parsed: one pass.

    Reads and parses every record of the segments (in parallel, `cycle` at a time), exactly as
    `checked_records` does, so a training pass drops the same records.

    Args:
        segments: (shard path, first record, record count) per segment.
        parse_block: from `block_parser_for`.
        cycle: segments read in parallel.

    Returns:
        The bad records per segment, in `segments` order.
    """
    if not segments:
        return []
    table = tf.data.Dataset.from_tensor_slices((
        tf.range(len(segments), dtype=tf.int64),
        tf.constant([s[0] for s in segments]),
        tf.constant([s[1] for s in segments], tf.int64),
        tf.constant([s[2] for s in segments], tf.int64),
    ))

    def lost_per_block(i, path, start, count):
        def lost(k, expected_block, seen, bad_before, parsed):
            sentinel = tf.equal(k, -1)
            bad_here = tf.reduce_sum(tf.cast(tf.reduce_any(parsed[0], axis=1), tf.int64))
            return i, tf.where(sentinel, count - seen, bad_here)

        return _blocks(path, start, count, parse_block).map(lost)

    blocks = table.interleave(lost_per_block, cycle_length=max(1, min(cycle, len(segments))),
                              num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    totals = blocks.reduce(tf.zeros([len(segments)], tf.int64),
                           lambda acc, e: tf.tensor_scatter_nd_add(acc, [[e[0]]], [e[1]]))
    return [int(n) for n in totals.numpy()]


def explain_record(source: str | os.PathLike[str] | Manifest, path: str, index: int) -> str:
    """Why record `index` of shard file `path` fails: names the feature (or the read error).

    Args:
        source: the dataset (directory or manifest file) or its `Manifest`.
        path: the shard file.
        index: the record's position in the shard, from 0.

    Returns:
        A sentence naming the shard, the record and the cause; it ends "parses fine" when
            the record is good.

    Example:
        ```python
        from tfdist.pipelines import explain_record
        print(explain_record("/scratch/digits", "/scratch/digits/data-00000-of-00008.tfrecord", 7))
        ```
    """
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
