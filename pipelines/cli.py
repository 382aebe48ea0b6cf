"""`tfdist-data`: convert image folders or .npz files to sharded TFRecords, and validate datasets.

    tfdist-data convert /data/imagenet/train /scratch/imagenet-train --shard-mb 100 --min-shards 64
    tfdist-data convert digits.npz /scratch/digits --min-shards 8
    tfdist-data validate /scratch/digits
    tfdist-data validate '/scratch/other/*.tfrecord'      # TFRecord files without a manifest
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from tfdist.units import MB


class Progress:
    """One self-overwriting stderr line: records written, rate, and percent when the total is known.

    Args:
        total: the records to write, if known.
        every: the least seconds between updates of the line.
    """

    def __init__(self, total: int | None = None, every: float = 0.5):
        self.total, self.every, self.start, self.last = total, every, time.monotonic(), 0.0

    def __call__(self, count: int, final: bool = False) -> None:
        """Show `count` records written (at most every `every` seconds, unless `final`: then end the line)."""
        now = time.monotonic()
        if not final and now - self.last < self.every:
            return
        self.last = now
        rate = count / max(now - self.start, 1e-9)
        done = f"{count}/{self.total} ({100 * count / self.total:.0f}%)" if self.total else str(count)
        sys.stderr.write(f"\r  {done} records, {rate:.0f} records/s" + ("\n" if final else ""))
        sys.stderr.flush()


def convert(args: argparse.Namespace) -> None:
    """`tfdist-data convert`: write an image folder or .npz file as TFRecord shards and a manifest.

    Args:
        args: the parsed command line (`source`, `out`, `shard_mb`, `min_shards`, `prefix`).

    Raises:
        SystemExit: `source` is neither an image folder nor an .npz file.
    """
    from tfdist.pipelines import writer

    kwargs = dict(shard_bytes=int(args.shard_mb * MB), min_shards=args.min_shards, prefix=args.prefix)
    if os.path.isdir(args.source):
        examples, class_names, total = writer.image_folder_examples(args.source)
        progress = Progress(total)
        manifest = writer.write_examples(examples, args.out, class_names=class_names, progress=progress, **kwargs)
    elif args.source.endswith(".npz"):
        arrays = dict(np.load(args.source))
        total = len(next(iter(arrays.values())))
        progress = Progress(total)
        manifest = writer.write_arrays(arrays, args.out, progress=progress, **kwargs)
    else:
        raise SystemExit(f"tfdist-data: {args.source} is neither an image folder nor an .npz file")
    progress(manifest.records, final=True)
    size = sum(s.bytes for s in manifest.shards) / MB
    print(f"wrote {manifest.records} records in {len(manifest.shards)} shards ({size:.1f} MB) to {manifest.directory}")


def validate(args: argparse.Namespace) -> int:
    """`tfdist-data validate`: read every record of a dataset, print each shard's state.

    Args:
        args: the parsed command line (`source`, `checksum`).

    Returns:
        The exit status: 0 all shards good, 1 some bad, 2 no usable manifest.
    """
    import tensorflow as tf

    from tfdist.pipelines import manifest as manifest_lib
    from tfdist.pipelines.reader import explain_record, read_dataset

    try:
        manifest, unreadable = _dataset_manifest(manifest_lib, args.source)
    except (manifest_lib.ManifestError, FileNotFoundError) as e:
        print(f"tfdist-data validate: {e}", file=sys.stderr)
        return 2
    if args.checksum and not all(s.sha256 for s in manifest.shards):
        print("note: --checksum: files without a manifest have no SHA-256 to compare; reading every record")
    for path, why in unreadable.items():
        print(f"BAD  {path}: {why}")
    bad = len(unreadable)
    for shard in manifest.shards:
        path = manifest.path(shard)
        if os.path.getsize(path) != shard.bytes or (args.checksum and shard.sha256 and manifest_lib.sha256_of(path) != shard.sha256):
            print(f"BAD  {path}: size or checksum differs from the manifest")
            bad += 1
            continue
        single = manifest_lib.Manifest(manifest.directory, manifest.features, (shard,))
        ds, plan = read_dataset(single, 256, training=False, skip_corrupt=True, prefetch=False)
        read = sum(int(tf.shape(next(iter(b.values())))[0]) for b in ds)
        if read != shard.records:
            first = next(i for i in range(shard.records) if "parses fine" not in explain_record(manifest, path, i))
            print(f"BAD  {path}: {shard.records - read} of {shard.records} records unreadable; first: "
                  f"{explain_record(manifest, path, first)}")
            bad += 1
        else:
            print(f"ok   {path}: {read} records")
    total = len(manifest.shards) + len(unreadable)
    print(f"{total - bad} of {total} shards ok")
    return 1 if bad else 0


def _dataset_manifest(manifest_lib, source):
    """(manifest, {file: why unreadable}) as `read_dataset` takes `source`: directory, manifest file or glob."""
    if any(ch in source for ch in "*?["):
        return _glob_manifest(manifest_lib, source)
    if os.path.isdir(source) and not os.path.exists(os.path.join(source, manifest_lib.FILENAME)):
        raise manifest_lib.ManifestError(
            f"{source} has no {manifest_lib.FILENAME}: write the dataset with `tfdist-data convert`, or "
            f"validate its TFRecord files by a quoted glob, e.g. '{os.path.join(source, '*.tfrecord')}'")
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source} does not exist: give a dataset directory, its manifest.json, "
                                "or a quoted glob of TFRecord files")
    return manifest_lib.load(source), {}


def _glob_manifest(manifest_lib, pattern):
    """TFRecord files without a manifest, as the reader's `from_files` sees them, one file at a time.

    Records are counted per file, so a file that cannot be read to its end is reported (with the
    records before the damage) instead of ending the check; the features come from the first
    readable file holding records, as the reader infers them.
    """
    import glob

    import tensorflow as tf

    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no TFRecord files match {pattern}")
    if len({os.path.dirname(os.path.abspath(p)) for p in files}) != 1:
        raise manifest_lib.ManifestError(f"files matching {pattern} must share one directory")
    shards, unreadable = [], {}
    for path in files:
        try:
            count = int(tf.data.TFRecordDataset(path).reduce(0, lambda n, _: n + 1))
        except tf.errors.DataLossError as e:
            good = int(tf.data.TFRecordDataset(path).ignore_errors().reduce(0, lambda n, _: n + 1))
            unreadable[path] = f"records from {good} on cannot be read (corrupt or truncated): {e.message}"
            continue
        shards.append(manifest_lib.Shard(os.path.basename(path), count, os.path.getsize(path), ""))
    with_records = [s for s in shards if s.records]
    if not with_records:
        raise manifest_lib.ManifestError(f"no readable records in the files matching {pattern} to infer the "
                                         f"features from{': ' + '; '.join(unreadable.values()) if unreadable else ''}")
    directory = os.path.dirname(os.path.abspath(files[0]))
    first = manifest_lib.from_files(glob.escape(os.path.join(directory, with_records[0].file)))
    return manifest_lib.Manifest(directory, first.features, tuple(shards)), unreadable


def main(argv: Sequence[str] | None = None) -> int:
    """The `tfdist-data` command.

    Args:
        argv: the arguments; default: `sys.argv[1:]`.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(prog="tfdist-data", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", allow_abbrev=False, help="image folder (class sub-folders) or .npz -> TFRecord shards + manifest")
    c.add_argument("source")
    c.add_argument("out")
    c.add_argument("--shard-mb", type=float, default=100.0, help="target shard size (MB)")
    c.add_argument("--min-shards", type=int, default=1, help="at least this many shards (>= reader hosts)")
    c.add_argument("--prefix", default="data")
    v = sub.add_parser("validate", allow_abbrev=False, help="read every record of a dataset and name the bad ones")
    v.add_argument("source", help="dataset directory, its manifest.json, or a quoted glob of TFRecord files")
    v.add_argument("--checksum", action="store_true", help="also compare each shard's SHA-256")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.command == "convert":
        return convert(args) or 0
    return validate(args)


if __name__ == "__main__":
    sys.exit(main())
