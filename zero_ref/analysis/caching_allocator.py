"""A model of PyTorch's CUDA caching allocator, to measure fragmentation from allocation traces.

The paper (Sec 3.2, 6.3) saw runs fail with over 30% of memory free: the caching allocator keeps
freed blocks for reuse, and a request that fits no free block needs a new segment even when the
free bytes, summed, would do. How much is lost depends on the order of allocations and frees, so
we replay a real run's trace (alloc_trace.py) through the allocator's rules as PyTorch's
CUDACachingAllocator.cpp has them (defaults, no expandable segments):

* requests are rounded up to 512 B; those up to 1 MiB come from a *small* pool of 2 MiB segments,
  larger ones from a *large* pool: 20 MiB segments for requests under 10 MiB, otherwise a segment
  of the request rounded up to 2 MiB;
* a request takes the smallest free block of its pool that holds it (best fit, lowest address on
  ties), split when the rest is at least 512 B (small pool) or over 1 MiB (large pool);
* a freed block merges with free neighbours of its segment and stays cached;
* when a new segment would exceed the capacity, every wholly free cached segment is released and
  the request retried once (counted: `ReplayStats.alloc_retries`, torch's `num_alloc_retries`; on a
  GPU each is a device synchronisation and cudaFree calls); if it still does not fit: out of memory.

`fragmentation(trace)` is the share of the device a run needs beyond the bytes it asks for: the
smallest capacity that replays the trace without running out (found by bisection), against the
trace's peak of requested bytes. It is what a max-model-size search must leave unused.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from .alloc_trace import AllocationTrace

MiB = 2**20
MIN_BLOCK = 512               # kMinBlockSize: every request rounds up to a multiple of this
SMALL_REQUEST = 1 * MiB       # kSmallSize: requests up to this come from the small pool
SMALL_SEGMENT = 2 * MiB       # kSmallBuffer
LARGE_SEGMENT = 20 * MiB      # kLargeBuffer: the segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MiB    # kMinLargeAlloc
ROUND_LARGE = 2 * MiB         # kRoundLarge: larger segments round up to this


class OutOfMemory(RuntimeError):
    """The replay needed a segment beyond the capacity, even after releasing the cache."""


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The bytes the allocator asks the device for when no cached block holds `size`."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next")

    def __init__(self, segment: int, offset: int, size: int):
        self.segment, self.offset, self.size = segment, offset, size
        self.free, self.prev, self.next = True, None, None

    def key(self) -> tuple[int, int, int]:
        return self.size, self.segment, self.offset


@dataclass
class ReplayStats:
    """Peaks of one replay: bytes the trace asked for (`requested`), held in blocks (`allocated`,
    rounded) and held from the device (`reserved`, the segments); and `alloc_retries`, the requests
    that found the device full and released the cached segments before asking again (the cost of
    memory pressure: each stalls a GPU run while the device synchronises)."""

    peak_requested: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    alloc_retries: int = 0


class CachingAllocatorModel:
    """The allocator's state: segments, their blocks, and the free blocks of each pool sorted by
    (size, segment, offset) for best fit. `capacity=None`: the device never runs out."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.pools = {True: [], False: []}               # small? -> sorted free blocks (key, block)
        self.segments: dict[int, tuple[bool, int, _Block]] = {}   # id -> (small?, bytes, first block)
        self.segment_ids = itertools.count()
        self.requested = self.allocated = self.reserved = 0
        self.stats = ReplayStats()

    # --- requests ---------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        block = self._best_fit(small, size) or self._new_segment(small, size)
        self._unlist(small, block)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            tail = _Block(block.segment, block.offset + size, rest)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._list(small, tail)
        block.free = False
        self.requested += nbytes
        self.allocated += block.size
        self._update_peaks()
        return block

    def free(self, block: _Block, nbytes: int) -> None:
        small = self.segments[block.segment][0]
        self.requested -= nbytes
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):       # merge with free neighbours
            if neighbour is not None and neighbour.free:
                self._unlist(small, neighbour)
                block = self._merge(block, neighbour)
        self._list(small, block)

    # --- internals ----------------------------------------------------------------------------------
    def _best_fit(self, small: bool, size: int) -> _Block | None:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1), key=lambda item: item[0])
        return pool[i][1] if i < len(pool) else None

    def _new_segment(self, small: bool, size: int) -> _Block:
        nbytes = segment_size(size)
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            self.stats.alloc_retries += 1
            self._release_cached_segments()
            if self.reserved + nbytes > self.capacity:
                raise OutOfMemory(f"{nbytes} B segment with {self.reserved} of {self.capacity} B reserved")
        segment = next(self.segment_ids)
        block = _Block(segment, 0, nbytes)
        self.segments[segment] = (small, nbytes, block)
        self.reserved += nbytes
        self._list(small, block)
        return block

    def _release_cached_segments(self) -> None:
        for segment, (small, nbytes, first) in list(self.segments.items()):
            if first.free and first.next is None:        # one free block spans the segment
                self._unlist(small, first)
                del self.segments[segment]
                self.reserved -= nbytes

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        first, second = (neighbour, block) if neighbour.next is block else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _list(self, small: bool, block: _Block) -> None:
        bisect.insort(self.pools[small], (block.key(), block), key=lambda item: item[0])

    def _unlist(self, small: bool, block: _Block) -> None:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, block.key(), key=lambda item: item[0])
        if i >= len(pool) or pool[i][1] is not block:
            raise AssertionError("free block missing from its pool")
        del pool[i]

    def _update_peaks(self) -> None:
        s = self.stats
        s.peak_requested = max(s.peak_requested, self.requested)
        s.peak_allocated = max(s.peak_allocated, self.allocated)
        s.peak_reserved = max(s.peak_reserved, self.reserved)


