"""Rank-consistency checks: ranks that disagree on code, versions or input data stop at once.

Ranks that run different code, library versions or data still step in lockstep, silently training
a wrong model (or fail much later with an opaque shape error inside an allreduce). `HorovodStrategy`
compares, with one allgather of fixed-size hashes:

- at start: tfdist's version and source, the TensorFlow, Keras, Horovod and Python versions, the
  main script's contents (`sys.argv[0]`) and an optional user fingerprint
  (`HorovodStrategy(fingerprint=...)`, e.g. a config hash or git commit);
- on the first dataset it distributes: the batch size (global or per rank, as given), the element structure (shapes
  without the batch dimension, dtypes) and, for `pipelines.read_dataset`, the manifest.

On a difference every rank raises `RankMismatchError` naming the item and each rank's value, e.g.
`dataset batch size differs across ranks: 8 on rank 0; 16 on rank 1`. Every rank makes the same
collective calls whatever it finds (all ranks see the same gathered hashes), so nothing hangs.

Example:

```python
from tfdist import collectives
from tfdist.faults import consistency
collectives.init()
consistency.check_start(fingerprint="config-sha-1234")
consistency.check_dataset(my_dataset)           # a collective: call it on every rank
```
"""

import glob
import hashlib
import os
import platform
import sys

import numpy as np
import tensorflow as tf

from tfdist import _compat, collectives
from tfdist.errors import RankMismatchError

_COLUMNS = 16  # fixed row width: column 0 names the items, the rest hold their hashes


def check_start(fingerprint=None):
    """Compare versions, tfdist's source, the main script and `fingerprint` across ranks."""
    _compare(start_items(fingerprint), "tfdist.faults.consistency.start")


def check_dataset(dataset):
    """Compare a dataset's batch size, element structure and manifest across ranks."""
    _compare(dataset_items(dataset), "tfdist.faults.consistency.dataset")


def start_items(fingerprint=None):
    """(name, key, shown) triples: `key` is compared, `shown` is what a mismatch message prints."""
    from tfdist._version import __version__
    from tfdist.keras.flavour import keras_module, legacy_requested

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tfdist/, every subpackage
    source = _sha256_files(sorted(glob.glob(os.path.join(package, "**", "*.py"), recursive=True)))
    keras_name = "tf-keras" if legacy_requested() else "Keras"
    items = [
        ("tfdist version", f"{__version__} {source}",
         f"{__version__} (source sha256 {source[:12]})"),
        ("TensorFlow version", tf.__version__, tf.__version__),
        ("Keras version", f"{keras_name} {keras_module().__version__}",
         f"{keras_name} {keras_module().__version__}"),
        ("Horovod version", collectives.horovod_version(), collectives.horovod_version()),
        ("Python version", platform.python_version(), platform.python_version()),
    ]
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.isfile(script):
        digest = _sha256_files([script])
        items.append(("main script", digest, f"{script} (sha256 {digest[:12]})"))
    else:
        items.append(("main script", "none", f"none ({sys.argv[0] if sys.argv else ''!r})"))
    fingerprint = "none" if fingerprint is None else str(fingerprint)
    items.append(("fingerprint", fingerprint, repr(fingerprint)))
    return items


def dataset_items(dataset):
    """The compared properties of a `tf.data.Dataset` (batch size, structure, manifest)."""
    specs = [s for s in tf.nest.flatten(dataset.element_spec) if isinstance(s, tf.TensorSpec)]
    batch = sorted({_batch_size_text(s.shape) for s in specs})
    structure = tf.nest.map_structure(
        lambda s: f"{s.dtype.name}{_shape_text(s.shape)}" if isinstance(s, tf.TensorSpec) else repr(s),
        dataset.element_spec,
    )
    manifest = find_dataset_attribute(dataset, "manifest_identity")
    batch_text = ", ".join(batch) + (" (unknown: a partial last batch is kept)" if "None" in batch else "")
    return [
        ("dataset batch size", ",".join(batch), batch_text),
        ("dataset element structure (shapes without the batch dimension, dtypes)",
         str(structure), str(structure)),
        ("dataset manifest", manifest[0] if manifest else "none",
         manifest[1] if manifest else "none (not made by pipelines.read_dataset)"),
    ]


def _batch_size_text(shape):
    # A shape of unknown rank (elements decoded by tf.io.parse_tensor) says nothing of its batch.
    if shape.rank is None:
        return "unknown rank"
    return str(shape[0]) if shape.rank else "unbatched"


def _shape_text(shape):
    return str(list(shape)[1:]) if shape.rank is not None else "[unknown rank]"


def _compare(items, name):
    if collectives.size() == 1:
        return
    if len(items) >= _COLUMNS:
        raise ValueError(f"at most {_COLUMNS - 1} items can be compared, got {len(items)}")
    row = np.zeros([1, _COLUMNS], np.int64)
    row[0, 0] = _hash64("\n".join(item[0] for item in items))
    row[0, 1 : len(items) + 1] = [_hash64(key) for _, key, _ in items]
    rows = collectives.allgather(tf.constant(row), name=name).numpy()
    if (rows == rows[0]).all():
        return
    if not (rows[:, 0] == rows[0, 0]).all():
        raise RankMismatchError(
            f"ranks run different tfdist versions: they compare different items at {name!r} "
            f"(item-list hashes {rows[:, 0].tolist()} on ranks 0..{len(rows) - 1})"
        )
    differing = [i for i in range(len(items)) if not (rows[:, i + 1] == rows[0, i + 1]).all()]
    shown = collectives.allgather_object([items[i][2] for i in differing], name=name + ".values")
    lines = []
    for j, i in enumerate(differing):
        by_value = {}
        for rank, texts in enumerate(shown):
            by_value.setdefault(texts[j], []).append(rank)
        per_value = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in by_value.items())
        lines.append(f"{items[i][0]} differs across ranks: {per_value}")
    raise RankMismatchError(
        "ranks disagree (every rank must run the same code, versions and data setup):\n  "
        + "\n  ".join(lines)
    )


def _ranks(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def find_dataset_attribute(dataset, name, depth=0):
    """An attribute that `pipelines.read_dataset` attaches, searched up the input chain (or None)."""
    value = getattr(dataset, name, None)
    if value is not None or depth > 200:
        return value
    try:
        inputs = _compat.dataset_inputs(dataset)
    except Exception:  # noqa: BLE001 - dataset kinds without inputs
        return None
    for parent in inputs:
        found = find_dataset_attribute(parent, name, depth + 1)
        if found is not None:
            return found
    return None


def _sha256_files(paths):
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _hash64(text):
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
