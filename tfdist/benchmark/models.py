"""Models for tfdist-benchmark (tfdist.benchmark.train_benchmark), built with whichever Keras module is passed in.

    from tfdist.keras.flavour import keras_module
    model = build_model(keras_module(), "resnet50_v1.5", image_size=224, num_classes=1000)

- resnet50: `keras.applications.ResNet50` (v1: the stride-2 of each stage sits in its first 1x1 conv).
- resnet50_v1.5: the variant tf_cnn_benchmarks, NVIDIA and MLPerf train: the stride sits in the 3x3
  conv, which costs about 5% more FLOPs and gains about 0.5% top-1.
- resnet20: the CIFAR ResNet of He et al. (2015) that tf_cnn_benchmarks also has: a 3x3 stem of 16
  filters, three stages of 3 basic blocks (16, 32, 64 filters), 0.27 M parameters; small inputs.
- mnist_cnn: the classic Keras MNIST CNN (two convs, max-pool, dropout, two dense layers).
- trivial: flatten + dense, to measure the input pipeline and framework overhead.
- gpt2_small, gpt_mini, bert_mini: transformer language models on token ids
  (`tfdist.benchmark.transformers`); the benchmark reports tokens/s and model FLOPs for them.
- two_tower: a recommender over two Embedding(200_000, 64) tables (`tfdist.benchmark.recommenders`):
  a short step whose gradients are mostly sparse.
- tfrs_retrieval: TensorFlow Recommenders' retrieval model (tf-keras; tensorflow-recommenders
  installed), in-batch softmax over MovieLens 100K-sized embeddings (`tfdist.benchmark.recommenders`).

Every model but tfrs_retrieval (whose loss is TFRS's) ends in a float32 softmax
(`tfdist.precision.float32_softmax`), so mixed precision keeps the loss in float32.
"""

from tfdist.benchmark import recommenders, transformers

MODELS = ("resnet50", "resnet50_v1.5", "resnet20", "mnist_cnn", "trivial", *transformers.CONFIGS,
          *recommenders.CONFIGS)


def model_name(name):
    """Argparse type for --model: a name in MODELS or `module:function`, checked before TensorFlow loads."""
    import argparse
    import difflib

    module, colon, function = name.partition(":")
    if name in MODELS or (colon and module and function.isidentifier()):
        return name
    close = difflib.get_close_matches(name, MODELS, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise argparse.ArgumentTypeError(
        f"unknown model {name!r}: {hint}known models: {', '.join(MODELS)}; or give your own as "
        "module:function (a function of (image_size, num_classes) returning an uncompiled Keras model)")


def synthetic_only(name):
    """Whether model `name` trains on synthetic inputs only (no --data_dir of images)."""
    return transformers.is_token_model(name) or recommenders.is_id_model(name)


def synthetic_input(name, batch_size, seq_len):
    """(dataset, description) of the synthetic input of a model that takes no images; None for image models."""
    if transformers.is_token_model(name):
        vocabulary = transformers.CONFIGS[name]["vocabulary"]
        return transformers.synthetic_tokens(batch_size, seq_len, vocabulary), synthetic_description(name)
    if recommenders.is_id_model(name):
        config = recommenders.CONFIGS[name]
        return (recommenders.synthetic_ids(batch_size, config["rows"], user_rows=config.get("user_rows")),
                synthetic_description(name))
    return None


def training_loss(keras, name):
    """The loss that loops outside fit minimise for model `name`: a function of (model, features, labels)."""
    if name == "tfrs_retrieval":  # TFRS computes its loss from the inputs, in compute_loss
        return lambda model, features, labels: model.compute_loss((features, labels), training=True)
    loss = keras.losses.SparseCategoricalCrossentropy()
    return lambda model, features, labels: loss(labels, model(features, training=True))


def synthetic_description(name):
    """What the synthetic input of model `name` is, as the benchmark's header says."""
    if transformers.is_token_model(name):
        return "synthetic tokens (one batch made once, no I/O)"
    if recommenders.is_id_model(name):
        return f"synthetic ids ({recommenders.BATCHES} batches made once, cycled, no I/O)"
    return "synthetic (one batch made once, no I/O)"


def build_model(keras, name, image_size, num_classes, seq_len=128):
    from tfdist.precision import float32_softmax

    if transformers.is_token_model(name):
        return transformers.build(keras, name, seq_len)
    if recommenders.is_id_model(name):
        return recommenders.build(keras, name)
    shape = (image_size, image_size, 3)
    if ":" in name:  # the user's own model: module:function(image_size, num_classes)
        import importlib

        module, _, function = name.partition(":")
        logits = getattr(importlib.import_module(module), function)(image_size, num_classes)
    elif name == "resnet50":
        logits = keras.applications.ResNet50(weights=None, input_shape=shape, classes=num_classes,
                                             classifier_activation=None)
    elif name == "resnet50_v1.5":
        logits = resnet50_v15(keras, shape, num_classes)
    elif name == "resnet20":
        logits = resnet20(keras, shape, num_classes)
    elif name == "mnist_cnn":
        logits = keras.Sequential([
            keras.Input(shape),
            keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2), keras.layers.Dropout(0.25), keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"), keras.layers.Dropout(0.5),
            keras.layers.Dense(num_classes),
        ])
    elif name == "trivial":
        logits = keras.Sequential([keras.Input(shape), keras.layers.Flatten(), keras.layers.Dense(num_classes)])
    else:
        raise ValueError(f"unknown --model {name!r}; expected one of {MODELS}")
    return float32_softmax(logits)


