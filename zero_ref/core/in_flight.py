"""A collective in flight: the bounded wait that turns a dead or stuck peer into CollectiveError
(`Pending`), the handle of one done locally over a group of one rank (`DoneLocally`), and the CUDA
side stream that communication and the work after it run on (`SideStream`).

On the CPU (gloo) the host waits for a collective at most `timeout_s` seconds; on CUDA (NCCL,
`timeout_s=None`) a wait only makes the current stream wait, and NCCL's watchdog bounds the
collective itself (comm.py creates the groups with the timeout).
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import torch

from .labels import label


POLL_S = 2e-4
"""How often `Pending.settle` asks whether a collective has finished."""


class CollectiveError(RuntimeError):
    """A collective failed or did not finish in time: another rank has probably died, raised, or
    taken a different path through the program."""


class Pending:
    """A collective in flight. `wait()` blocks the host at most `timeout_s` seconds (gloo) or, with
    `timeout_s=None` (NCCL), only makes the current CUDA stream wait; a failure becomes a
    CollectiveError naming the collective.

    `done()` asks the backend whether the collective has finished, without blocking; `settle()`
    polls it for a bounded time. (gloo's native reduce-scatter never reports completion before a
    wait, measured on torch 2.13; the collectives zero-ref issues on gloo all do: gloo.py.)

    `then`, if given, runs once on the caller's thread after the first wait that succeeds: the part
    of a collective done locally once the data has arrived (the sum of a reduce-scatter made of an
    all-to-all), so whoever waits sees the finished result.
    """

    def __init__(self, work, what: str, rank: int, timeout_s: float | None, on_failure=None, seq: int | None = None,
                 then=None):
        self.work, self.what, self.rank, self.timeout_s = work, what, rank, timeout_s
        self.on_failure = on_failure
        self.then = then   # run once, on the waiting thread, after the first wait that succeeds
        self.seq = seq   # the collective's number on its Comm (pairs the wait with the issue in a trace)

    def wait(self) -> None:
        # the label lets a profiler tell time spent waiting on communication, by kind, from compute
        # (experiments/throughput.py splits a step into phases with it)
        started = time.monotonic()
        try:
            with label("zero_ref.wait", self.what.split()[0], *(() if self.seq is None else (f"#{self.seq}",))):
                if self.timeout_s is None:
                    self.work.wait()
                else:
                    self.work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            if self.on_failure is not None:
                self.on_failure()
            waited = time.monotonic() - started
            if self.timeout_s is not None and waited < 0.9 * self.timeout_s:   # the backend gave up first
                how = f" (the backend gave up after {waited:.1f} s of the {self.timeout_s:g} s allowed)"
                likely = "another rank has probably exited, died, or raised"
            else:
                how = f" within {self.timeout_s:g} s" if self.timeout_s is not None else ""
                likely = "another rank has probably died, raised, or diverged"
            raise CollectiveError(
                f"rank {self.rank}: {self.what} did not complete{how}: {likely} "
                f"({str(err).splitlines()[0][:300]})") from err
        if self.then is not None:
            then, self.then = self.then, None
            then()

    def settle(self, seconds: float) -> bool:
        """Wait at most `seconds` for the collective; True once it has finished. Never raises: a
        failure is reported by `wait`. Labelled "zero_ref.wait <kind> settle" (no number: the
        collective's own wait comes later), so a profile counts this time as waiting."""
        deadline = time.monotonic() + seconds
        with label("zero_ref.wait", self.what.split()[0], "settle"):
            while not self.done() and time.monotonic() < deadline:
                time.sleep(POLL_S)
        return self.done()

    def done(self) -> bool:
        """True once the collective has finished (never blocks)."""
        return self.work.is_completed()


class DoneLocally:
    """The work handle of a collective over one rank, done by the caller: on the CPU already
    finished; on CUDA queued on the stream current at the call, so ``wait`` makes the waiting
    stream wait for it (as NCCL's ``Work.wait`` does for a real collective)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.event = torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None

    def wait(self, timeout=None) -> bool:
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()


class SideStream:
    """A CUDA stream beside the compute stream for communication and the work that follows it; on
    the CPU every method is a no-op, so callers read the same on both."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def after_current(self):
        """Run the block on the side stream, after everything already queued on the current one."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def on(self):
        """Run the block on the side stream (ordered after earlier side-stream work only)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def wait_event(self, event) -> None:
        """Make the side stream wait for `event` (a no-op for None)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def join(self) -> None:
        """Make the current stream wait for everything queued on the side stream so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def record_event(self):
        """An event marking the side stream's progress now (None on the CPU)."""
        return None if self.stream is None else self.stream.record_event()
