"""The Keras flavour callbacks build on (see tfdist.keras_flavour)."""

from tfdist.keras_flavour import keras_module

Callback = keras_module().callbacks.Callback
