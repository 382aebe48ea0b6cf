"""The manifest: a JSON file beside TFRecord shards that says exactly what they hold.

```python
from tfdist.pipelines import manifest
m = manifest.load("/data/digits")          # a directory holding manifest.json, or the file
m.records, [s.file for s in m.shards], m.features["label"].dtype
```
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from tfdist.errors import TfdistError

FORMAT = "tfdist.tfrecord/1"
FILENAME = "manifest.json"


class ManifestError(TfdistError, ValueError):
    """A manifest is missing, malformed, or disagrees with the shards on disk."""


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """How one feature is stored.

    Args:
        dtype: the numpy dtype name of its values ("uint8", "int64", "float32", ...), or
            "string" for bytes.
        shape: the shape of one record's value (`()` for scalars and bytes).
        encoding: "raw" (array bytes of `dtype` and `shape`), "int64" or "float" (a scalar),
            or "bytes" (kept as they are, e.g. encoded JPEG).
    """

    dtype: str
    shape: tuple[int, ...]
    encoding: str

    def to_json(self) -> dict[str, Any]:
        """The spec as manifest.json holds it."""
        return {"dtype": self.dtype, "shape": list(self.shape), "encoding": self.encoding}


@dataclasses.dataclass(frozen=True)
class Shard:
    """One TFRecord file of a dataset, as its manifest lists it.

    Args:
        file: the file name, relative to the manifest's directory.
        records: how many records it holds.
        bytes: its size in bytes.
        sha256: the SHA-256 of its contents (hex; "" when unknown: files without a manifest).
    """

    file: str  # relative to the manifest's directory
    records: int
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a dataset directory holds: its shard files and the features of every record.

    `load` reads one; the `pipelines.write_*` functions return (and save) one.

    Args:
        directory: the directory holding the shards and manifest.json.
        features: feature name -> how it is stored, in record order.
        shards: the shard files, in reading order.
        class_names: label -> class name (image folders: the sorted sub-folder names), or empty.

    Example:
        ```python
        from tfdist.pipelines import load_manifest
        m = load_manifest("/scratch/digits")
        print(m.records, [s.file for s in m.shards], m.features["label"].dtype)
        ```
    """

    directory: str
    features: dict[str, FeatureSpec]
    shards: tuple[Shard, ...]
    class_names: tuple[str, ...] = ()

    @property
    def records(self) -> int:
        """The number of records in all shards."""
        return sum(s.records for s in self.shards)

    def path(self, shard: Shard) -> str:
        """The path of `shard`'s file."""
        return os.path.join(self.directory, shard.file)

    def to_json(self) -> dict[str, Any]:
        """The manifest as manifest.json holds it."""
        return {
            "format": FORMAT,
            "records": self.records,
            "features": {k: v.to_json() for k, v in self.features.items()},
            "class_names": list(self.class_names),
            "shards": [dataclasses.asdict(s) for s in self.shards],
        }

    def save(self) -> str:
        """Write manifest.json into `directory`, atomically; returns its path."""
        path = os.path.join(self.directory, FILENAME)
        atomic_write_text(path, json.dumps(self.to_json(), indent=1))
        return path


def load(source: str | os.PathLike[str]) -> Manifest:
    """Read a manifest from its file or its directory.

    Args:
        source: a dataset directory holding manifest.json, or the manifest file itself.

    Returns:
        The manifest; its `directory` is the manifest file's directory, made absolute.

    Raises:
        ManifestError: the manifest is missing, not JSON, of another format, or malformed
            (the message names the file).
    """
    path = os.path.join(source, FILENAME) if os.path.isdir(source) else source
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ManifestError(f"no manifest at {path}: write the dataset with pipelines.write_*") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"manifest {path} is not valid JSON: {e}") from None
    if data.get("format") != FORMAT:
        raise ManifestError(f"manifest {path} has format {data.get('format')!r}, expected {FORMAT!r}")
    try:
        features = {
            name: FeatureSpec(f["dtype"], tuple(f["shape"]), f["encoding"])
            for name, f in data["features"].items()
        }
        shards = tuple(Shard(**s) for s in data["shards"])
    except (KeyError, TypeError) as e:
        raise ManifestError(f"manifest {path} is malformed: {e!r}") from None
    return Manifest(os.path.dirname(os.path.abspath(path)), features, shards, tuple(data.get("class_names", ())))


def from_files(pattern: str | os.PathLike[str]) -> Manifest:
    """A manifest for TFRecord files written elsewhere (no manifest.json): counts every record.

    Features are inferred from the first record: int64 and float lists become scalars, byte
    lists stay bytes (e.g. encoded images). Reading every file once makes this slower than
    a written manifest; write one with `pipelines.write_*` for large datasets. Imports TensorFlow.

    Args:
        pattern: a glob pattern of TFRecord files, all in one directory.

    Returns:
        A manifest of the matching files (sorted by name), without checksums.

    Raises:
        FileNotFoundError: no file matches `pattern`.
        ManifestError: a file is not a readable TFRecord file, the files are in several
            directories, or the first file holds no record.
    """
    import glob

    import tensorflow as tf

    files = sorted(glob.glob(str(pattern)))
    if not files:
        raise FileNotFoundError(f"no TFRecord files match {pattern}")
    shards = []
    for path in files:
        try:
            count = int(tf.data.TFRecordDataset(path).reduce(0, lambda n, _: n + 1))
        except tf.errors.DataLossError as e:
            raise ManifestError(f"{path} is not a readable TFRecord file: {e.message}") from None
        shards.append(Shard(os.path.basename(path), count, os.path.getsize(path), ""))
    if len({os.path.dirname(os.path.abspath(p)) for p in files}) != 1:
        raise ManifestError(f"files matching {pattern} must share one directory")
    first = next(iter(tf.data.TFRecordDataset(files[0]).take(1)), None)
    if first is None:
        raise ManifestError(f"{files[0]} holds no records to infer the features from")
    example = tf.train.Example.FromString(first.numpy())
    features = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        features[name] = {
            "int64_list": FeatureSpec("int64", (), "int64"),
            "float_list": FeatureSpec("float32", (), "float"),
        }.get(kind, FeatureSpec("string", (), "bytes"))
    return Manifest(os.path.dirname(os.path.abspath(files[0])), features, tuple(shards))


def sha256_of(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """The SHA-256 (hex) of a file's contents, read `chunk` bytes at a time.

    Args:
        path: the file.
        chunk: bytes read at a time.

    Returns:
        The hex digest.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or all of the new one, never part.

    Args:
        path: the file to (re)place.
        text: its new contents.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
