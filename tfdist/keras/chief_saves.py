"""Saving that cannot corrupt a file: the chief writes shared paths, the other ranks wait for it.

Code written for MirroredStrategy calls `model.save(path)` on every process. Under MWMS a save is
a synchronisation point and non-chief workers write elsewhere; under plain Horovod every rank
writes the same file at once (a corrupt `.keras` zip, a torn `.weights.h5`), and a rank that
loads right after its own save may find the chief's file missing. Installed by `HorovodStrategy()`,
in a job of more than one rank, every call of `keras.Model.save` / `save_weights`,
`tf_keras.Model.save` / `save_weights` (when tf-keras is in use), `tf.saved_model.save`,
`tf.train.Checkpoint.write` / `save` and `tf.train.CheckpointManager.save` (the outermost one
in a thread: the calls it makes itself are part of it) runs inside `rank_variables.local_reads()`
(no collective, so the chief may save alone), and:

- on the chief (rank 0) writes the requested path. A single local file (`.keras`, `.h5`,
  `.weights.h5`) is written to a hidden sibling with the same suffix, fsynced and renamed into
  place, so a reader sees the previous file or the new one, never part of one (other ranks' own
  files too). Then the chief tells the others "save #k done, path P" (`tfdist.keras.save_notices`).
- on another rank, its k-th save first waits until the chief's save #k is done (at most
  `TFDIST_SAVE_TIMEOUT` seconds, default 600; then `SaveSyncError`). If it asked for the chief's
  path (or one the chief saved to before), it writes its copy to a private temp dir instead (said
  once at INFO); a path of its own (MWMS tutorials' per-worker temp paths, per-rank files) it
  writes as asked.

So once any rank's save returns, the chief's file of that save is complete and every rank can
load it. Horovod-style `if rank == 0: model.save(p)` needs nothing from the other ranks and never
waits; in code that also saves on every rank, put such saves inside `chief_only_saves()` so that
the ranks' numbering stays paired (tfdist's own chief-only writes do). Without a watchdog there
is no channel: saves are not synchronised (a warning says so once), single files are still
replaced atomically, and other ranks write SavedModels and checkpoints to their temp dir.
Outside a multi-rank job the originals run untouched.
"""

import contextlib
import functools
import inspect
import itertools
import logging
import os
import shutil
import threading
import weakref

import tensorflow as tf

from tfdist import _compat, collectives, rank_variables
from tfdist.faults import durable
from tfdist.keras import recognise
from tfdist.keras import save_notices, sharded_saves
from tfdist.errors import SaveSyncError
from tfdist.faults.watchdog_support import describe_exception, host_name

log = logging.getLogger("tfdist")

HOOK = "chief-only saving"
MODEL_FILE_SUFFIXES = (".keras", ".h5", ".hdf5")  # what Keras saves as one file

_installed = set()
_calls = threading.local()  # depth: wrapped calls in progress; chief_only: chief_only_saves() depth
_lock = threading.Lock()
_state = {"strategy_created": False, "number": 0, "noted_redirect": False, "noted_no_channel": False}
_temp_serials = itertools.count(1)
_copy_dirs = {}  # a path this rank does not write itself -> its private directory for the copy
_shadow_managers = weakref.WeakKeyDictionary()  # CheckpointManager -> its twin in the temp dir


def install():
    """Wrap the saving functions (once; a later call adds tf-keras if it came into use).

    Raises `KerasHookError` naming the function if TensorFlow or Keras moved it (never silent).
    Called by `HorovodStrategy()`, which is what makes the wrappers act (with 2+ ranks).
    """
    _state["strategy_created"] = True
    if "tensorflow" not in _installed:
        modules = _compat.tf_saved_model_modules(HOOK)
        checkpoint, manager = _compat.tf_checkpoint_classes(HOOK)
        _compat.require_methods(checkpoint, ["write", "save"], HOOK, "tensorflow")
        _compat.require_methods(manager, ["save"], HOOK, "tensorflow")
        for module in modules:
            _wrap(module, "save", "tf.saved_model.save", "export_dir", lambda a: ("dir", None), "tensorflow")
        for method in ("write", "save"):
            _wrap(checkpoint, method, f"checkpoint.{method}", "file_prefix", lambda a: ("prefix", None), "tensorflow")
        _wrap(manager, "save", "checkpoint_manager.save", "self", lambda a: ("manager", None), "tensorflow")
        _installed.add("tensorflow")
    if "keras3" not in _installed:
        model = _compat.keras3_model_class(HOOK)
        _compat.require_methods(model, ["save", "save_weights"], HOOK)
        _wrap(model, "save", "model.save", "filepath", _keras3_model_file, "keras3")
        _wrap(model, "save_weights", "model.save_weights", "filepath", _keras3_weights_file, "keras3")
        _installed.add("keras3")
    if "tf_keras" not in _installed and _compat.tf_keras_in_use():
        model = _compat.tf_keras_model_class(HOOK)
        _compat.require_methods(model, ["save", "save_weights"], HOOK, "tf_keras")
        _wrap(model, "save", "model.save", "filepath", _tf_keras_model_file, "tf_keras")
        _wrap(model, "save_weights", "model.save_weights", "filepath", _tf_keras_weights_file, "tf_keras")
        _installed.add("tf_keras")


