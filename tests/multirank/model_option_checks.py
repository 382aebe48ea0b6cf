"""Today's models under every exchange option, as their users write them: KerasHub's BERT classifier
and GPT-2 causal LM (small configs, no weights; Keras 3 only), a two-tower recommender with two
large embedding tables (sparse tf.IndexedSlices gradients; both flavours) and TensorFlow
Recommenders' retrieval model (tf-keras; with tensorflow-recommenders installed).

    horovodrun -np 2 python tests/multirank/model_option_checks.py --out DIR
    python tests/multirank/model_option_checks.py --out DIR --reference     # 1 process, plain Keras

Each model trains one epoch at global batch 16 under HorovodStrategy() with each option in
OPTIONS (TFRS's: ONLY_OPTIONS), compiled as COMPILE says for it (or, with --reference, with no
strategy and Keras' defaults, also writing DIR/<model>.initial.rank0.npz). TFRS's reference is
MirroredStrategy over 2 logical CPUs in one process: its in-batch negatives are each replica's,
under every strategy, so one process at the global batch is not what 2 replicas compute; with
every replica's candidates gathered (tfrs_global) it is, and the reference is one process again.
Each rank writes DIR/<model>.<option>.rank<R>.npz (the final weights) and DIR/rank<R>.json: per
case the steps, the calls of the step function (the batch-end hook's) and the optimizer's state
bytes on this rank.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402

keras = keras_module()
KERAS3 = keras.__name__ == "keras"

OPTIONS = {"default": {}, "sharded": {"shard_optimizer_state": True}, "one_group": {"bucket_mb": 0},
           "buckets": {"bucket_mb": 1}, "bf16": {"compression": "bf16"}, "two_per_call": {}}
COMPILE = {"two_per_call": {"steps_per_execution": 2}}  # Keras' remedy for per-step Python, as users set it
ONLY_OPTIONS = {"tfrs": ("default", "sharded", "two_per_call"), "tfrs_global": ("default",)}  # the rest: two_tower's
EXAMPLES, GLOBAL_BATCH, SEQUENCE, VOCABULARY, TABLE = 64, 16, 8, 100, 50_000


def adamw():
    """AdamW as KerasHub's fine-tuning guides write it: decay excluded for biases and norms, clipped."""
    optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.01, global_clipnorm=1.0)
    optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    return optimizer


