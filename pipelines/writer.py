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

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfdist.pipelines import manifest as manifest_lib

if TYPE_CHECKING:
    from tfdist.pipelines.manifest import FeatureSpec, Manifest

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


def infer_spec(example: Mapping[str, Any]) -> dict[str, FeatureSpec]:
    """FeatureSpec per feature of one example (a dict of numpy values, scalars or bytes).

    Args:
        example: feature name -> value (bytes or str, a scalar, or an array).

    Returns:
        Feature name -> how it is stored: bytes as they are, integer and float scalars as
            int64 / float, anything else as raw array bytes.
    """
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


def serialize(example: Mapping[str, Any], specs: Mapping[str, FeatureSpec]) -> bytes:
    """One tf.train.Example, checking each value against the dataset's spec.

    Args:
        example: feature name -> value.
        specs: the dataset's features (from `infer_spec`).

    Returns:
        The serialized `tf.train.Example`.

    Raises:
        ValueError: a feature is missing, or a raw array's dtype or shape differs from its spec.
    """
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


def write_examples(examples: Iterable[Mapping[str, Any]], out_dir: str | os.PathLike[str], *,
                   prefix: str = "data", shard_bytes: int = 100 << 20, min_shards: int = 1,
                   class_names: Sequence[str] = (), specs: Mapping[str, FeatureSpec] | None = None,
                   progress: Callable[[int], object] | None = None) -> Manifest:
    """Write an iterable of example dicts; returns the `Manifest` (also saved as manifest.json).

    Records go round robin into `min_shards` shards at a time, so there are always at least
    `min_shards` shards (given that many records) and their record counts differ by at most one
    within each group; a group is closed when each of its shards reaches `shard_bytes`.

    Args:
        examples: dicts of feature name -> value (bytes or str, a numpy scalar or array), all
            with the same features.
        out_dir: the dataset directory (created if missing); a manifest and `*.tmp-*` files
            already there are removed first.
        prefix: shard file names are `<prefix>-<i>-of-<n>.tfrecord`.
        shard_bytes: the target size of each shard, in bytes.
        min_shards: shards written at once (at least this many, given that many records).
        class_names: label -> class name, kept in the manifest.
        specs: the features' storage; default: inferred from the first example.
        progress: called with the count of records written after each one.

    Returns:
        The dataset's manifest.

    Raises:
        ValueError: there are no examples, or one does not match the others (named).

    Example:
        ```python
        import numpy as np
        from tfdist.pipelines import write_examples
        rows = ({"x": np.full(4, i, np.float32), "y": np.int64(i % 2)} for i in range(100))
        manifest = write_examples(rows, "/tmp/tfdist-example", min_shards=4)
        print(manifest.records, len(manifest.shards))   # 100 4
        ```
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


def write_arrays(features: Mapping[str, np.ndarray], out_dir: str | os.PathLike[str],
                 **kwargs: Any) -> Manifest:
    """Write a dict of equal-length numpy arrays (one record per row).

    Args:
        features: feature name -> array; row i of every array makes record i.
        out_dir: the dataset directory (as in `write_examples`).
        **kwargs: `write_examples`' keyword arguments (`min_shards`, `shard_bytes`, ...).

    Returns:
        The dataset's manifest (also saved as manifest.json).

    Raises:
        ValueError: the arrays differ in length.

    Example:
        ```python
        import numpy as np
        from tfdist.pipelines import write_arrays
        x, y = np.random.rand(100, 4).astype(np.float32), np.arange(100) % 2
        manifest = write_arrays({"x": x, "y": y}, "/tmp/tfdist-arrays", min_shards=4)
        print(manifest.records, manifest.features["x"].shape)   # 100 (4,)
        ```
    """
    lengths = {name: len(array) for name, array in features.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"feature arrays differ in length: {lengths}")
    n = next(iter(lengths.values()))
    examples = ({name: array[i] for name, array in features.items()} for i in range(n))
    return write_examples(examples, out_dir, **kwargs)


def image_folder_examples(root: str | os.PathLike[str]) -> tuple[Iterator[dict[str, Any]], list[str], int]:
    """(examples, class_names, count) for an ImageNet-style folder: one sub-folder per class.

    Args:
        root: the folder: `root/<class>/<image>`, images ending .jpg, .jpeg or .png.

    Returns:
        A generator of `{"image": encoded bytes, "label": int64}` (each image checked as it is
            read), the sorted class names, and the number of images.

    Raises:
        ValueError: `root` has no class folders or no images (an image that cannot be decoded
            raises when the generator reaches it).
    """
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


def write_image_folder(root: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                       **kwargs: Any) -> Manifest:
    """Write an image folder; images stay encoded (JPEG/PNG bytes), labels from sorted folder names.

    Args:
        root: the folder: `root/<class>/<image>`, images ending .jpg, .jpeg or .png.
        out_dir: the dataset directory (as in `write_examples`).
        **kwargs: `write_examples`' keyword arguments (`min_shards`, `shard_bytes`, ...), except
            `class_names`, which come from the folder names.

    Returns:
        The dataset's manifest, with the features "image" (bytes) and "label" (int64).

    Raises:
        ValueError: `root` has no class folders or no images, or an image cannot be decoded
            (named).

    Example:
        ```python
        from tfdist.pipelines import write_image_folder
        manifest = write_image_folder("/data/imagenet/train", "/scratch/imagenet-train",
                                      shard_bytes=100 << 20, min_shards=64)
        print(manifest.class_names[:3], manifest.records)
        ```
    """
    examples, class_names, _ = image_folder_examples(root)
    return write_examples(examples, out_dir, class_names=class_names, **kwargs)
