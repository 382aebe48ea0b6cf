"""Optimizer wrappers for large-batch training: LARS / LARC trust ratios and gradient accumulation.

```python
import keras
from tfdist.optimizers import LARS, accumulate_gradients
optimizer = accumulate_gradients(LARS(keras.optimizers.SGD(0.1, momentum=0.9)), steps=4)
```
"""

from tfdist.optimizers.accumulation import accumulate_gradients
from tfdist.optimizers.lars import LARC, LARS

__all__ = ["LARC", "LARS", "accumulate_gradients"]
