"""Which Keras is in use: tf-keras when TF_USE_LEGACY_KERAS=1 (as TensorFlow decides), else Keras 3."""

import os

from tfdist.errors import KerasHookError


def legacy_requested():
    return os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")


def keras_module():
    if legacy_requested():
        try:
            import tf_keras
        except ImportError as e:
            raise KerasHookError(
                f"TF_USE_LEGACY_KERAS={os.environ['TF_USE_LEGACY_KERAS']} asks for tf-keras, which is not "
                f"installed ({e}). Ray Train sets TF_USE_LEGACY_KERAS=1 on every TensorflowTrainer worker. "
                "Fix: install tf-keras (`pip install tf-keras`, or tfdist[legacy]) to train on tf-keras, or, "
                "for Keras 3, set TF_USE_LEGACY_KERAS=0 (under Ray: `os.environ[\"TF_USE_LEGACY_KERAS\"] = "
                "\"0\"` first in the train function, and `import keras`; docs/LAUNCH.md#ray-train)") from None
        return tf_keras
    import keras

    return keras
