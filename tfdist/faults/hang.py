"""What this rank is doing, for the hang detector: the collective or Keras step it is in, and the last it finished.

`tfdist.collectives` marks every collective it runs eagerly (`allreduce 'tfdist.metric_first.0'`,
`allgather 'tfdist.objects.data'`) and `tfdist.keras.step_marks` every Keras batch of a `fit`
(`train step 21 (epoch 2, batch 5)`); `tfdist.faults.hang_detector` sends `snapshot()` to rank 0, which
names ranks that wait in different ones. Marks nest (a collective inside a step shows as the
collective until it ends). Standard library only: `tfdist.collectives` imports it.

```python
from tfdist.faults import hang
mark = hang.enter("allreduce 'my.sum'")
try:
    ...                                   # the work, usually a collective
finally:
    hang.leave(mark)
hang.snapshot()   # {"what": None, "for": 0.0, "last": "allreduce 'my.sum'", "last_step": None, "longest": ...}
```

The hot path is one small object and a few attribute writes, without a lock: a mark left by
another thread than the one that entered it (Keras may run `on_train_batch_end` on a thread
pool) never brings a finished mark back.
"""

import time


class Mark:
    """One piece of work this rank is inside: `what`, since `started` (time.monotonic())."""

    __slots__ = ("done", "outer", "started", "step", "what")

    def __init__(self, what, outer, step):
        self.what, self.outer, self.step, self.done = what, outer, step, False
        self.started = time.monotonic()


_current = None  # the innermost Mark not yet left
_last = None  # what of the last mark left
_last_step = None  # (started, what) of the last Keras train step left
_longest = (0.0, None)  # (seconds, what) of the longest mark left so far


def collective(kind, name, scope):
    """How a collective reads in messages: `allreduce 'tfdist.metrics'`, `allreduce in tfdist_metric_sync`."""
    if kind is None:
        return scope
    if name:
        return f"{kind} {name!r}"
    return kind if scope == f"tfdist_{kind}" else f"{kind} in {scope}"


def enter(what, step=False):
    """Mark that this rank now does `what` (`step`: a Keras train step); returns the mark for `leave`."""
    global _current
    outer = _unfinished(_current)
    if outer is not None:
        outer.outer = _unfinished(outer.outer)  # drop finished marks: the chain stays short
    mark = Mark(what, outer, step)
    _current = mark
    return mark


def leave(mark, finished=True):
    """Mark `mark` finished: it becomes the last one, and the rank is back in the one around it.
    `finished=False` only drops it (work abandoned by an exception: neither last nor timed)."""
    global _current, _last, _last_step, _longest
    mark.done = True
    if _current is mark:
        _current = _unfinished(mark.outer)
    if not finished:
        return
    took = time.monotonic() - mark.started
    if took > _longest[0]:
        _longest = (took, mark.what)
    if not mark.step:
        _last = mark.what
    elif _last_step is None or mark.started >= _last_step[0]:  # not an older step's late end
        _last = mark.what
        _last_step = (mark.started, mark.what)


def _unfinished(mark):
    while mark is not None and mark.done:
        mark = mark.outer
    return mark


def current():
    """The innermost unfinished Mark, or None when this rank is outside every collective and step."""
    return _unfinished(_current)


def snapshot():
    """This rank's activity as a JSON-able dict: `what` it is in (None: outside every mark) and
    `for` how many seconds, the `last` mark and the `last_step` (Keras train step) it finished,
    and the `longest` any mark of this process took (seconds), `longest_what` that mark."""
    mark, last, last_step, longest = current(), _last, _last_step, _longest
    return {"what": None if mark is None else mark.what,
            "for": 0.0 if mark is None else time.monotonic() - mark.started,
            "last": last,
            "last_step": None if last_step is None else last_step[1],
            "longest": longest[0], "longest_what": longest[1]}
