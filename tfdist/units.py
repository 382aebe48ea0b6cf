"""Units tfdist uses in every argument, flag and report.

A MB is 2**20 bytes everywhere in tfdist (`bucket_mb`, `fusion_threshold_mb`, `tfdist-predict`'s
`--gradient_mb` and wire MB, `tfdist-data --shard_mb`, staging rates), as in Horovod's fusion
threshold and PyTorch's `bucket_cap_mb`.

```python
from tfdist.units import MB
bucket_bytes = int(25 * MB)
```
"""

MB = 1 << 20
"""Bytes in one MB (a mebibyte)."""
