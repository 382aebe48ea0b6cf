"""`tfdist-data`: convert image folders or .npz files to sharded TFRecords, and validate datasets.

    tfdist-data convert /data/imagenet/train /scratch/imagenet-train --shard-mb 100 --min-shards 64
    tfdist-data convert digits.npz /scratch/digits --min-shards 8
    tfdist-data validate /scratch/digits
"""

import argparse
import os
import sys
import time

import numpy as np


class Progress:
    """One self-overwriting stderr line: records written, rate, and percent when the total is known."""

    def __init__(self, total=None, every=0.5):
        self.total, self.every, self.start, self.last = total, every, time.monotonic(), 0.0

    def __call__(self, count, final=False):
        now = time.monotonic()
        if not final and now - self.last < self.every:
            return
        self.last = now
        rate = count / max(now - self.start, 1e-9)
        done = f"{count}/{self.total} ({100 * count / self.total:.0f}%)" if self.total else str(count)
        sys.stderr.write(f"\r  {done} records, {rate:.0f} records/s" + ("\n" if final else ""))
        sys.stderr.flush()


def convert(args):
    from tfdist.pipelines import writer

    kwargs = dict(shard_bytes=int(args.shard_mb * (1 << 20)), min_shards=args.min_shards, prefix=args.prefix)
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
    size = sum(s.bytes for s in manifest.shards) / (1 << 20)
    print(f"wrote {manifest.records} records in {len(manifest.shards)} shards ({size:.1f} MB) to {manifest.directory}")


def validate(args):
    import tensorflow as tf

    from tfdist.pipelines import manifest as manifest_lib
    from tfdist.pipelines.reader import explain_record, read_dataset

    manifest = manifest_lib.load(args.source)
    bad = 0
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
    print(f"{len(manifest.shards) - bad} of {len(manifest.shards)} shards ok")
    return 1 if bad else 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tfdist-data", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", allow_abbrev=False, help="image folder (class sub-folders) or .npz -> TFRecord shards + manifest")
    c.add_argument("source")
    c.add_argument("out")
    c.add_argument("--shard-mb", type=float, default=100.0, help="target shard size (MB)")
    c.add_argument("--min-shards", type=int, default=1, help="at least this many shards (>= reader hosts)")
    c.add_argument("--prefix", default="data")
    v = sub.add_parser("validate", allow_abbrev=False, help="read every record of a dataset and name the bad ones")
    v.add_argument("source")
    v.add_argument("--checksum", action="store_true", help="also compare each shard's SHA-256")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.command == "convert":
        return convert(args) or 0
    return validate(args)


if __name__ == "__main__":
    sys.exit(main())
