"""Profiler labels that tell compute from communication in a trace and name ZeRO's events.

"zero_ref.wait <kind> #<n>" marks where the host waits for collective n of a Comm ("... settle": a
bounded wait for one to finish), "zero_ref::issue <kind> #<n> <elements> <bytes>" the call that
starts it; the stages add "zero_ref::<event>" (a unit's gather and free, a bucket's reduction), the
engine "zero_ref.<phase>". experiments/timeline.py and throughput.py read steps from them.
"""

from __future__ import annotations

import contextlib

from torch.autograd import _profiler_enabled
from torch.autograd.profiler import record_function

_NOT_RECORDING = contextlib.nullcontext()


def label(*parts):
    """A record_function named by `parts` while a profiler records, else a no-op (it costs about
    18 µs per use on a 2-core CPU even unrecorded; these sit on per-bucket paths)."""
    if not _profiler_enabled():
        return _NOT_RECORDING
    return record_function(" ".join(map(str, parts)))
