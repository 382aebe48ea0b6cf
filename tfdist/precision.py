"""Mixed precision for tfdist: pick the Keras dtype policy for the hardware, keep loss scaling
consistent across ranks.

```python
import tfdist
policy = tfdist.precision.set_policy("auto")   # mixed_float16 / mixed_bfloat16 / float32, logged
```

Loss scaling: Keras 3's `LossScaleOptimizer` decides to apply or skip a step from each rank's
*local* gradients, before they are all-reduced. If one rank overflows and another does not, one
rank enters the gradient allreduce and the other skips it, and the job hangs; and no gradient
can leave before the check has seen the last one. Under `HorovodStrategy` tfdist all-reduces
first and checks the reduced gradients, as tf-keras does: the exchange starts during backprop,
every rank sees the same sum (an overflow anywhere is inf/nan everywhere), so every rank skips
or applies the same step and the loss scale stays identical.
"""

import logging

import tensorflow as tf

from tfdist import _compat, collectives
from tfdist.keras.flavour import keras_module

log = logging.getLogger("tfdist")

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
HOOK = "rank-consistent loss scaling"
_installed = False


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose_policy(gpus=None, flags=None):
    """(policy, reason) for this machine: fp16 on NVIDIA GPUs with compute capability >= 7.0,
    bf16 on CPUs with AMX or AVX512-BF16, float32 elsewhere (bf16 without them is slower)."""
    if gpus is None:
        gpus = [tf.config.experimental.get_device_details(g) for g in tf.config.list_physical_devices("GPU")]
    capabilities = [g.get("compute_capability") for g in gpus if g.get("compute_capability")]
    if capabilities:
        if min(capabilities) >= (7, 0):
            return "mixed_float16", f"NVIDIA GPU with compute capability {min(capabilities)} has tensor cores"
        return "float32", f"GPU compute capability {min(capabilities)} < 7.0: no fast float16"
    flags = cpu_flags() if flags is None else flags
    bf16 = sorted(flags & {"amx_bf16", "avx512_bf16"})
    if bf16:
        return "mixed_bfloat16", f"CPU supports {', '.join(bf16)}"
    return "float32", "CPU has neither AMX nor AVX512-BF16: bfloat16 would be slower than float32"


def set_policy(policy="auto"):
    """Set the global Keras dtype policy ("auto" or one of POLICIES); returns the policy name."""
    if policy == "auto":
        policy, reason = choose_policy()
        if collectives.process_rank() == 0:
            log.warning("tfdist: precision policy %s (%s)", policy, reason)
    elif policy not in POLICIES:
        raise ValueError(f"precision policy {policy!r}: expected 'auto' or one of {POLICIES}")
    keras_module().mixed_precision.set_global_policy(policy)
    return policy


def policy_name(gpus=None, flags=None):
    """The global Keras dtype policy in effect, for the tuning line: "Keras policy mixed_float16".

    Under float32 on hardware with a faster precision (a CPU with AMX or AVX512-BF16, an NVIDIA
    GPU with tensor cores) it names that precision and how to ask for it."""
    name = keras_module().mixed_precision.global_policy().name
    if name != "float32":
        return f"Keras policy {name}"
    faster, reason = choose_policy(gpus, flags)
    if faster == "float32":
        return f"Keras policy {name}"
    return (f"Keras policy {name} ({faster} is faster here, {reason}: "
            f"HorovodStrategy(precision=\"auto\") or \"{faster}\")")


def float32_softmax(logits_model, name="probabilities"):
    """`logits_model` followed by a softmax computed in float32, whatever the dtype policy.

    Under a mixed policy the layers compute in float16/bfloat16; the final softmax (and the
    loss, which Keras computes in float32) should not. Build the model without its own output
    activation (e.g. `keras.applications.ResNet50(weights=None, classifier_activation=None)`) and
    wrap it:

    ```python
    model = tfdist.precision.float32_softmax(keras.applications.ResNet50(weights=None, classifier_activation=None))
    ```
    """
    keras = keras_module()
    inputs = [keras.Input(shape=tuple(x.shape)[1:], dtype=x.dtype) for x in logits_model.inputs]
    inputs = inputs[0] if len(inputs) == 1 else inputs   # a model of several inputs takes them as a list
    probabilities = keras.layers.Activation("softmax", dtype="float32", name=name)(logits_model(inputs))
    return keras.Model(inputs, probabilities, name=f"{logits_model.name}_float32_softmax")


def install():
    """Make Keras 3's LossScaleOptimizer all-reduce before its finite check, under HorovodStrategy.

    With gradient accumulation (reduced once per k steps) it reduces as Keras does and agrees on
    the finite flag with one tiny allreduce instead; so it does with sharded optimizer state, where
    it reduce-scatters first and each rank checks its slice. Raises `KerasHookError` (naming the Keras
    version) if the class, its `_tf_apply` or `check_finite` moved.
    """
    global _installed
    if _installed:
        return
    from tfdist.exchange import gradients as gradient_exchange
    from tfdist.exchange import sharded

    def wrap_check(local_check):
        def check_finite(self, grads):
            finite = local_check(self, grads)
            if not _under_horovod() or gradient_exchange.is_reduced_already():
                return finite
            # Gradients not reduced first (gradient accumulation): one tiny allreduce that every
            # rank issues, whatever its own gradients hold.
            overflowed = collectives.allreduce([tf.cast(tf.logical_not(finite), tf.int32)], op="sum",
                                               scope="tfdist_loss_scale_agreement")[0]
            return tf.equal(overflowed, 0)

        return check_finite

    def wrap(original):
        def _tf_apply(self, grads, trainable_variables=None):
            if not _under_horovod() or getattr(self.inner_optimizer, "gradient_accumulation_steps", None):
                return original(self, grads, trainable_variables)
            if sharded.state_of(self.inner_optimizer) is not None:
                # Sharded state: each rank checks its slice of the summed gradients; check_finite's
                # agreement makes it one decision for every slice.
                present = [i for i, g in enumerate(grads) if g is not None]
                variables = list(trainable_variables or self._trainable_variables)
                scattered = tf.distribute.get_strategy().extended.reduce_scatter(
                    [grads[i] for i in present], [variables[i] for i in present])
                slices = [None] * len(grads)
                for i, g in zip(present, scattered):
                    slices[i] = g
                with sharded.scattered_already():
                    return original(self, slices, trainable_variables)
            variables = list(trainable_variables or self._trainable_variables)
            # The inner optimizer's own gradient sum (so op="adasum" and compression apply),
            # started as each gradient exists; the inner apply then takes the sum as it is.
            reduced = [g for g, _ in self.inner_optimizer._all_reduce_sum_gradients(list(zip(grads, variables)))]
            with gradient_exchange.reduced_already():
                return original(self, reduced, trainable_variables)

        return _tf_apply

    cls = _compat.keras3_loss_scale_optimizer(HOOK)
    _compat.require_methods(cls, ["_tf_apply", "check_finite"], HOOK)
    _compat.patch_method(cls, "_tf_apply", wrap, HOOK)
    _compat.patch_method(cls, "check_finite", wrap_check, HOOK)
    _installed = True


def _under_horovod():
    from tfdist.keras.recognise import is_tfdist_strategy

    return is_tfdist_strategy(tf.distribute.get_strategy()) and collectives.size() > 1
