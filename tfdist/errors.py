"""Errors tfdist raises: each names what was wrong and what to do."""


class TfdistError(RuntimeError):
    """Base class of tfdist errors."""


class HorovodNotAvailableError(TfdistError, ImportError):
    """Horovod (with TensorFlow support) cannot be imported."""


class XlaNotSupportedError(TfdistError):
    """A Horovod collective was placed inside an XLA-compiled function."""


class RankMismatchError(TfdistError):
    """Ranks disagree about something that must be identical (model variables, ...)."""

    raised_on_every_rank = True  # the watchdog lets every rank raise it and print its traceback


class WatchdogError(TfdistError):
    """The liveness watchdog could not be set up (e.g. rank 0's address is unreachable)."""


class KerasHookError(TfdistError):
    """A Keras hook tfdist needs cannot be installed on this Keras version.

    The hooks: global metrics, loss scaling, predict, callbacks. Raised by `HorovodStrategy()`,
    naming the hook.
    """


class NonFiniteLossError(TfdistError):
    """The training loss became NaN or infinite (raised by `callbacks.StopOnNonFiniteLoss`)."""

    raised_on_every_rank = True  # at the same step on every rank (the logged loss is global)


class SaveSyncError(TfdistError):
    """A rank's save could not be matched with the chief's (`tfdist.keras.chief_saves`).

    The chief made no such save within `TFDIST_SAVE_TIMEOUT`, left the job first, or its
    matching save failed.
    """


class GPUNotFoundError(TfdistError):
    """A job asked for a GPU and TensorFlow sees none.

    Raised by `HorovodStrategy(device="gpu")` and `tfdist-benchmark --device gpu`; the message
    names the rank, host, driver, CUDA_VISIBLE_DEVICES and build.
    """


class LaunchError(TfdistError):
    """The launch environment is inconsistent, or the rendezvous could not be completed."""


class PreemptionError(TfdistError):
    """A graceful stop could not be agreed on across ranks (`tfdist.faults.preemption`).

    A rank did not acknowledge the stop step, or learned of it too late; or
    `TFDIST_PREEMPTION_SIGNALS` names something that is not a signal.
    """


class ShardedStateError(TfdistError, ValueError):
    """`HorovodStrategy(shard_optimizer_state=True)` cannot do what was asked, exactly.

    An optimizer or option it cannot shard (named in the message), or a save of sharded state
    that not every rank makes.
    """
