"""XLA across ranks: a `jit_compile=True` function compiles around Horovod's collectives.

Horovod's own XLA ops (`horovod/tensorflow/xla_mpi_ops.cc`) cover allreduce on CUDA and ROCm only
(on a CPU build the file compiles to nothing), and do not compile against TensorFlow 2.21. tfdist
keeps the collectives outside the compiled code instead. On 2+ ranks, every `tf.function` made
with `jit_compile=True` is traced without XLA's must-compile rule and with every op but Horovod's
marked for XLA (`tf.xla.experimental.jit_scope`). XLA then compiles the forward and backward pass
and the update as clusters, and the allreduce runs between them, as Horovod's own ops would. This
covers `model.compile(jit_compile=True)` on both Keras flavours and `tf.function(jit_compile=True)`
custom steps; on one rank nothing changes.

```python
strategy = tfdist.HorovodStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)  # XLA on any number of ranks
```

The choice is made before the first trace, not on the first collective met: a trace that fails
half-way leaves Python state behind (an optimizer marked built whose slots were never made).
"""

import functools
import logging

import tensorflow as tf

from tfdist import _compat
from tfdist.errors import XlaNotSupportedError

log = logging.getLogger("tfdist")

HOOK = "XLA around collectives"
_CLUSTERED = "_tfdist_clustered"  # the replacement function, stored on the jit_compile=True one


class CollectiveInXlaError(XlaNotSupportedError):
    """A Horovod collective was traced inside a must-compile (`jit_compile=True`) function.

    tfdist retraces every `jit_compile=True` `tf.function` it is called through, so this reaches
    the user only where a function is compiled some other way (`experimental_get_compiler_ir`, a
    concrete function taken before `HorovodStrategy()` was made, ...).
    """


def outside_collectives(node_def):
    """Whether XLA may compile this op: anything but Horovod's collectives."""
    return not node_def.op.startswith("Horovod")


def clustered(function):
    """`function` (a `tf.function` with `jit_compile=True`) as a `tf.function` whose ops XLA
    compiles as clusters, leaving Horovod's collectives between them."""
    python_function, settings = _compat.tf_function_settings(function)

    def with_clusters(*args, **kwargs):
        with tf.xla.experimental.jit_scope(compile_ops=outside_collectives, separate_compiled_gradients=False):
            return python_function(*args, **kwargs)

    settings["jit_compile"] = None  # False would keep XLA out of the clusters too
    return tf.function(functools.wraps(python_function)(with_clusters), **settings)


def install():
    """From now on, call every `jit_compile=True` `tf.function` as XLA clusters around collectives.

    `HorovodStrategy` calls this on 2+ ranks when Horovod has no XLA ops of its own.
    """
    cls = _compat.tf_function_class()
    if _compat.hook_of(cls.__call__) == HOOK:
        return

    def make_wrapper(original):
        def __call__(self, *args, **kwargs):
            replacement = self.__dict__.get(_CLUSTERED)
            if replacement is None:
                if _compat.tf_function_jit_compile(self) is not True:  # every tf.function call: keep it cheap
                    return original(self, *args, **kwargs)
                replacement = clustered(self)
                setattr(self, _CLUSTERED, replacement)
                log.info("tfdist: %s (jit_compile=True): XLA compiles its ops as clusters and Horovod's "
                         "collectives run between them", self.__name__)
            return replacement(*args, **kwargs)

        return __call__

    _compat.patch_method(cls, "__call__", make_wrapper, HOOK)
