"""The Keras flavour in use: tf-keras when TF_USE_LEGACY_KERAS=1 (as TensorFlow decides), else Keras 3."""

import os


def keras_module():
    if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true"):
        import tf_keras

        return tf_keras
    import keras

    return keras


Callback = keras_module().callbacks.Callback
