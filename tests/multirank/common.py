"""Helpers shared by the multi-rank worker scripts (run under horovodrun, one process per rank)."""

import json
import os
import sys

import numpy as np

from tfdist.keras_flavour import keras_module  # noqa: F401  (re-exported for the workers)


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


def write_results(out_dir, rank, results):
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(to_jsonable(results), f)
    os.replace(path + ".tmp", path)


def quiet_tensorflow():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stdout.reconfigure(line_buffering=True)
