"""The Keras flavour callbacks build on (see tfdist.keras.flavour)."""

from tfdist.keras.flavour import keras_module

Callback = keras_module().callbacks.Callback
