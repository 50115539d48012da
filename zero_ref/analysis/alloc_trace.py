"""Allocation traces: every tensor storage a run allocates and frees, in order.

Fragmentation is a property of the *order* of allocations and frees, not of their sum: the same
tensors, allocated in another order, leave other holes. So to measure it we record that order
from real runs and replay it through a model of the caching allocator (caching_allocator.py).

Two sources give the same kind of trace, a list of (block, bytes) events (bytes > 0: allocated;
bytes < 0: freed):

* `record_allocations()`, on any device including meta (the engine at scale, at_scale.py): a
  TorchDispatchMode sees every op's output storages; a storage seen for the first time is an
  allocation, and a weak reference to it reports its free. `UntypedStorage.resize_` does not go
  through the dispatcher (stage 3 frees and regrows parameter storages with it), so it is patched
  while recording, as torch's own MemTracker does: a resize is a new allocation, then the old
  one's free.
* `AllocationTrace.from_cuda_snapshot()`, on CUDA: the caching allocator's own history
  (`torch.cuda.memory._record_memory_history` and `_snapshot()`), the sizes it was asked for.

Storages alive before recording starts are not in the trace (and their frees are ignored), once
the recorder knows of them: `_Recorder.already_alive` (otherwise the first op that outputs a view of
one counts it as an allocation).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class AllocationTrace:
    """The allocations and frees of a run, in order: `events[i] = (block, nbytes)`, nbytes > 0 when
    `block` (an id) is allocated, -nbytes when it is freed. `marks[name]` is the number of events
    recorded before `mark(name)` was called (to cut the trace into phases)."""

    events: list[tuple[int, int]] = field(default_factory=list)
    marks: dict[str, int] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.events)

    def live_bytes(self) -> list[int]:
        """Bytes allocated and not freed after each event."""
        live, out = 0, []
        for _, nbytes in self.events:
            live += nbytes
            out.append(live)
        return out

    def peak_bytes(self) -> int:
        return max(self.live_bytes(), default=0)

    @classmethod
    def from_cuda_snapshot(cls, snapshot: dict, device: int = 0) -> AllocationTrace:
        """The trace in a CUDA memory snapshot (`torch.cuda.memory._snapshot()` taken after
        `_record_memory_history(max_entries=...)`): its "alloc" and "free_completed" actions."""
        trace, blocks, next_id = cls(), {}, 0
        for entry in snapshot["device_traces"][device]:
            if entry["action"] == "alloc":
                blocks[entry["addr"]] = next_id
                trace.events.append((next_id, entry["size"]))
                next_id += 1
            elif entry["action"] == "free_completed" and entry["addr"] in blocks:
                trace.events.append((blocks.pop(entry["addr"]), -entry["size"]))
        return trace


class _Recorder(TorchDispatchMode):
    """Sees every op's outputs; storages seen for the first time go into the trace."""

    def __init__(self, trace: AllocationTrace, devices: set[str] | None):
        super().__init__()
        self.trace, self.devices = trace, devices
        self.tokens = WeakIdKeyDictionary()      # storage seen -> its token
        self.live: dict[int, tuple[int, int]] = {}   # token -> (block, bytes) of its allocation now
        self.next_token = self.next_block = 0
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and (self.devices is None or tensor.device.type in self.devices):
                self.see(tensor.untyped_storage())
        return out

    def see(self, storage: torch.UntypedStorage) -> None:
        if storage in self.tokens:
            return
        token = self.tokens[storage] = self.next_token
        self.next_token += 1
        weakref.finalize(storage, self._died, token)
        if storage.nbytes():
            self._allocate(token, storage.nbytes())

    def already_alive(self, tensors) -> None:
        """Storages of `tensors` were allocated before recording: an op that outputs a view of one
        (an input batch sliced per rank) must not count it as a new allocation."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage not in self.tokens:
                self.tokens[storage] = self.next_token
                self.next_token += 1

    def resized(self, storage: torch.UntypedStorage, old_nbytes: int) -> None:
        """After `storage.resize_`: the new size is a new block, then the old block is freed."""
        if storage.nbytes() == old_nbytes:
            return
        token = self.tokens.get(storage)
        if token is None:                        # not seen yet: an allocation if it grew from empty
            if old_nbytes == 0:
                self.see(storage)
            return
        old = self.live.pop(token, None)
        if storage.nbytes():
            self._allocate(token, storage.nbytes())
        if old is not None:
            self.trace.events.append((old[0], -old[1]))

    def _allocate(self, token: int, nbytes: int) -> None:
        self.live[token] = (self.next_block, nbytes)
        self.trace.events.append((self.next_block, nbytes))
        self.next_block += 1

    def _died(self, token: int) -> None:
        old = self.live.pop(token, None)
        if self.recording and old is not None:
            self.trace.events.append((old[0], -old[1]))


@contextmanager
def record_allocations(devices: set[str] | None = None, already_alive=()):
    """Record every storage allocated and freed inside the block (on `devices`, e.g. {"cuda"};
    all devices when None) into the AllocationTrace it yields; the storages of the tensors in
    `already_alive` (made before, e.g. the input batches) are never counted."""
    trace = AllocationTrace()
    recorder = _Recorder(trace, devices)
    recorder.already_alive(already_alive)
    original_resize = torch.UntypedStorage.resize_

    def resize_(storage, size):
        old_nbytes = storage.nbytes()
        result = original_resize(storage, size)
        if devices is None or storage.device.type in devices:
            recorder.resized(storage, old_nbytes)
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        with recorder:
            yield trace
    finally:
        torch.UntypedStorage.resize_ = original_resize
        recorder.recording = False
