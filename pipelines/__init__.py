"""TFRecord input pipelines for tfdist: sharded writer with manifests, exactly-once distributed reader.

```python
from tfdist.pipelines import write_arrays, read_dataset
write_arrays({"x": x, "y": y}, "/scratch/ds", min_shards=8)
ds, plan = read_dataset("/scratch/ds", batch_size=32, input_context=ctx)
```

The names below load their module (and TensorFlow) on first use, so `tfdist-data --help` and
`import tfdist.pipelines.manifest` start without TensorFlow.
"""

import importlib

# public name -> (its module, its name there)
_EXPORTS = {
    "Manifest": ("manifest", "Manifest"),
    "ManifestError": ("manifest", "ManifestError"),
    "load_manifest": ("manifest", "load"),
    "StagingError": ("staging", "StagingError"),
    "stage_dataset": ("staging", "stage_dataset"),
    "ShardPlan": ("reader", "ShardPlan"),
    "SkippedRecords": ("reader", "SkippedRecords"),
    "explain_record": ("reader", "explain_record"),
    "plan_shards": ("reader", "plan_shards"),
    "read_dataset": ("reader", "read_dataset"),
    "write_arrays": ("writer", "write_arrays"),
    "write_examples": ("writer", "write_examples"),
    "write_image_folder": ("writer", "write_image_folder"),
}
_SUBMODULES = frozenset({"cli", "manifest", "preprocessing", "reader", "records", "staging", "writer"})


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tfdist.pipelines' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(f"{__name__}.{module_name}"), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)


__all__ = [
    "Manifest",
    "ManifestError",
    "ShardPlan",
    "SkippedRecords",
    "StagingError",
    "explain_record",
    "load_manifest",
    "preprocessing",
    "plan_shards",
    "read_dataset",
    "stage_dataset",
    "write_arrays",
    "write_examples",
    "write_image_folder",
]
