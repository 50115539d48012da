"""A collective in flight (`Pending`: a bounded wait that turns a dead or stuck peer into
CollectiveError), one done locally over a group of one rank (`DoneLocally`), and the CUDA side
stream communication runs on (`SideStream`; no-ops on the CPU). On CUDA a wait only makes the
current stream wait, and NCCL's watchdog bounds the collective itself.
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
    """A collective in flight. `wait()` blocks the host at most `timeout_s` (gloo) or, with None
    (NCCL), makes the current stream wait; a failure becomes a CollectiveError naming it. `done()`
    asks whether it finished, `settle()` polls that a bounded while. `then` runs once after the
    first successful wait: the local part of a collective (gloo.reduce_scatter_by_all_to_all's sum).
    """

    def __init__(self, work, what: str, rank: int, timeout_s: float | None, on_failure=None, seq: int | None = None,
                 then=None):
        self.work, self.what, self.rank, self.timeout_s = work, what, rank, timeout_s
        self.on_failure = on_failure
        self.then, self.seq = then, seq   # seq: the collective's number on its Comm (for traces)

    def wait(self) -> None:
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
        """Wait at most `seconds`; True once finished. Never raises (`wait` reports failures)."""
        deadline = time.monotonic() + seconds
        with label("zero_ref.wait", self.what.split()[0], "settle"):
            while not self.done() and time.monotonic() < deadline:
                time.sleep(POLL_S)
        return self.done()

    def done(self) -> bool:
        """True once the collective has finished (never blocks)."""
        return self.work.is_completed()


class DoneLocally:
    """The handle of a collective over one rank, done by the caller: finished on the CPU; on CUDA
    queued on the current stream, which `wait` makes the waiting stream wait for (as NCCL's)."""

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
    """A CUDA stream beside the compute stream for communication; every method a no-op on the CPU."""

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