def _conv_bn(layers, x, filters, kernel, stride=1, relu=True, name=""):
    x = layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False,
                      kernel_initializer="he_normal", name=name + "_conv")(x)
    x = layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=name + "_bn")(x)
    return layers.Activation("relu", name=name + "_relu")(x) if relu else x


def resnet50_v15(keras, input_shape, num_classes):
    """ResNet50 v1.5 returning logits: bottleneck blocks [3, 4, 6, 3], stride in the 3x3 conv."""
    layers = keras.layers

    def bottleneck(x, filters, stride, project, name):
        shortcut = _conv_bn(layers, x, 4 * filters, 1, stride, relu=False, name=name + "_proj") if project else x
        y = _conv_bn(layers, x, filters, 1, name=name + "_1")
        y = _conv_bn(layers, y, filters, 3, stride, name=name + "_2")
        y = _conv_bn(layers, y, 4 * filters, 1, relu=False, name=name + "_3")
        return layers.Activation("relu", name=name + "_out")(layers.Add(name=name + "_add")([shortcut, y]))

    inputs = keras.Input(input_shape)
    x = _conv_bn(layers, inputs, 64, 7, 2, name="stem")
    x = layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool")(x)
    for stage, (filters, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=2):
        for block in range(blocks):
            stride = 2 if block == 0 and stage > 2 else 1
            x = bottleneck(x, filters, stride, project=block == 0, name=f"conv{stage}_block{block + 1}")
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    logits = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, logits, name="resnet50_v1_5")


def resnet20(keras, input_shape, num_classes):
    """ResNet-20 for small images, returning logits: basic blocks [3, 3, 3] of 16, 32 and 64 filters;
    a block that halves the size projects its shortcut (1x1 conv and BatchNorm)."""
    layers = keras.layers
    inputs = keras.Input(input_shape)
    x = _conv_bn(layers, inputs, 16, 3, name="stem")
    for stage, filters in enumerate((16, 32, 64), start=1):
        for block in range(3):
            name, stride = f"stage{stage}_block{block + 1}", 2 if block == 0 and stage > 1 else 1
            shortcut = _conv_bn(layers, x, filters, 1, stride, relu=False, name=name + "_proj") if stride > 1 else x
            y = _conv_bn(layers, x, filters, 3, stride, name=name + "_1")
            y = _conv_bn(layers, y, filters, 3, relu=False, name=name + "_2")
            x = layers.Activation("relu", name=name + "_out")(layers.Add(name=name + "_add")([shortcut, y]))
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    return keras.Model(inputs, layers.Dense(num_classes, name="logits")(x), name="resnet20")
