"""A two-tower recommender for tfdist-benchmark, in plain Keras (either flavour): large embedding tables.

    from tfdist.keras.flavour import keras_module
    model = build(keras_module(), "two_tower")      # (user ids, item ids) -> click probabilities [batch, 2]
    ds = synthetic_ids(batch_size=256, rows=CONFIGS["two_tower"]["rows"])

- two_tower: a user and an item table, `Embedding(200_000, 64)` each (12.8 M parameters a table, 51 MB
  of float32), each followed by its tower, `Dense(64, relu)`; the towers' product goes through
  `Dense(2)` to a click/no-click softmax. Its step is short and its gradients mostly sparse: each
  table's gradient is a `tf.IndexedSlices` of the batch's rows, beside the towers' dense kernels.

The synthetic ids follow real traffic's skew: half the users of a batch come from 64 popular ids
(rows repeat within a batch), the items are uniform over the table. As in real traffic, batches
differ, and so does the count of distinct rows a table's gradient holds: the dataset cycles through
BATCHES batches made once.
"""

CONFIGS = {"two_tower": {"rows": 200_000, "width": 64}}
POPULAR_USERS = 64
BATCHES = 64


def is_id_model(name):
    """Whether --model `name` is one of these ((user, item) ids in, a click label out)."""
    return name in CONFIGS


def build(keras, name):
    """The uncompiled model `name` (a key of CONFIGS)."""
    from tfdist.precision import float32_softmax

    c = CONFIGS[name]
    layers = keras.layers
    user = keras.Input((1,), dtype="int32", name="user_id")
    item = keras.Input((1,), dtype="int32", name="item_id")
    towers = []
    for side, ids in (("user", user), ("item", item)):
        vector = layers.Flatten()(layers.Embedding(c["rows"], c["width"], name=f"{side}_table")(ids))
        towers.append(layers.Dense(c["width"], activation="relu", name=f"{side}_tower")(vector))
    logits = layers.Dense(2, name="click")(layers.Multiply()(towers))
    return float32_softmax(keras.Model([user, item], logits, name=name))


def synthetic_ids(batch_size, rows, seed=0):
    """An infinite dataset cycling through BATCHES random batches of ((user ids, item ids), click labels), int32."""
    import tensorflow as tf

    generator = tf.random.Generator.from_seed(seed)
    popular = generator.uniform((POPULAR_USERS,), 0, rows, dtype=tf.int32)
    shape = (BATCHES, batch_size, 1)
    any_user = generator.uniform(shape, 0, rows, dtype=tf.int32)
    popular_user = tf.gather(popular, generator.uniform(shape, 0, POPULAR_USERS, dtype=tf.int32))
    users = tf.where(tf.range(batch_size)[None, :, None] % 2 == 0, popular_user, any_user)
    items = generator.uniform(shape, 0, rows, dtype=tf.int32)
    labels = generator.uniform(shape, 0, 2, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices(((users, items), labels)).repeat()
