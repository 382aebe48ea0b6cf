"""A wide MLP whose gradients (about 134 MB in float32) make communication, not compute, the cost.

    tfdist-benchmark --model mlp:wide_mlp --image_size 32     # with scripts/benchmarks/multihost on sys.path

Input: the synthetic images flattened (32x32x3 = 3,072 values); `depth` dense layers of `width`
units with ReLU, then the logits. Defaults: 7 x 2,048 = 33.5 M parameters. TFDIST_MLP_WIDTH and
TFDIST_MLP_DEPTH change them (the benchmark records the gradient bytes it measured).
"""

import os


def wide_mlp(image_size, num_classes):
    from tfdist.keras.flavour import keras_module

    keras = keras_module()
    width = int(os.environ.get("TFDIST_MLP_WIDTH", 2048))
    depth = int(os.environ.get("TFDIST_MLP_DEPTH", 7))
    layers = [keras.Input((image_size, image_size, 3)), keras.layers.Flatten()]
    layers += [keras.layers.Dense(width, activation="relu", name=f"dense{i}") for i in range(depth)]
    return keras.Sequential(layers + [keras.layers.Dense(num_classes, name="logits")], name="wide_mlp")
