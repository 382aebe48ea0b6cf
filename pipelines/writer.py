"""Write datasets as sharded TFRecord files plus a manifest (large files: the first rule of HPC I/O).

```python
from tfdist.pipelines import write_arrays
m = write_arrays({"image": x, "label": y}, "/scratch/digits/train", shard_bytes=16 << 20, min_shards=8)
print(m.records, len(m.shards))
```

Shards are written under temporary names and renamed when complete; the manifest is written last.
A dataset directory with a manifest is therefore complete, and an interrupted write leaves only
`*.tmp-*` files, which the next write into that directory removes (restart, not resume).
"""

import glob
import os

import numpy as np
import tensorflow as tf

from tfdist.pipelines import manifest as manifest_lib

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


def infer_spec(example):
    """FeatureSpec per feature of one example (a dict of numpy values, scalars or bytes)."""
    specs = {}
    for name, value in example.items():
        if isinstance(value, (bytes, str)):
            specs[name] = manifest_lib.FeatureSpec("string", (), "bytes")
            continue
        array = np.asarray(value)
        if array.ndim == 0 and np.issubdtype(array.dtype, np.integer):
            specs[name] = manifest_lib.FeatureSpec(array.dtype.name, (), "int64")
        elif array.ndim == 0 and np.issubdtype(array.dtype, np.floating):
            specs[name] = manifest_lib.FeatureSpec(array.dtype.name, (), "float")
        else:
            specs[name] = manifest_lib.FeatureSpec(array.dtype.name, tuple(array.shape), "raw")
    return specs


def serialize(example, specs):
    """One tf.train.Example, checking each value against the dataset's spec."""
    feature = {}
    for name, spec in specs.items():
        if name not in example:
            raise ValueError(f"example is missing feature {name!r} (features: {sorted(specs)})")
        value = example[name]
        if spec.encoding == "bytes":
            data = value.encode() if isinstance(value, str) else bytes(value)
            feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
        elif spec.encoding == "int64":
            feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=[int(value)]))
        elif spec.encoding == "float":
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=[float(value)]))
        else:
            array = np.asarray(value)
            if array.shape != spec.shape or array.dtype.name != spec.dtype:
                raise ValueError(
                    f"feature {name!r}: got {array.dtype.name}{list(array.shape)}, "
                    f"dataset has {spec.dtype}{list(spec.shape)}"
                )
            feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[array.tobytes()]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


class _ShardGroup:
    """`width` shards open at once, filled round robin, closed when all reach the byte target."""

    def __init__(self, out_dir, prefix, width, first_index):
        self.paths = [os.path.join(out_dir, f"{prefix}-{first_index + i:05d}.tfrecord") for i in range(width)]
        self.tmp = [f"{p}.tmp-{os.getpid()}" for p in self.paths]
        self.writers = [tf.io.TFRecordWriter(t) for t in self.tmp]
        self.records = [0] * width
        self.bytes = [0] * width
        self.next = 0

    def write(self, record):
        i = self.next
        self.writers[i].write(record)
        self.records[i] += 1
        self.bytes[i] += len(record) + 16  # TFRecord framing
        self.next = (i + 1) % len(self.writers)

    def full(self, target):
        return min(self.bytes) >= target

    def close(self):
        shards = []
        for writer, tmp, path, n in zip(self.writers, self.tmp, self.paths, self.records):
            writer.close()
            if n == 0:
                os.remove(tmp)
                continue
            os.replace(tmp, path)
            shards.append(manifest_lib.Shard(
                os.path.basename(path), n, os.path.getsize(path), manifest_lib.sha256_of(path)
            ))
        return shards


def write_examples(examples, out_dir, *, prefix="data", shard_bytes=100 << 20, min_shards=1,
                   class_names=(), specs=None, progress=None):
    """Write an iterable of example dicts; returns the `Manifest` (also saved as manifest.json).

    Records go round robin into `min_shards` shards at a time, so there are always at least
    `min_shards` shards (given that many records) and their record counts differ by at most one
    within each group; a group is closed when each of its shards reaches `shard_bytes`.
    """
    os.makedirs(out_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(out_dir, "*.tmp-*")):
        os.remove(stale)
    old_manifest = os.path.join(out_dir, manifest_lib.FILENAME)
    if os.path.exists(old_manifest):
        os.remove(old_manifest)  # the directory is incomplete until the new manifest is written
    shards, group, count = [], None, 0
    for example in examples:
        if specs is None:
            specs = infer_spec(example)
        if group is None:
            group = _ShardGroup(out_dir, prefix, min_shards, len(shards))
        group.write(serialize(example, specs))
        count += 1
        if progress is not None:
            progress(count)
        if group.full(shard_bytes):
            shards += group.close()
            group = None
    if group is not None:
        shards += group.close()
    if not shards:
        raise ValueError(f"no examples to write to {out_dir}")
    total = len(shards)
    renamed = []
    for i, shard in enumerate(shards):  # final names say the shard count, as TFDS does
        name = f"{prefix}-{i:05d}-of-{total:05d}.tfrecord"
        os.replace(os.path.join(out_dir, shard.file), os.path.join(out_dir, name))
        renamed.append(manifest_lib.Shard(name, shard.records, shard.bytes, shard.sha256))
    result = manifest_lib.Manifest(os.path.abspath(out_dir), specs, tuple(renamed), tuple(class_names))
    result.save()
    return result


def write_arrays(features, out_dir, **kwargs):
    """Write a dict of equal-length numpy arrays (one record per row)."""
    lengths = {name: len(array) for name, array in features.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"feature arrays differ in length: {lengths}")
    n = next(iter(lengths.values()))
    examples = ({name: array[i] for name, array in features.items()} for i in range(n))
    return write_examples(examples, out_dir, **kwargs)


def image_folder_examples(root):
    """(examples, class_names) for an ImageNet-style folder: one sub-folder per class."""
    class_names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not class_names:
        raise ValueError(f"{root} has no class sub-folders (expected root/<class>/<image>)")
    files = [
        (os.path.join(root, c, f), label)
        for label, c in enumerate(class_names)
        for f in sorted(os.listdir(os.path.join(root, c)))
        if f.lower().endswith(IMAGE_EXTENSIONS)
    ]
    if not files:
        raise ValueError(f"{root} has no {'/'.join(IMAGE_EXTENSIONS)} images in its class folders")

    def examples():
        for path, label in files:
            with open(path, "rb") as f:
                data = f.read()
            _check_decodes(path, data)
            yield {"image": data, "label": np.int64(label)}

    return examples(), class_names, len(files)


def _check_decodes(path, data):
    """Fail at conversion, naming the file, rather than mid-training on an undecodable image."""
    try:
        if tf.io.is_jpeg(data):
            tf.image.extract_jpeg_shape(data)  # header only: cheap
        else:
            tf.io.decode_image(data, channels=3, expand_animations=False)
    except (tf.errors.InvalidArgumentError, ValueError) as e:
        raise ValueError(f"image {path} cannot be decoded: {str(e).splitlines()[0]}") from None


def write_image_folder(root, out_dir, **kwargs):
    """Write an image folder; images stay encoded (JPEG/PNG bytes), labels from sorted folder names."""
    examples, class_names, _ = image_folder_examples(root)
    return write_examples(examples, out_dir, class_names=class_names, **kwargs)
