"""TFRecord input pipelines for tfdist: sharded writer with manifests, exactly-once distributed reader.

```python
from tfdist.pipelines import write_arrays, read_dataset
write_arrays({"x": x, "y": y}, "/scratch/ds", min_shards=8)
ds, plan = read_dataset("/scratch/ds", batch_size=32, input_context=ctx)
```
"""

from tfdist.pipelines import preprocessing
from tfdist.pipelines.manifest import Manifest, ManifestError, load as load_manifest
from tfdist.pipelines.staging import StagingError, stage_dataset
from tfdist.pipelines.reader import ShardPlan, SkippedRecords, explain_record, plan_shards, read_dataset
from tfdist.pipelines.writer import write_arrays, write_examples, write_image_folder

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