def bert():
    import keras_hub

    backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, dropout=0.0, max_sequence_length=SEQUENCE)
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None, dropout=0.0)
    rng = np.random.default_rng(1)
    x = {"token_ids": rng.integers(0, VOCABULARY, (EXAMPLES, SEQUENCE)).astype("int32"),
         "segment_ids": (np.arange(SEQUENCE) >= SEQUENCE // 2).astype("int32")[None].repeat(EXAMPLES, 0),
         "padding_mask": np.ones((EXAMPLES, SEQUENCE), "int32")}
    return model, adamw(), keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, rng.integers(0, 2, EXAMPLES)


def gpt2():
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, dropout=0.0, max_sequence_length=SEQUENCE)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    tokens = np.random.default_rng(2).integers(0, VOCABULARY, (EXAMPLES, SEQUENCE + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((EXAMPLES, SEQUENCE), "int32")}
    return model, adamw(), keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, tokens[:, 1:]


def two_tower():
    """A context Dense first, then two Embedding(TABLE, 16) towers: dense and sparse gradients mixed."""
    context = keras.Input((4,), name="context")
    user, item = keras.Input((1,), dtype="int32", name="user"), keras.Input((1,), dtype="int32", name="item")
    c = keras.layers.Dense(8, activation="relu")(context)
    u = keras.layers.Flatten()(keras.layers.Embedding(TABLE, 16)(user))
    i = keras.layers.Flatten()(keras.layers.Embedding(TABLE, 16)(item))
    u = keras.layers.Dense(16)(keras.layers.Concatenate()([u, c]))
    model = keras.Model([context, user, item], keras.layers.Dot(axes=1)([u, i]))
    rng = np.random.default_rng(3)
    hot = rng.integers(0, TABLE, 40)  # popular ids: repeated within every batch, as in real traffic
    x = [rng.normal(size=(EXAMPLES, 4)).astype("float32"), hot[rng.integers(0, 40, (EXAMPLES, 1))],
         rng.integers(0, TABLE, (EXAMPLES, 1))]
    return model, keras.optimizers.Adam(0.01), keras.losses.BinaryCrossentropy(from_logits=True), x, \
        rng.integers(0, 2, (EXAMPLES, 1)).astype("float32")


def tfrs(global_negatives=False):
    """TFRS's retrieval model as its tutorial writes it: two towers meeting in tfrs.tasks.Retrieval.
    With `global_negatives`, LIMITS.md's recipe instead: every replica's candidates gathered, so each
    query meets the global batch's, as in one process."""
    import tensorflow as tf
    import tensorflow_recommenders as tfrs

    class Retrieval(tfrs.Model):
        def __init__(self):
            super().__init__()
            self.users = keras.Sequential([keras.layers.Embedding(500, 16), keras.layers.Dense(16)])
            self.items = keras.layers.Embedding(TABLE, 16)  # sparse gradients beside the users' dense ones
            self.task = tfrs.tasks.Retrieval()
            self.softmax = keras.losses.CategoricalCrossentropy(from_logits=True, reduction="sum")  # Retrieval's
            self.users.build((None,))
            self.items.build((None,))

        def compute_loss(self, inputs, training=False):
            features = inputs[0] if isinstance(inputs, tuple) else inputs  # fit(x) hands over (x,)
            queries, candidates = self.users(features["user"]), self.items(features["item"])
            if not global_negatives:
                return self.task(queries, candidates)
            context = tf.distribute.get_replica_context()
            everyone = context.all_gather(candidates, axis=0)  # replicas in order, equal batches
            first = tf.cast(context.replica_id_in_sync_group, tf.int32) * tf.shape(queries)[0]
            labels = tf.one_hot(first + tf.range(tf.shape(queries)[0]), tf.shape(everyone)[0])
            return self.softmax(labels, tf.matmul(queries, everyone, transpose_b=True))

    rng = np.random.default_rng(4)
    x = {"user": rng.integers(0, 500, EXAMPLES).astype("int32"), "item": rng.integers(0, TABLE, EXAMPLES).astype("int32")}
    return Retrieval(), keras.optimizers.Adagrad(0.1), None, x, None


def has_tfrs():
    import importlib.util

    return importlib.util.find_spec("tensorflow_recommenders") is not None


MODELS = {"bert": bert, "gpt2": gpt2, "two_tower": two_tower} if KERAS3 else \
    {"two_tower": two_tower, **({"tfrs": tfrs, "tfrs_global": lambda: tfrs(global_negatives=True)} if has_tfrs() else {})}


def train(name, strategy, seed, out=None, option=None):
    """`name`'s model trained one epoch under `strategy` (`out`: its initial weights saved there first),
    compiled with `option`'s COMPILE arguments."""
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model, optimizer, loss, x, y = MODELS[name]()
        model.compile(optimizer=optimizer, loss=loss, **COMPILE.get(option, {}))
    if out is not None:
        np.savez(os.path.join(out, f"{name}.initial.rank0.npz"), *[np.asarray(w) for w in model.weights])
    calls = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: calls.ends.append(batch))
    calls.ends = []  # Keras calls the batch-end hook once a call of the step function
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[calls])
    state = sum(np.asarray(v).nbytes for v in model.optimizer.variables)
    return model, {"steps": int(np.asarray(model.optimizer.iterations)), "calls": len(calls.ends), "state_bytes": state}


def repeated_rows_sent(strategy):
    """What the optimizer's gradient sum makes of a tf.IndexedSlices whose rows repeat: entries and dense value."""
    import tensorflow as tf

    with strategy.scope():
        table = tf.Variable(tf.zeros([5, 2]))
    rank = strategy.rank
    rows = tf.IndexedSlices(tf.fill([6, 2], float(rank + 1)), tf.constant([1, 1, 2, 2, 2, 3 + rank]),
                            tf.constant([5, 2]))
    summed = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(rows, table)])[0]
    return {"entries": int(summed.values.shape[0]), "dense": tf.convert_to_tensor(summed).numpy().tolist()}


def main():
    args = worker_parser(reference=True).parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.reference:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # TFRS's: 2 replicas, in-batch negatives each
        cases = {(name, "reference"): train(name, mirrored if name == "tfrs" else tf.distribute.get_strategy(), 100,
                                            args.out) for name in MODELS}
        rank = 0
    else:
        import tfdist

        strategies = {option: tfdist.HorovodStrategy(tuning=False, **kwargs) for option, kwargs in OPTIONS.items()}
        rank = strategies["default"].rank
        cases = {(name, option): train(name, strategy, seed=100 + rank, option=option)  # the broadcast aligns ranks
                 for name in MODELS for option, strategy in strategies.items() if option in ONLY_OPTIONS.get(name, OPTIONS)}
    results = {}
    for (name, option), (model, facts) in cases.items():
        np.savez(os.path.join(args.out, f"{name}.{option}.rank{rank}.npz"),
                 *[np.asarray(w) for w in model.weights])
        results[f"{name}.{option}"] = facts
    if not args.reference:
        results["repeated_rows"] = repeated_rows_sent(strategies["default"])
    write_results(args.out, rank, results)


if __name__ == "__main__":
    main()
