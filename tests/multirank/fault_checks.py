"""Misuse that must fail loudly on every rank instead of hanging; one horovodrun launch.

    horovodrun -np 2 --gloo python tests/multirank/fault_checks.py --out DIR

Checks:
  - jit_compile=True with a Horovod allreduce raises XlaNotSupportedError;
  - ranks building different models raise RankMismatchError naming the variable.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, write_results  # noqa: E402

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402

keras = keras_module()


def outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return {"error": type(e).__name__, "message": str(e)[:2000]}
    return {"error": None}


def jit_check(strategy):
    def run():
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        x = np.ones((8, 3), "float32")
        model.fit(x, np.ones((8, 2), "float32"), batch_size=4, epochs=1, verbose=0)

    return outcome(run)


def mismatch_check(strategy):
    def run():
        with strategy.scope():
            units = 4 if strategy.rank == 0 else 5
            keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)])

    return outcome(run)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy()
    results = {
        "jit": jit_check(strategy),
        "mismatch": mismatch_check(strategy),
    }
    write_results(args.out, strategy.rank, results)


if __name__ == "__main__":
    main()
