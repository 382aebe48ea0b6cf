"""Old module paths of tfdist's flat layout, still importable for one release, with a DeprecationWarning.

`import tfdist.keras_predict` gives `tfdist.keras.predictions` (the same module object), so code
written against the old paths, and objects pickled there, keep working. docs/ARCHITECTURE.md lists
where each module went.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "tfdist.keras_callbacks": "tfdist.keras.callback_writes",
    "tfdist.keras_metrics": "tfdist.keras.metrics",
    "tfdist.keras_predict": "tfdist.keras.predictions",
    "tfdist.keras_fused_batchnorm": "tfdist.keras.fused_batchnorm",
    "tfdist.quiet_ranks": "tfdist.keras.progress",
    "tfdist.chief_saves": "tfdist.keras.chief_saves",
    "tfdist.save_notices": "tfdist.keras.save_notices",
    "tfdist.gradient_exchange": "tfdist.exchange.gradients",
    "tfdist.compression": "tfdist.exchange.compression",
    "tfdist.compression_plan": "tfdist.exchange.compression_plan",
    "tfdist.rendezvous": "tfdist.launch.rendezvous",
    "tfdist.run": "tfdist.launch.runner",
    "tfdist.recovery": "tfdist.launch.recovery",
    "tfdist.launcher_output": "tfdist.launch.launcher_output",
    "tfdist.job_summary": "tfdist.launch.job_summary",
    "tfdist.stderr_filter": "tfdist.launch.stderr_filter",
    "tfdist.startup": "tfdist.tuning.startup",
    "tfdist.tune": "tfdist.tuning.tuner",
    "tfdist.tuning_cache": "tfdist.tuning.cache",
    "tfdist.predict": "tfdist.benchmark.step_model",
    "tfdist.profile_summary": "tfdist.benchmark.profile_summary",
    "tfdist.benchmark.run": "tfdist.benchmark.train_benchmark",
    "tfdist.callbacks.lars": "tfdist.optimizers.lars",
    "tfdist.callbacks.accumulation": "tfdist.optimizers.accumulation",
    "tfdist.watchdog": "tfdist.faults.watchdog",
    "tfdist.watchdog_support": "tfdist.faults.watchdog_support",
    "tfdist.hang": "tfdist.faults.hang",
    "tfdist.hang_detector": "tfdist.faults.hang_detector",
    "tfdist.preemption": "tfdist.faults.preemption",
    "tfdist.consistency": "tfdist.faults.consistency",
    "tfdist.durable": "tfdist.faults.durable",
    "tfdist.install_horovod": "tfdist.horovod_build.install",
    "tfdist.horovod_toolchain": "tfdist.horovod_build.toolchain",
    "tfdist.versions": "tfdist.horovod_build.versions",
    "tfdist.gpu": "tfdist.tuning.gpu",
    "tfdist.xla": "tfdist.exchange.xla",
    "tfdist.argtypes": "tfdist.benchmark.argtypes",
    "tfdist.keras_flavour": "tfdist.keras.flavour",
}


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn once per call site that `old` is deprecated in favour of `new`."""
    warnings.warn(f"{old} is deprecated: use {new} (see docs/ARCHITECTURE.md)", DeprecationWarning,
                  stacklevel=stacklevel)


class _Alias(importlib.abc.Loader):
    def __init__(self, new):
        self.new = new

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        warn(module.__name__, self.new, stacklevel=8)
        # The import system returns what sys.modules holds under the old name after this call.
        sys.modules[module.__name__] = importlib.import_module(self.new)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(MOVED[fullname]))


def install() -> None:
    """Make the old module paths importable (once per process)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
