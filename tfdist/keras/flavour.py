"""Which Keras is in use: tf-keras when TF_USE_LEGACY_KERAS=1 (as TensorFlow decides), else Keras 3."""

import os


def legacy_requested():
    return os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")


def keras_module():
    if legacy_requested():
        import tf_keras

        return tf_keras
    import keras

    return keras
