"""Profiler labels: how a trace of a training step tells compute from communication, and names
each event of ZeRO's schedule.

Labels are torch.autograd.profiler.record_function ranges, made only while a profiler records
(`label`). comm.py and in_flight.py put "zero_ref.wait <kind> #<n>" wherever the host waits for
collective number n of a Comm ("zero_ref.wait <kind> settle" where it waits a bounded while for one
to finish, `Pending.settle`), and "zero_ref::issue <kind> #<n> <elements> <bytes>" around the call that starts it, so a trace
pairs every issue with its wait. The stages add "zero_ref::<event>" labels around the events of
one step (a unit's gather and free, a bucket's reduction, a regather after the update); the
walkthrough (experiments/timeline.py, docs/) reads a step's story from them. The engine's
"zero_ref.<phase>" labels (one dot) name the phases; the events use two colons so that nothing
that splits steps into phases mistakes them for one.
"""

from __future__ import annotations

import contextlib

from torch.autograd import _profiler_enabled
from torch.autograd.profiler import record_function

_NOT_RECORDING = contextlib.nullcontext()


def label(*parts):
    """A profiler label named by `parts` joined with spaces while a profiler records, else a no-op.

    record_function costs about 18 µs per use on a 2-core CPU even when no profiler runs (a no-op
    context manager: 1 µs), and these labels sit on per-bucket and per-unit paths, so they are only
    made when someone is looking. Behaviour never depends on them."""
    if not _profiler_enabled():
        return _NOT_RECORDING
    return record_function(" ".join(map(str, parts)))
