"""Helpers shared by the multi-rank worker scripts (run under horovodrun, one process per rank)."""

import argparse
import json
import logging
import os
import sys

import numpy as np

from tfdist.keras.flavour import keras_module  # noqa: F401  (re-exported for the workers)


def to_jsonable(value):
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


def worker_parser(reference=False):
    """The worker's argument parser, holding what every worker takes: `--out DIR`, where each rank
    writes rank<R>.json; with `reference`, also `--reference`: the one-process reference run."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    if reference:
        parser.add_argument("--reference", action="store_true")
    return parser


def write_results(out_dir, rank, results):
    """OUT_DIR/rank<RANK>.json (the folder made if missing), written whole or not at all."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(to_jsonable(results), f)
    os.replace(path + ".tmp", path)


class LogMessages(logging.Handler):
    """A log handler that keeps the messages of the records at `level` or above in `texts`."""

    def __init__(self, level=logging.INFO):
        super().__init__(level)
        self.texts = []

    def emit(self, record):
        self.texts.append(record.getMessage())


def quiet_tensorflow():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stdout.reconfigure(line_buffering=True)


def iterator_kinds(distributed):
    """The type specs an iterator over `distributed` is made of (its parts, recursively): TF's
    `MultiDeviceIteratorSpec` where it copies batches to the replicas' devices."""
    import tensorflow as tf

    kinds = set()

    def walk(spec):
        kinds.add(type(spec).__name__)
        for part in tf.nest.flatten(getattr(spec, "_component_specs", None)):
            if isinstance(part, tf.TypeSpec) and part is not spec:  # a tensor's spec is its own part
                walk(part)

    walk(iter(distributed)._type_spec)
    return kinds


def input_step_collectives(distributed):
    """The collective ops a traced `next()` of an iterator over `distributed` holds: TensorFlow's
    partial-batch check (does any rank still have data?) is one; traced only, never run."""
    import tensorflow as tf

    fetch = tf.function(lambda iterator: next(iterator))
    graph = fetch.get_concrete_function(iter(distributed)).graph
    return sorted({op.type for op in graph.get_operations() if "Horovod" in op.type or "Collective" in op.type})
