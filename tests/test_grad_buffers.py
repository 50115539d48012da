"""ShardedGradBuckets on a backend that never blocks for good (stage 3 on gloo), with a stand-in for
the process group whose reduce-scatters take a set time: how many buffers exist, and that a wait
which runs out (ranks out of step) costs one patience per backward, not one per bucket."""

import threading
import time

import torch

from zero_ref.core.in_flight import Pending, SideStream
from zero_ref.core.grad_buffers import ShardedGradBuckets
from zero_ref.core.partition import make_group


class _SlowWork:
    """A c10d Work stand-in that finishes `seconds` after it is issued (None: never)."""

    def __init__(self, seconds):
        self.finished = threading.Event()
        if seconds is not None:
            threading.Timer(seconds, self.finished.set).start()

    def wait(self, timeout=None):
        if not self.finished.wait(timeout.total_seconds() if timeout else None):
            raise RuntimeError("timed out")

    def is_completed(self):
        return self.finished.is_set()   # as gloo's all-to-all (zero-ref's reduce-scatter on gloo) reports it


class _OneRankComm:
    """World size 1: a reduce-scatter leaves the bucket as it is and finishes after `seconds`."""

    world_size, rank = 1, 0

    def __init__(self, seconds):
        self.seconds, self.reduce_stream = seconds, SideStream(torch.device("cpu"))

    def reduce_scatter(self, output, full, async_op=False):
        return Pending(_SlowWork(self.seconds), f"reduce_scatter of {full.numel()} elements", 0, timeout_s=10.0)


def _backward(buckets, params, groups):
    """Every group's gradients arrive in turn and each group is reduced at once, then drain."""
    for g, param in enumerate(params):
        buckets.bind(g)
        param.grad = torch.ones_like(param) if param.grad is None else param.grad.add_(1)
        buckets.add(g, 0, param)
        buckets.reduce_scatter(g)
    buckets.drain()


def _buckets(seconds, patience_s, n_groups=6):
    params = [torch.nn.Parameter(torch.zeros(100)) for _ in range(n_groups)]
    groups = [make_group([p], 1) for p in params]
    shards = [torch.zeros(100) for _ in params]
    buckets = ShardedGradBuckets(_OneRankComm(seconds), groups, shards, torch.float32, torch.device("cpu"),
                                 overlap=True, piece_numel=100, may_block=False, patience_s=patience_s)
    return buckets, params, groups, shards


def test_reductions_slower_than_backward_reuse_two_buffers_when_waited_for():
    buckets, params, groups, shards = _buckets(seconds=0.05, patience_s=5.0)
    _backward(buckets, params, groups)
    assert len(buckets.pool.buffers) == 2                 # one filling while the previous one reduces
    assert all(torch.equal(shard, torch.ones(100)) for shard in shards)


def test_without_patience_every_slow_reduction_keeps_a_buffer_of_its_own():
    buckets, params, groups, _ = _buckets(seconds=0.05, patience_s=0.0)
    _backward(buckets, params, groups)
    assert len(buckets.pool.buffers) >= 5                 # what stage 3 on gloo held before waiting


def test_a_wait_that_runs_out_ends_waiting_until_the_backward_ends():
    buckets, params, groups, shards = _buckets(seconds=0.6, patience_s=0.1)   # a peer out of step
    start = time.perf_counter()
    for g, param in enumerate(params):
        buckets.bind(g)
        param.grad = torch.ones_like(param)
        buckets.add(g, 0, param)
        buckets.reduce_scatter(g)
    launched = time.perf_counter() - start
    assert 0.1 <= launched < 0.45 and not buckets.patient   # one patience (0.1 s), not five
    buckets.drain()
    assert buckets.patient and all(torch.equal(shard, torch.ones(100)) for shard in shards)
