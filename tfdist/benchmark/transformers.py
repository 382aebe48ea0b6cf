"""Transformer language models for tfdist-benchmark, in plain Keras (either flavour), built from a config.

    from tfdist.keras.flavour import keras_module
    model = build(keras_module(), "gpt_mini", seq_len=128)        # logits [batch, seq_len, vocabulary]
    flops = train_flops_per_token("gpt_mini", seq_len=128)

No weights are loaded and no KerasHub is needed, so the same model runs on Keras 3 and tf-keras, in
every mode (Horovod's own loop and MWMS run tf-keras):

- gpt2_small: GPT-2 small's shape: 12 pre-norm decoder blocks, width 768, 12 heads, vocabulary
  50257, causal attention; positions up to --seq_len (GPT-2 has 1024).
- gpt_mini: the same architecture at 4 blocks, width 256, 4 heads, vocabulary 8192.
- bert_mini: BERT's encoder at that size: bidirectional attention, token, position and segment
  embeddings (the first half of each sequence segment 0, the rest 1: a 2-row table whose gradient
  is sparse, as BERT's is), a prediction over the vocabulary at every position.

Inputs are int32 token ids [batch, seq_len]; labels are int32 ids of the same shape (the
benchmark's synthetic ones are random). Every model ends in a float32 softmax.
"""

CONFIGS = {
    "gpt2_small": {"blocks": 12, "width": 768, "heads": 12, "vocabulary": 50257, "causal": True},
    "gpt_mini": {"blocks": 4, "width": 256, "heads": 4, "vocabulary": 8192, "causal": True},
    "bert_mini": {"blocks": 4, "width": 256, "heads": 4, "vocabulary": 8192, "causal": False, "segments": 2},
}
FFN_FACTOR = 4


def is_token_model(name):
    """Whether --model `name` is one of these (token ids in, per-token labels) rather than an image model."""
    return name in CONFIGS


def train_flops_per_token(name, seq_len):
    """Model FLOPs of one training token: 3x the forward pass's matmuls (forward, two for backward).

    Forward per token: 2 FLOPs per weight of every matmul (attention's 4 projections, the two
    feed-forward layers, the output projection over the vocabulary) and 4 x seq_len x width per
    block for the attention scores and their weighted sum, computed over the whole sequence (Keras
    masks causal attention, it does not skip it). Embedding lookups, norms and softmax not counted.
    """
    c = CONFIGS[name]
    return 3 * (2 * matmul_weights(name) + 4 * c["blocks"] * seq_len * c["width"])


def matmul_weights(name):
    """The weights of every matmul a token goes through: attention's query, key, value and output
    kernels, the feed-forward kernels and the output projection (no biases, no embeddings)."""
    c = CONFIGS[name]
    width = c["width"]
    return c["blocks"] * (4 + 2 * FFN_FACTOR) * width * width + width * c["vocabulary"]


def build(keras, name, seq_len):
    """The uncompiled model `name` (a key of CONFIGS) for sequences of `seq_len` tokens."""
    from tfdist.precision import float32_softmax

    c = CONFIGS[name]
    layers = keras.layers
    ids = keras.Input((seq_len,), dtype="int32", name="token_ids")
    x = layers.Embedding(c["vocabulary"], c["width"], name="token_embedding")(ids)
    x = _position_and_segment(keras)(seq_len, c["width"], c.get("segments", 0), name="position_embedding")(x)
    for block in range(c["blocks"]):
        h = layers.LayerNormalization(epsilon=1e-5, name=f"block{block}_norm1")(x)
        h = layers.MultiHeadAttention(c["heads"], c["width"] // c["heads"], name=f"block{block}_attention")(
            h, h, use_causal_mask=c["causal"])
        x = layers.Add(name=f"block{block}_residual1")([x, h])
        h = layers.LayerNormalization(epsilon=1e-5, name=f"block{block}_norm2")(x)
        h = layers.Dense(FFN_FACTOR * c["width"], activation="gelu", name=f"block{block}_ffn1")(h)
        h = layers.Dense(c["width"], name=f"block{block}_ffn2")(h)
        x = layers.Add(name=f"block{block}_residual2")([x, h])
    x = layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    logits = layers.Dense(c["vocabulary"], name="output_projection")(x)
    return float32_softmax(keras.Model(ids, logits, name=name))


def synthetic_tokens(batch_size, seq_len, vocabulary, seed=0):
    """An infinite dataset repeating one random batch of (token ids, label ids), both int32 [batch, seq_len]."""
    import tensorflow as tf

    generator = tf.random.Generator.from_seed(seed)
    ids = generator.uniform((batch_size, seq_len), 0, vocabulary, dtype=tf.int32)
    labels = generator.uniform((batch_size, seq_len), 0, vocabulary, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((ids, labels)).repeat()


def _position_and_segment(keras):
    class PositionAndSegment(keras.layers.Layer):
        """Adds a learned position embedding and, with `segments`, a segment embedding (half 0, half 1)."""

        def __init__(self, seq_len, width, segments, **kwargs):
            super().__init__(**kwargs)
            self.seq_len, self.width, self.segments = seq_len, width, segments

        def build(self, input_shape):
            self.positions = self.add_weight(name="positions", shape=(self.seq_len, self.width),
                                             initializer="random_normal")
            if self.segments:
                self.segment_table = self.add_weight(name="segments", shape=(self.segments, self.width),
                                                     initializer="random_normal")

        def call(self, x):
            import tensorflow as tf

            x = x + tf.cast(self.positions, x.dtype)
            if self.segments:
                ids = tf.cast(tf.range(self.seq_len) >= self.seq_len // 2, tf.int32)
                x = x + tf.cast(tf.gather(self.segment_table, ids), x.dtype)  # a sparse gradient, as BERT's
            return x

    return PositionAndSegment