def replay(trace: AllocationTrace, capacity: int | None = None, start: int = 0,
           count_from: int | None = None) -> ReplayStats:
    """Run `trace` through a fresh allocator; from event `start` on (before it: no limit), every
    wholly free cached segment is released and the device holds `capacity` bytes (raises
    OutOfMemory when that is too few). The peaks and the retries are those from event `count_from`
    (default: `start`) on."""
    allocator, blocks = CachingAllocatorModel(), {}
    count_from = start if count_from is None else count_from
    for i, (block_id, nbytes) in enumerate(trace.events):
        if i == start:
            allocator.capacity = capacity
            allocator._release_cached_segments()
        if i == count_from:
            allocator.stats = ReplayStats(allocator.requested, allocator.allocated, allocator.reserved)
        if nbytes > 0:
            blocks[block_id] = allocator.malloc(nbytes)
        elif block_id in blocks:
            allocator.free(blocks.pop(block_id), -nbytes)
    return allocator.stats


def fits(trace: AllocationTrace, capacity: int, start: int = 0) -> bool:
    try:
        replay(trace, capacity, start)
    except OutOfMemory:
        return False
    return True


def min_capacity(trace: AllocationTrace, start: int = 0, tolerance: float = 1e-3) -> int:
    """The smallest capacity (within `tolerance` of it, or 2 MiB) that replays the trace from
    event `start` on without running out: between the peak of requested bytes and the peak
    reserved with no limit."""
    unlimited = replay(trace, None, start)
    low, high = unlimited.peak_requested - 1, unlimited.peak_reserved    # fits(high), not fits(low)
    while high - low > max(ROUND_LARGE, tolerance * high):
        middle = (low + high) // 2
        low, high = (low, middle) if fits(trace, middle, start) else (middle, high)
    return high


def fragmentation(trace: AllocationTrace, start: int = 0) -> float:
    """The share of the smallest sufficient capacity that the trace's peak request leaves unused,
    from event `start` on: 1 - peak requested / min_capacity."""
    peak = replay(trace, None, start).peak_requested
    return 1 - peak / min_capacity(trace, start) if peak else 0.0
