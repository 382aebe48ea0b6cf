"""The manifest: a JSON file beside TFRecord shards that says exactly what they hold.

```python
from tfdist.pipelines import manifest
m = manifest.load("/data/digits")          # a directory holding manifest.json, or the file
m.records, [s.file for s in m.shards], m.features["label"].dtype
```
"""

import dataclasses
import hashlib
import json
import os

from tfdist.errors import TfdistError

FORMAT = "tfdist.tfrecord/1"
FILENAME = "manifest.json"


class ManifestError(TfdistError, ValueError):
    """A manifest is missing, malformed, or disagrees with the shards on disk."""


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """How one feature is stored: `raw` arrays (bytes + dtype + shape), `int64`/`float` scalars,
    or `bytes` kept as they are (e.g. encoded JPEG)."""

    dtype: str
    shape: tuple
    encoding: str

    def to_json(self):
        return {"dtype": self.dtype, "shape": list(self.shape), "encoding": self.encoding}


@dataclasses.dataclass(frozen=True)
class Shard:
    file: str  # relative to the manifest's directory
    records: int
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    directory: str
    features: dict
    shards: tuple
    class_names: tuple = ()

    @property
    def records(self):
        return sum(s.records for s in self.shards)

    def path(self, shard):
        return os.path.join(self.directory, shard.file)

    def to_json(self):
        return {
            "format": FORMAT,
            "records": self.records,
            "features": {k: v.to_json() for k, v in self.features.items()},
            "class_names": list(self.class_names),
            "shards": [dataclasses.asdict(s) for s in self.shards],
        }

    def save(self):
        path = os.path.join(self.directory, FILENAME)
        atomic_write_text(path, json.dumps(self.to_json(), indent=1))
        return path


def load(source):
    """Read a manifest from its file or its directory; raise `ManifestError` naming the file."""
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


def from_files(pattern):
    """A manifest for TFRecord files written elsewhere (no manifest.json): counts every record.

    Features are inferred from the first record: int64 and float lists become scalars, byte
    lists stay bytes (e.g. encoded images). Reading every file once makes this slower than
    a written manifest; write one with `pipelines.write_*` for large datasets.
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


def sha256_of(path, chunk=1 << 20):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_text(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
