"""Misuse that must fail loudly on every rank instead of hanging; one horovodrun launch.

    horovodrun -np 2 --gloo python tests/multirank/fault_checks.py --out DIR [--checks a,b,...]

Checks (default: jit,mismatch):
  - jit: a Horovod allreduce compiled by XLA where tfdist cannot compile around it
    (`experimental_get_compiler_ir` of a jit_compile=True function) raises XlaNotSupportedError;
  - mismatch: ranks building different models raise RankMismatchError naming the variable;
  - consistency: ranks that differ in main script, fingerprint, per-rank batch size, element
    structure or dataset manifest raise RankMismatchError naming the difference; identical
    setups (datasets staged at different paths included) pass;
  - nonfinite: a NaN on rank 1 only, at step 5, stops both ranks at step 5 naming rank 1
    (StopOnNonFiniteLoss "stop" and "raise");
  - watchdog_port: rank 0 cannot listen (port taken, port not a number or out of range, unknown
    host): every rank gets the same WatchdogError, then a good address works. Run it with
    TFDIST_WATCHDOG_TIMEOUT=0, so that HorovodStrategy starts no watchdog of its own.
"""

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import keras_module, quiet_tensorflow, worker_parser, write_results  # noqa: E402

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
    @tf.function(jit_compile=True)
    def summed(x):
        return tfdist.collectives.allreduce([x], op="sum")[0]

    return outcome(lambda: summed.experimental_get_compiler_ir(tf.ones(2))())


def mismatch_check(strategy):
    def run():
        with strategy.scope():
            units = 4 if strategy.rank == 0 else 5
            keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)])

    return outcome(run)


def consistency_checks(strategy, out):
    from tfdist.pipelines import read_dataset, write_arrays

    rank = strategy.rank
    results = {}

    def script():
        original = sys.argv[0]
        if rank == 1:
            changed = os.path.join(out, "changed_script.py")
            with open(original) as f:
                text = f.read()
            with open(changed, "w") as f:
                f.write(text + "\n# changed on rank 1\n")
            sys.argv[0] = changed
        try:
            tfdist.HorovodStrategy(tuning=False)
        finally:
            sys.argv[0] = original

    def arrays(features, rows=64):
        x = np.arange(rows * features, dtype="float32").reshape(rows, features)
        return tf.data.Dataset.from_tensor_slices((x, x[:, :1]))

    def distribute(batch, features=4):
        s = tfdist.HorovodStrategy(tuning=False)
        s.experimental_distribute_dataset(arrays(features).batch(batch, drop_remainder=True))

    def from_function(features):
        s = tfdist.HorovodStrategy(tuning=False)
        s.distribute_datasets_from_function(lambda ctx: arrays(features).batch(8, drop_remainder=True))

    def manifests(same):
        data = os.path.join(out, f"data_rank{rank}")
        ids = np.arange(40 if same or rank == 0 else 41, dtype=np.int64)
        write_arrays({"id": ids}, data, min_shards=2)
        s = tfdist.HorovodStrategy(tuning=False)
        s.distribute_datasets_from_function(
            lambda ctx: read_dataset(data, 4, input_context=ctx, training=True)[0].map(lambda e: e["id"]))

    results["script"] = outcome(script)
    results["fingerprint"] = outcome(lambda: tfdist.HorovodStrategy(tuning=False, fingerprint=f"config-{'ab'[rank]}"))
    results["batch"] = outcome(lambda: distribute(8 if rank == 0 else 16))
    results["structure"] = outcome(lambda: from_function(4 if rank == 0 else 5))
    results["manifest"] = outcome(lambda: manifests(same=False))
    results["agree_arrays"] = outcome(lambda: distribute(8))
    results["agree_manifest"] = outcome(lambda: manifests(same=True))
    return results


def nonfinite_checks(strategy, bad_step=5):
    from tfdist.callbacks import StopOnNonFiniteLoss

    class Seen(keras.callbacks.Callback):
        batches = []

        def on_train_batch_end(self, batch, logs=None):
            self.batches.append(batch)

    def train(action):
        x = np.ones((8 * 20, 4), "float32")
        y = np.ones((8 * 20, 1), "float32")
        if strategy.rank == 1:
            y[8 * bad_step + 7] = np.nan  # in the half of global batch `bad_step` that rank 1 trains on
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        stop, seen = StopOnNonFiniteLoss(action=action), Seen()
        seen.batches = []
        result = outcome(lambda: model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                                           callbacks=[stop, seen]))
        return {**result, "report": stop.report, "message": stop.message, "batches": seen.batches}

    return {"stop": train("stop"), "raise": train("raise")}


def watchdog_port_checks(strategy):
    from tfdist.faults import watchdog

    taken = socket.create_server(("127.0.0.1", 0))  # held open: rank 0 cannot bind this port
    port = taken.getsockname()[1]
    results = {"taken_port": port}
    cases = {"taken": f"127.0.0.1:{port}", "not_a_number": "127.0.0.1:notaport",
             "out_of_range": "127.0.0.1:70000", "unknown_host": "no-such-host.invalid:0",
             "good": "127.0.0.1:0"}
    for name, address in cases.items():
        if strategy.rank == 0:  # only rank 0 reads it; the others learn the outcome from rank 0
            os.environ["TFDIST_WATCHDOG_ADDR"] = address
        results[name] = outcome(lambda: watchdog.start(timeout=5))
    taken.close()
    results["active"] = watchdog._active is not None
    return results


CHECKS = {
    "jit": lambda strategy, out: jit_check(strategy),
    "mismatch": lambda strategy, out: mismatch_check(strategy),
    "consistency": consistency_checks,
    "nonfinite": lambda strategy, out: nonfinite_checks(strategy),
    "watchdog_port": lambda strategy, out: watchdog_port_checks(strategy),
}


def main():
    parser = worker_parser()
    parser.add_argument("--checks", default="jit,mismatch")
    args = parser.parse_args()
    strategy = tfdist.HorovodStrategy()
    results = {name: CHECKS[name](strategy, args.out) for name in args.checks.split(",")}
    write_results(args.out, strategy.rank, results)


if __name__ == "__main__":
    main()
