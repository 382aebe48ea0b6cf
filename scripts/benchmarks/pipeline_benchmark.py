"""Measure the input pipeline alone (no model): records/s and images/s, naive vs tuned vs cached.

    python scripts/benchmarks/pipeline_benchmark.py --workdir /tmp/tfdist-bench --json pipeline.json

Datasets (generated once into --workdir, reused afterwards):
  jpeg:   ImageNet-like JPEGs (about 400x350, about 110 KB each) in TFRecord shards; every record is
          decoded, randomly cropped, flipped and resized to --image-size (the ResNet50 training path).
  arrays: small float vectors with an int label (cheap parsing), the case where caching pays most.

Pipelines:
  naive:  files read one after another, sequential map, no prefetch.
  tuned:  pipelines.read_dataset: parallel interleave, AUTOTUNE map, prefetch.
  cached: tuned plus an in-memory cache of the parsed records (filled by one untimed epoch).
Configurations alternate within each repeat, so a noisy machine affects all of them alike.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tfdist.pipelines import preprocessing, read_dataset, write_arrays, write_examples  # noqa: E402
from tfdist.pipelines import manifest as manifest_lib  # noqa: E402


def imagenet_like_jpeg(rng, height=350, width=400, quality=94):
    """A photo-sized JPEG: smooth colour fields plus fine noise, about 110 KB at quality 94."""
    base = rng.random((height // 25, width // 25, 3)) * 255
    smooth = tf.image.resize(base[None], (height, width), method="bicubic")[0].numpy()
    noisy = np.clip(smooth + rng.normal(0, 30, smooth.shape), 0, 255).astype(np.uint8)
    return tf.io.encode_jpeg(noisy, quality=quality).numpy()


def make_jpeg_dataset(directory, records, shards):
    if os.path.exists(os.path.join(directory, manifest_lib.FILENAME)):
        return manifest_lib.load(directory)
    rng = np.random.default_rng(0)
    pool = [imagenet_like_jpeg(rng) for _ in range(32)]  # encoding is slow; reuse a pool of images
    examples = ({"image": pool[i % len(pool)], "label": np.int64(i % 1000)} for i in range(records))
    return write_examples(examples, directory, min_shards=shards, shard_bytes=1 << 40)


def make_array_dataset(directory, records, shards):
    if os.path.exists(os.path.join(directory, manifest_lib.FILENAME)):
        return manifest_lib.load(directory)
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(records, 32)).astype("float32"), "label": rng.integers(0, 10, records)}
    return write_arrays(data, directory, min_shards=shards, shard_bytes=1 << 40)


def naive_dataset(manifest, batch_size, parse_and_prepare):
    files = [manifest.path(s) for s in manifest.shards]
    ds = tf.data.TFRecordDataset(files).map(parse_and_prepare)
    return ds.batch(batch_size, drop_remainder=True).repeat()


def jpeg_pipelines(manifest, batch_size, image_size):
    parse = _parse(manifest)
    augment = preprocessing.example_mapper(training=True, image_size=image_size)
    return {
        "naive": lambda: naive_dataset(manifest, batch_size, lambda r: augment(parse(r))),
        "tuned": lambda: read_dataset(manifest, batch_size, augment_fn=augment, shuffle_buffer=256)[0],
        "cached": lambda: read_dataset(manifest, batch_size, augment_fn=augment, cache="memory",
                                       shuffle_buffer=256)[0],
    }


def array_pipelines(manifest, batch_size):
    parse = _parse(manifest)

    def prepare(e):
        return e["x"], e["label"]

    return {
        "naive": lambda: naive_dataset(manifest, batch_size, lambda r: prepare(parse(r))),
        "tuned": lambda: read_dataset(manifest, batch_size, map_fn=prepare, shuffle_buffer=1024)[0],
        "cached": lambda: read_dataset(manifest, batch_size, map_fn=prepare, cache="memory",
                                       shuffle_buffer=1024)[0],
    }


def _parse(manifest):
    from tfdist.pipelines.reader import parser_for

    return parser_for(manifest)


def time_batches(dataset, batches, warmup, batch_size):
    iterator = iter(dataset)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size / (time.perf_counter() - start)


def run(kind, builders, args, batch_size, epoch_batches):
    results = {name: [] for name in builders}
    for repeat in range(args.repeats):
        for name, build in builders.items():
            dataset = build()
            # cached: the untimed warm-up fills the cache with one full epoch
            warmup = epoch_batches if name == "cached" else args.warmup
            rate = time_batches(dataset, args.batches, warmup, batch_size)
            results[name].append(rate)
            print(f"  {kind:6s} {name:6s} repeat {repeat + 1}: {rate:9.1f} records/s", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/tfdist-pipeline-bench")
    parser.add_argument("--json", default="pipeline_benchmark.json")
    parser.add_argument("--jpeg-records", type=int, default=1024)
    parser.add_argument("--array-records", type=int, default=200_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--array-batch-size", type=int, default=1024)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batches", type=int, default=20, help="timed batches per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches before timing")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    jpeg = make_jpeg_dataset(os.path.join(args.workdir, "jpeg"), args.jpeg_records, args.shards)
    arrays = make_array_dataset(os.path.join(args.workdir, "arrays"), args.array_records, args.shards)
    mean_jpeg_kb = sum(s.bytes for s in jpeg.shards) / jpeg.records / 1024
    print(f"jpeg: {jpeg.records} records, {mean_jpeg_kb:.0f} KB/record; arrays: {arrays.records} records; "
          f"{os.cpu_count()} CPUs, TF {tf.__version__}", flush=True)

    results = {
        "jpeg": run("jpeg", jpeg_pipelines(jpeg, args.batch_size, args.image_size), args,
                    args.batch_size, jpeg.records // args.batch_size),
        "arrays": run("arrays", array_pipelines(arrays, args.array_batch_size), args,
                      args.array_batch_size, arrays.records // args.array_batch_size),
    }
    print("\n| dataset | pipeline | median records/s | min | max | vs naive |\n|---|---|---|---|---|---|")
    summary = {}
    for kind, runs in results.items():
        naive = statistics.median(runs["naive"])
        for name, rates in runs.items():
            med = statistics.median(rates)
            summary[f"{kind}/{name}"] = med
            print(f"| {kind} | {name} | {med:.1f} | {min(rates):.1f} | {max(rates):.1f} | {med / naive:.2f}x |")
    report = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "tensorflow": tf.__version__},
        "args": vars(args),
        "jpeg_kb_per_record": mean_jpeg_kb,
        "runs": results,
        "median": summary,
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