def active():
    """Whether saves are coordinated now: a HorovodStrategy exists and the job has 2+ ranks."""
    return _state["strategy_created"] and collectives.is_initialized() and collectives.size() > 1


def in_save():
    """Whether this thread is inside a wrapped save (what it creates, e.g. a save counter, is its own)."""
    return getattr(_calls, "depth", 0) > 0


@contextlib.contextmanager
def chief_only_saves():
    """Saves inside are the chief's alone: not numbered, so nobody waits for or pairs with them.

    The chief writes the requested paths; another rank that makes such a save writes its copy
    to a private temp dir. For Horovod-style `if rank == 0: model.save(p)` in code that also
    saves on every rank (tfdist's own chief-only callback writes use it).
    """
    _calls.chief_only = getattr(_calls, "chief_only", 0) + 1
    try:
        yield
    finally:
        _calls.chief_only -= 1


# --- what a call writes, from its arguments: (kind, suffix) --------------------------------------
# "file": one file (replaced atomically); "dir": a directory (SavedModel, unzipped Keras model);
# "files": sharded weights; "prefix": a TF checkpoint (prefix.index, prefix.data-*);
# "manager": a CheckpointManager's directory.

def _suffix(path, suffixes=MODEL_FILE_SUFFIXES):
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""  # (or an open h5py.File)
    return next((s for s in suffixes if name.endswith(s)), None)


def _keras3_model_file(arguments):
    suffix = _suffix(arguments["filepath"])
    if arguments.get("zipped") is False or suffix is None:
        return "dir", None  # an unzipped model (or a path Keras refuses itself)
    return "file", suffix


def _keras3_weights_file(arguments):
    if arguments.get("max_shard_size") is None and _suffix(arguments["filepath"], (".weights.h5",)):
        return "file", ".weights.h5"
    return "files", None


def _tf_keras_model_file(arguments):
    save_format = str(arguments.get("save_format") or "").lower()
    suffix = _suffix(arguments["filepath"])
    if save_format in ("keras", "keras_v3", "h5", "hdf5") or (not save_format and suffix):
        return "file", suffix or ""
    return "dir", None  # SavedModel, tf-keras' default


def _tf_keras_weights_file(arguments):
    save_format = str(arguments.get("save_format") or "").lower()
    suffix = _suffix(arguments["filepath"], (".weights.h5",) + MODEL_FILE_SUFFIXES)
    if suffix or save_format in ("h5", "hdf5", "keras"):
        return "file", suffix or ""
    return "prefix", None  # tf-keras' default: a TF checkpoint


# --- the wrapper ----------------------------------------------------------------------------------

def _wrap(owner, name, what, param, classify, flavour):
    if _compat.hook_of(getattr(owner, name, None)) != HOOK:
        _compat.patch_method(owner, name, lambda original: _hooked(original, what, param, classify), HOOK, flavour)


def _hooked(original, what, param, classify):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save(*args, **kwargs):
        if in_save() or tf.inside_function() or not active():
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        _calls.depth = 1
        chief_only = getattr(_calls, "chief_only", 0)
        try:
            # Sharded optimizer state is gathered on every rank first (a collective), so the
            # chief writes it whole; a chief-only save cannot gather (sharded_saves says so).
            roots = [bound.arguments.get(name) for name in ("self", "obj")]
            if what == "model.save" and _suffix(bound.arguments.get("filepath"), (".h5", ".hdf5")) and \
                    bound.arguments.get("include_optimizer", True):
                sharded_saves.refuse_hdf5(roots)
            with sharded_saves.gathered_for_save(*roots, gather=not chief_only), rank_variables.local_reads():
                call = _Call(original, what, param, bound, *classify(bound.arguments))
                if not isinstance(call.path, (str, os.PathLike)):
                    return call.run()  # e.g. an open h5py.File: nothing to coordinate
                if chief_only:
                    return call.run_to(call.path) if collectives.rank() == 0 else _write_copy(call)
                return _chief_save(call) if collectives.rank() == 0 else _other_rank_save(call)
        finally:
            _calls.depth = 0

    return save


