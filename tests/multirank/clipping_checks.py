"""Gradient clipping across ranks: each optimizer setting trained on N ranks and in one process.

    horovodrun -np 2 --gloo python tests/multirank/clipping_checks.py --out DIR
    python tests/multirank/clipping_checks.py --out DIR --reference   # one process, no strategy

Every case fits the same model on the same data at the same global batch for 2 epochs; each rank
(or the reference process) writes its final weights per case. tests/test_clipping.py compares
them with the one-process reference; the reference also trains each optimizer unclipped (the
clip must matter). On ranks the job also runs bf16_checks.exchange_checks() (bfloat16 allreduces
against numpy: this is the suite's 4-rank Gloo launch), written under "bf16_exchange", and
reducescatter_checks.reducescatter_checks() (Horovod's reduce-scatter), under "reducescatter".
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402

keras = keras_module()
GLOBAL_BATCH, EXAMPLES, EPOCHS = 32, 256, 2
# name -> (optimizer from its clip setting, the clip setting)
CASES = {
    "clipnorm": (lambda clip: keras.optimizers.Adam(0.01, **clip), {"clipnorm": 0.05}),
    "global_clipnorm": (lambda clip: keras.optimizers.SGD(0.1, **clip), {"global_clipnorm": 0.05}),
    "clipvalue": (lambda clip: keras.optimizers.SGD(0.1, **clip), {"clipvalue": 0.01}),
    "global_clipnorm_loss_scaled": (
        lambda clip: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1, **clip)),
        {"global_clipnorm": 0.05}),
    "global_clipnorm_accumulated": (
        lambda clip: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2, **clip), {"global_clipnorm": 0.05}),
}


def train(make_optimizer, strategy):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(EXAMPLES, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) * 3).astype("float32")  # large gradients: every clip engages
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=make_optimizer(), loss="mse")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return [np.asarray(w).tolist() for w in model.weights]


def main():
    args = worker_parser(reference=True).parse_args()
    if args.reference:
        import tensorflow as tf

        strategy, rank = tf.distribute.get_strategy(), 0
    else:
        import tfdist

        strategy = tfdist.HorovodStrategy(tuning=False)
        rank = strategy.rank
    results = {name: train(lambda: make(clip), strategy) for name, (make, clip) in CASES.items()}
    if args.reference:  # the same optimizers unclipped: the clip must change the result
        results.update({f"{name} unclipped": train(lambda: make({}), strategy) for name, (make, _) in CASES.items()})
    else:
        import bf16_checks
        import reducescatter_checks

        results["bf16_exchange"] = bf16_checks.exchange_checks()
        results["reducescatter"] = reducescatter_checks.reducescatter_checks()
    write_results(args.out, rank, results)


if __name__ == "__main__":
    main()
