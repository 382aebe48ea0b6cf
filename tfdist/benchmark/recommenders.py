"""Recommenders for tfdist-benchmark: a two-tower model in plain Keras (either flavour) over large
embedding tables, and TensorFlow Recommenders' retrieval model (tf-keras).

    from tfdist.keras.flavour import keras_module
    model = build(keras_module(), "two_tower")      # (user ids, item ids) -> click probabilities [batch, 2]
    ds = synthetic_ids(batch_size=256, rows=CONFIGS["two_tower"]["rows"])

- two_tower: a user and an item table, `Embedding(200_000, 64)` each (12.8 M parameters a table, 51 MB
  of float32), each followed by its tower, `Dense(64, relu)`; the towers' product goes through
  `Dense(2)` to a click/no-click softmax. Its step is short and its gradients mostly sparse: each
  table's gradient is a `tf.IndexedSlices` of the batch's rows, beside the towers' dense kernels.
- tfrs_retrieval: the TFRS basic retrieval tutorial's model at MovieLens 100K's scale: a
  `tfrs.Model` whose user (943) and movie (1682) embeddings of 32 meet in `tfrs.tasks.Retrieval`
  (a softmax over the batch's movies: the other examples' are the negatives), no top-K metric. It
  takes the same (user, item) ids as positive pairs and ignores the click label. Under a
  strategy the negatives are those of the replica's batch, as under MirroredStrategy and MWMS.
  Needs tensorflow-recommenders (`pip install --no-deps tensorflow-recommenders`: its requirement
  `tensorflow` would add the full TensorFlow beside tensorflow-cpu) and tf-keras.

The synthetic ids follow real traffic's skew: half the users of a batch come from 64 popular ids
(rows repeat within a batch), the items are uniform over the table. As in real traffic, batches
differ, and so does the count of distinct rows a table's gradient holds: the dataset cycles through
BATCHES batches made once.
"""

CONFIGS = {"two_tower": {"rows": 200_000, "width": 64},
           "tfrs_retrieval": {"rows": 1682, "user_rows": 943, "width": 32}}
POPULAR_USERS = 64
BATCHES = 64


def is_id_model(name):
    """Whether --model `name` is one of these ((user, item) ids in, a click label out)."""
    return name in CONFIGS


def build(keras, name):
    """The uncompiled model `name` (a key of CONFIGS)."""
    from tfdist.precision import float32_softmax

    c = CONFIGS[name]
    if name == "tfrs_retrieval":
        return _tfrs_retrieval(keras, c)
    layers = keras.layers
    user = keras.Input((1,), dtype="int32", name="user_id")
    item = keras.Input((1,), dtype="int32", name="item_id")
    towers = []
    for side, ids in (("user", user), ("item", item)):
        vector = layers.Flatten()(layers.Embedding(c["rows"], c["width"], name=f"{side}_table")(ids))
        towers.append(layers.Dense(c["width"], activation="relu", name=f"{side}_tower")(vector))
    logits = layers.Dense(2, name="click")(layers.Multiply()(towers))
    return float32_softmax(keras.Model([user, item], logits, name=name))


def _tfrs_retrieval(keras, c):
    try:
        import tensorflow_recommenders as tfrs
    except ImportError:
        raise SystemExit("--model tfrs_retrieval needs tensorflow-recommenders: pip install --no-deps "
                         "tensorflow-recommenders (with deps it pulls the full tensorflow beside tensorflow-cpu)") from None

    class Retrieval(tfrs.Model):
        def __init__(self):
            super().__init__(name="tfrs_retrieval")
            self.users = keras.layers.Embedding(c["user_rows"], c["width"], name="user_embedding")
            self.items = keras.layers.Embedding(c["rows"], c["width"], name="movie_embedding")
            self.task = tfrs.tasks.Retrieval()

        def compute_loss(self, inputs, training=False):
            (users, items), _ = inputs  # the pairs are the positives; the click label is not used
            return self.task(self.users(users[:, 0]), self.items(items[:, 0]))

    return Retrieval()


def synthetic_ids(batch_size, rows, seed=0, user_rows=None):
    """An infinite dataset cycling through BATCHES random batches of ((user ids, item ids), click labels),
    int32; users from `user_rows` ids (default: `rows`)."""
    import tensorflow as tf

    generator = tf.random.Generator.from_seed(seed)
    user_rows = user_rows or rows
    popular = generator.uniform((POPULAR_USERS,), 0, user_rows, dtype=tf.int32)
    shape = (BATCHES, batch_size, 1)
    any_user = generator.uniform(shape, 0, user_rows, dtype=tf.int32)
    popular_user = tf.gather(popular, generator.uniform(shape, 0, POPULAR_USERS, dtype=tf.int32))
    users = tf.where(tf.range(batch_size)[None, :, None] % 2 == 0, popular_user, any_user)
    items = generator.uniform(shape, 0, rows, dtype=tf.int32)
    labels = generator.uniform(shape, 0, 2, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices(((users, items), labels)).repeat()