class _Call:
    """One wrapped save: what it is called, where it writes, and how to run it elsewhere."""

    def __init__(self, original, what, param, bound, kind, suffix):
        self.original, self.what, self.param, self.bound = original, what, param, bound
        self.kind, self.suffix = kind, suffix
        self.path = bound.arguments["self"].directory if kind == "manager" else bound.arguments[param]

    def key(self):
        """The path as every rank can compare it: absolute and normalised (remote: as given)."""
        path = os.fspath(self.path)
        return path if "://" in path else os.path.normpath(os.path.abspath(path))

    def __str__(self):
        if self.kind == "manager":
            return f"checkpoint_manager.save() (directory {os.fspath(self.path)!r})"
        return f"{self.what}({os.fspath(self.path)!r})"

    def run(self, replace=None):
        """The original call, with the arguments in `replace` (name -> value) replaced."""
        call = inspect.BoundArguments(self.bound.signature, {**self.bound.arguments, **(replace or {})})
        return self.original(*call.args, **call.kwargs)

    def run_to(self, path):
        """The original call writing `path`; one local file goes through a temp sibling."""
        if self.kind == "manager":
            return self.run()  # its own directory
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        asks_first = self.bound.arguments.get("overwrite", True) is False and os.path.exists(path)
        if self.kind != "file" or "://" in path or not os.path.isdir(folder) or asks_first:
            return self.run({self.param: path})  # (Keras asks before overwriting: let it)
        name = os.path.basename(path)
        stem = name[: len(name) - len(self.suffix)]  # Keras checks the suffix: the temp file keeps it
        temp = os.path.join(folder, f".{stem}.tfdist-tmp-{os.getpid()}-{next(_temp_serials)}{self.suffix}")
        try:
            result = self.run({self.param: temp})
            if os.path.exists(temp):
                durable.fsync_path(temp)
                os.replace(temp, path)
                durable.fsync_path(folder)
        finally:
            if os.path.exists(temp):
                os.remove(temp)
        return result

    def finish_async_writes(self):
        """Wait for a checkpoint written in the background (CheckpointOptions(async)) to be on disk."""
        if getattr(self.bound.arguments.get("options"), "experimental_enable_async_checkpoint", False):
            self.bound.arguments["self"].sync()


def _next_number():
    with _lock:
        _state["number"] += 1
        return _state["number"]


# --- the chief, and the other ranks -----------------------------------------------------------

def _chief_save(call):
    number = _next_number()
    try:
        result = call.run_to(call.path)
        call.finish_async_writes()
    except BaseException as e:
        save_notices.announce(number, call.key(), describe_exception(type(e), e, 0))
        raise
    save_notices.announce(number, call.key())
    return result


def _other_rank_save(call):
    if not save_notices.channel_open():
        return _unsynchronised_save(call)
    number = _next_number()
    try:
        chief_path, error = save_notices.wait_for(number, str(call))
    except SaveSyncError:
        with _lock:  # the save did not happen: it takes no number
            if _state["number"] == number:
                _state["number"] -= 1
        raise
    if error is not None:
        raise SaveSyncError(
            f"tfdist: rank {collectives.rank()} (host {host_name()}): {call} is this rank's save #{number}; "
            f"the chief's save #{number} (of {chief_path!r}) failed on rank 0 with {error}, so this rank "
            "wrote nothing either. Fix the chief's error (its traceback has it).")
    key = call.key()
    if key == chief_path or save_notices.chief_saved(key):
        return _write_copy(call, redirected=True)
    return call.run_to(call.path)


def _unsynchronised_save(call):
    if not _state["noted_no_channel"]:
        _state["noted_no_channel"] = True
        log.warning(
            "tfdist: rank %d: no watchdog runs (HorovodStrategy(watchdog=False) or TFDIST_WATCHDOG_TIMEOUT=0), "
            "so saves are not synchronised with the chief: a rank that loads right after saving may find "
            "the chief's file missing or older. Single files are still replaced atomically; this rank "
            "writes SavedModels and checkpoints under %s.", collectives.rank(), _copies_root())
    if call.kind == "file":
        return call.run_to(call.path)
    if "://" not in call.key():  # code that removes what it wrote (MWMS tutorials' rmtree) finds it
        os.makedirs(call.key() if call.kind in ("dir", "manager") else os.path.dirname(call.key()), exist_ok=True)
    return _write_copy(call)


def _copies_root():
    return os.path.join(recognise.scratch_dir(), "saves")


def _write_copy(call, redirected=False):
    """Write this rank's copy of a save the chief writes, in its private temp dir (newest kept)."""
    key = call.key()
    with _lock:
        folder = _copy_dirs.setdefault(key, os.path.join(_copies_root(), str(len(_copy_dirs) + 1)))
    if redirected and not _state["noted_redirect"]:
        _state["noted_redirect"] = True
        log.info("tfdist: rank %d: %s is written by the chief (rank 0); this rank wrote its copy under %s",
                 collectives.rank(), call, folder)
    if call.kind == "manager":
        return call.run({"self": _shadow_manager(call.bound.arguments["self"], folder)})
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    name = os.path.basename(os.path.normpath(key.split("://")[-1])) or "saved"
    return call.run_to(os.path.join(folder, name))


def _shadow_manager(manager, folder):
    """A CheckpointManager in `folder` numbering the same checkpoints as `manager` (keeps 1)."""
    shadow = _shadow_managers.get(manager)
    if shadow is None:
        directory = os.path.join(folder, os.path.basename(os.path.normpath(manager.directory)))
        shadow = tf.train.CheckpointManager(manager.checkpoint, directory, max_to_keep=1,
                                            **_compat.checkpoint_manager_settings(manager))
        _shadow_managers[manager] = shadow
    # `manager` writes nothing here: what it reports as its latest is the chief's, complete by now.
    _compat.set_manager_latest_checkpoint(manager, tf.train.latest_checkpoint(manager.directory))
    return shadow
