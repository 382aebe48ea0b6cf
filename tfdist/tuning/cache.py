"""The settings `tfdist-tune` measured fastest, cached per machine so later jobs start tuned.

One JSON file per (CPU model, usable cpus, TensorFlow version) under `$TFDIST_CACHE_DIR`
(default `~/.cache/tfdist/tuning`), holding per model signature and ranks per node the chosen
settings and the table they were chosen from.

```python
from tfdist.tuning import cache as tuning_cache
print(tuning_cache.path())                # this machine's file
print(tuning_cache.choice_for(local_size=1))  # {} until tfdist-tune has run here
```

`TFDIST_TUNING_CHOICE` (JSON, e.g. `{"overrides": {"onednn": false}}`) overrides the cache for one
process: `tfdist-tune` runs its candidates that way. This module never imports TensorFlow.
"""

import importlib.metadata
import json
import os
import re
import time

CHOICE_VARIABLE = "TFDIST_TUNING_CHOICE"
MODEL_VARIABLE = "TFDIST_TUNED_MODEL"  # which model's measurement to use (default: the newest)
OVERRIDE_KEYS = ("onednn", "intra_op_threads", "inter_op_threads", "pin")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def tensorflow_version():
    for dist in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "intel-tensorflow"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def machine_key(cpus=None):
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()} | {cpus} cpus | TF {tensorflow_version()}"


def path(key=None):
    key = key or machine_key()
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", key).strip("-").lower()
    root = os.environ.get("TFDIST_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tfdist", "tuning")
    return os.path.join(root, f"{slug}.json")


def load(key=None):
    try:
        with open(path(key)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save(model, ranks_per_node, choice, table, key=None):
    """Record `choice` ({"overrides": {...}, "cycle_time_ms": ...}) for `model` at `ranks_per_node`."""
    key = key or machine_key()
    data = load(key) or {"machine": key, "models": {}}
    entry = {**choice, "table": table, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    data["models"].setdefault(model, {})[str(ranks_per_node)] = entry
    data["newest"] = model
    target = path(key)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(target + ".tmp", target)
    return target


def choice_for(local_size, model=None, key=None):
    """The settings to use with `local_size` ranks on this node: {"overrides", "cycle_time_ms",
    "source"}; {} when nothing was measured here (the built-in plan applies)."""
    forced = os.environ.get(CHOICE_VARIABLE)
    if forced:
        try:
            choice = json.loads(forced)
        except ValueError as e:
            raise ValueError(f"{CHOICE_VARIABLE}={forced!r} is not JSON: {e}") from None
        unknown = set(choice.get("overrides", {})) - set(OVERRIDE_KEYS)
        if unknown:
            raise ValueError(f"{CHOICE_VARIABLE}: unknown override(s) {sorted(unknown)}; expected {OVERRIDE_KEYS}")
        return {**choice, "source": CHOICE_VARIABLE}
    data = load(key)
    model = model or os.environ.get(MODEL_VARIABLE) or data.get("newest")
    entry = data.get("models", {}).get(model, {}).get(str(local_size))
    if not entry:
        return {}
    return {"overrides": entry.get("overrides", {}), "cycle_time_ms": entry.get("cycle_time_ms"),
            "source": f"tfdist-tune, {model}, {entry.get('date')} ({path(key)})"}
