"""A performance model of one training step: compute from FLOPs, communication from ring collectives.

A rank's step time is the sum of terms, each of which can be measured on its own:

    forward      blocks' forward FLOPs / forward rate(tokens, hidden): FLOP/s a block sustains
    backward     blocks' backward FLOPs (2x forward) / backward rate, + checkpoint recomputation
                 (one more forward) / forward rate
    head         the logits and the loss, forward and backward, each at its own rate
    mp_forward   Megatron's all-reduces of batch x seq x hidden values in forward: 2 per block
                 and 1 for the embedding; plus the vocabulary-parallel loss's two small ones (the
                 max, then the sum of exponentials with the target logit: 1 and 2 values per token)
    mp_backward  the same in backward: 2 per block, 1 for the head and, with checkpointing, 1 per
                 block in recomputation (torch's checkpoint stops recomputing once the last saved
                 tensor is back, before the MLP's all-reduce; the paper's "12 x seq x hidden" of
                 Sec 8 counts a full recomputation, 2 all-reduces, each of n moving 2n)
    pa_comm      Pa's all-gather of each checkpoint (1 x seq x hidden per block, Sec 8)
    host         Pa+cpu: each checkpoint slice to the host and back (2x Pa's bytes, Sec 8)
    dp_comm      the engine's own collectives per step (elements and calls by kind, counted at
                 scale by ``dp_traffic``), not hidden behind compute (``dp_overlap`` of them is);
                 one all-reduce is the step's statistics, a few numbers: its latency, in the step
    optimizer    this rank's AdamW segment, elements / elements per second
    stage3_*     stage 3's own work beside its collectives (gathering and freeing each unit's full
                 buffer, its hooks and gradient buckets), seconds per element of a gather pass, in
                 forward and in backward: measured as stage 3 minus stage 0 on one rank

A collective over p ranks on a ring (what NCCL and gloo run) costs ``(p-1)/p * moved * bytes /
bandwidth + hops * latency`` with ``moved`` counted as the paper counts (all-reduce of n: 2n,
reduce-scatter or all-gather of n: n) and 2(p-1) hops for an all-reduce, p-1 otherwise. A group
inside one node runs at the intra-node link; a group that spans nodes at the node's network
bandwidth shared by the groups of that kind that cross it at once (``Cluster.link``).

FLOPs (``training_flops``) are counted as Megatron-LM counts them (Narayanan et al. 2021, eq. 3):
a block's forward is 24·t·h² + 4·t·s·h for t = batch·seq tokens (the GEMMs and attention's two
batched products), the head's 2·t·h·V; backward is twice the forward; **checkpoint recomputation
is counted** (one more forward of the blocks): 96·b·s·l·h²·(1 + s/6h + V/16lh) in all. The paper
does not say how it counted (experiments/paper_data/zero-paper-facts.md: "How TFLOPS was counted"); recomputation is real work
the GPU does, so we count it, and say so wherever a TFLOPS number appears.

Each term's inputs are measured on the machine at hand (``experiments/throughput_study.py``:
block and head rates, the AdamW rate, the collectives' latency and bandwidth) and the model is
checked against timed runs before it is projected; ``V100_DGX2`` holds the published numbers of
the paper's machine, each with its source.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

CHECKPOINT_MODES = ("none", "plain", "pa", "pa_cpu")


# ------------------------------------------------------------------------------------------ FLOPs
def training_flops(layers: int, hidden: int, seq: int, vocab: int, batch: int, *,
                   recompute: bool = True) -> dict[str, float]:
    """FLOPs of one training step of ``batch`` sequences through a GPT-2-like model, by part:
    ``forward`` (blocks), ``backward`` (blocks, 2x), ``recompute`` (blocks, checkpointing),
    ``head`` (logits forward and backward, 3 x 2·t·h·V) and ``total``."""
    tokens = batch * seq
    block_forward = layers * (24 * tokens * hidden**2 + 4 * tokens * seq * hidden)
    parts = {"forward": float(block_forward), "backward": 2.0 * block_forward,
             "recompute": float(block_forward) if recompute else 0.0, "head": 6.0 * tokens * hidden * vocab}
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------------- compute rate
@dataclass(frozen=True)
class Rate:
    """FLOP/s sustained at (tokens per GEMM, hidden), interpolated between measured points in
    log-log space and held constant beyond them. ``points`` maps (tokens, hidden) -> FLOP/s on
    a full grid (every tokens value at every hidden value)."""

    points: dict

    @classmethod
    def constant(cls, flops_per_s: float) -> "Rate":
        return cls({(1, 1): float(flops_per_s)})

    @classmethod
    def fitted(cls, points: dict) -> "Rate":
        """The smooth rate through noisy measured ``points``: log FLOP/s fitted by least squares to
        a + b·log t + c·log h + d·log t·log h (the terms the grid can tell apart), evaluated on the
        grid. Interpolating those values is that surface exactly, so each prediction rests on every
        measurement, not only on the four around it; a grid too small to fit keeps its values."""
        import numpy as np

        keys = list(points)
        log_t, log_h = (np.log([k[i] for k in keys]) for i in (0, 1))
        columns = [np.ones(len(keys))]
        if len(set(log_t)) > 1:
            columns.append(log_t)
        if len(set(log_h)) > 1:
            columns.append(log_h)
        if len(columns) == 3:
            columns.append(log_t * log_h)
        design = np.stack(columns, axis=1)
        if len(keys) <= design.shape[1]:
            return cls(dict(points))
        coef, *_ = np.linalg.lstsq(design, np.log([points[k] for k in keys]), rcond=None)
        return cls({k: float(v) for k, v in zip(keys, np.exp(design @ coef))})

    def __call__(self, tokens: float, hidden: float) -> float:
        ts = sorted({t for t, _ in self.points})
        hs = sorted({h for _, h in self.points})

        def bracket(values, x):
            x = min(max(x, values[0]), values[-1])
            i = min(max(bisect_left(values, x), 1), len(values) - 1) if len(values) > 1 else 0
            lo, hi = values[max(i - 1, 0)], values[i]
            w = 0.0 if hi == lo else (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return lo, hi, w

        t0, t1, wt = bracket(ts, tokens)
        h0, h1, wh = bracket(hs, hidden)
        corners = (((1 - wt) * (1 - wh), t0, h0), (wt * (1 - wh), t1, h0), ((1 - wt) * wh, t0, h1), (wt * wh, t1, h1))
        return math.exp(sum(w * math.log(self.points[(t, h)]) for w, t, h in corners))


# ---------------------------------------------------------------------------------- collectives
@dataclass(frozen=True)
class Link:
    """Bus bandwidth one ring of ranks sustains (bytes/s, each direction) and the latency of one hop (s)."""

    bandwidth: float
    latency: float


HOPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1,
        "blocking_all_reduce": 2, "blocking_all_gather": 1}
"""Ring hops per collective, over (p - 1) ranks. ``blocking_*``: a collective waited for as soon
as it is issued (Megatron's all-reduces, Pa's gathers of checkpoints, the step's statistics), where
the engine's bucket reductions and gathers are several in flight: a machine may run the two at other
constants (``Cluster.intra_by_kind``; the paper's machine has one link for all)."""

MP_LOSS_CALLS = 2
"""All-reduces of the vocabulary-parallel loss per forward (the max, then the sum of exponentials
with the target logit): a few values per token each."""


def mp_all_reduce_calls(layers: int, recompute: bool) -> tuple[int, int]:
    """Megatron's all-reduces of batch x seq x hidden values per step, (forward, backward): 2 per
    block each way, the embedding's in forward and the head's in backward, and with checkpointing 1
    per block in recomputation (see the module docstring)."""
    return 2 * layers + 1, (3 if recompute else 2) * layers + 1


STEP_STATS_CALLS = 2
"""All-reduces of the step's vote (a few numbers, engine.step: core/optim.py) per step over the
data-parallel group: the sum of the norm, flags and counts, and, under checks="strict" (the default
the studies run), the exact MAX vote; their latency goes in the step."""

MP_STEP_STATS_CALLS = 1
"""... and over the MP group, with model parallelism: the norm's sum."""


def collective_seconds(kind: str, moved: float, elem_bytes: float, ranks: int, link: Link,
                       calls: float = 1) -> float:
    """Time of ``calls`` collectives of ``kind`` over ``ranks`` ranks on a ring moving ``moved``
    elements in all (the paper's count: all-reduce of n moves 2n)."""
    if kind not in HOPS:
        raise ValueError(f"kind = {kind!r} is not a collective the model knows: expected one of {sorted(HOPS)}")
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * moved * elem_bytes / link.bandwidth + calls * HOPS[kind] * (ranks - 1) * link.latency


@dataclass(frozen=True)
class Cluster:
    """What the model needs to know of a machine. ``rates``: FLOP/s of one rank (``Rate``) for
    "block_forward", "block_backward", "head_forward" and "head_backward"; ``adamw_rate``:
    elements per second of the optimizer step (norm, AdamW, clearing gradients);
    ``ranks_per_node``; ``intra``: the link inside a node; ``node_bandwidth`` / ``node_latency``:
    a node's network (bytes/s each direction, all its NICs) and hop latency; ``host``: the
    device-host link (Pa+cpu);
    ``dp_overlap``: the share of the data-parallel collectives hidden behind compute;
    ``stage3_own``: stage 3's own seconds per element of a gather pass, (forward, backward), beside
    its collectives (0 where not measured)."""

    name: str
    rates: dict
    adamw_rate: float
    ranks_per_node: int
    intra: Link
    node_bandwidth: float
    node_latency: float
    host: Link
    dp_overlap: float = 0.0
    intra_by_kind: dict = field(default_factory=dict)
    stage3_own: tuple = (0.0, 0.0)
    sources: dict = field(default_factory=dict, compare=False)

    def link(self, group_size: int, members_per_node: int, kind: str | None = None) -> Link:
        """The link of one group of ``group_size`` ranks with ``members_per_node`` of them in each
        node: inside a node the intra-node link (``intra_by_kind[kind]`` where a collective's own
        implementation was measured apart, as gloo's); across nodes the node's network, shared by
        the ranks_per_node / members_per_node groups of this kind that cross it at the same time."""
        if group_size <= self.ranks_per_node and members_per_node >= group_size:
            return self.intra_by_kind.get(kind, self.intra)
        concurrent = max(1, self.ranks_per_node // max(1, members_per_node))
        return Link(min(self.intra.bandwidth, self.node_bandwidth / concurrent), self.node_latency)


# ------------------------------------------------------------------------------------- one step
@dataclass(frozen=True)
class StepSpec:
    """One rank's step: a GPT-2-like model, ``batch`` sequences per data-parallel rank, ``nd`` x
    ``nm`` ranks (MP groups inside a node first, as Megatron and the paper place them), ZeRO
    ``stage``, checkpoint mode, element size in bytes, and the engine's data-parallel traffic per
    step by kind: ``dp_moved`` and ``dp_calls`` (from ``dp_traffic`` or a real run's counters)."""

    layers: int
    hidden: int
    seq: int
    vocab: int
    batch: int
    nd: int
    nm: int
    stage: int
    checkpoints: str = "plain"
    elem_bytes: int = 2
    dp_moved: dict = field(default_factory=dict)
    dp_calls: dict = field(default_factory=dict)
    optimizer_elements: float = 0.0

    def __post_init__(self):
        if self.checkpoints not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoints = {self.checkpoints!r} is not allowed: expected one of {CHECKPOINT_MODES}")

    def flops(self) -> dict[str, float]:
        return training_flops(self.layers, self.hidden, self.seq, self.vocab, self.batch,
                              recompute=self.checkpoints != "none")


@dataclass(frozen=True)
class Prediction:
    """Seconds per step by term, their sum, and the rates they imply (per GPU / rank)."""

    terms: dict
    seconds: float
    flops_per_rank: float

    @property
    def tflops(self) -> float:
        return self.flops_per_rank / self.seconds / 1e12

    def phases(self) -> dict[str, float]:
        """The terms grouped as a profile of the engine's phases shows them."""
        t = self.terms
        return {"forward": t["forward"] + t["head_forward"] + t["mp_forward"] + t["pa_comm"] / 2 + t["host"] / 2
                + t["dp_forward"] + t["stage3_forward"],
                "backward": t["backward"] + t["head_backward"] + t["mp_backward"] + t["pa_comm"] / 2
                + t["host"] / 2 + t["dp_backward"] + t["stage3_backward"],
                "step": t["optimizer"] + t["dp_step"]}


def predict(spec: StepSpec, cluster: Cluster) -> Prediction:
    """The step time of one rank of ``spec`` on ``cluster``, term by term (see the module docstring)."""
    f = spec.flops()
    nm, tokens = spec.nm, spec.batch * spec.seq
    rate = {name: r(tokens, spec.hidden / nm) for name, r in cluster.rates.items()}
    terms = {"forward": f["forward"] / nm / rate["block_forward"],
             "backward": f["backward"] / nm / rate["block_backward"] + f["recompute"] / nm / rate["block_forward"],
             "head_forward": f["head"] / 3 / nm / rate["head_forward"],
             "head_backward": 2 * f["head"] / 3 / nm / rate["head_backward"]}
    per_block = tokens * spec.hidden          # one activation of the block boundary
    recompute = spec.checkpoints != "none"
    mp_link = cluster.link(nm, min(nm, cluster.ranks_per_node), "blocking_all_reduce")
    forward_calls, backward_calls = mp_all_reduce_calls(spec.layers, recompute)
    loss_moved = 2 * tokens + 2 * 2 * tokens     # the loss's max, then (sum of exponentials, target logit)

    def mp_all_reduces(moved: float, elem_bytes: float, calls: int) -> float:
        return collective_seconds("blocking_all_reduce", moved, elem_bytes, nm, mp_link, calls)

    terms["mp_forward"] = (mp_all_reduces(2 * forward_calls * per_block, spec.elem_bytes, forward_calls)
                           + mp_all_reduces(loss_moved, 4, MP_LOSS_CALLS))
    terms["mp_backward"] = mp_all_reduces(2 * backward_calls * per_block, spec.elem_bytes, backward_calls)
    pa = spec.checkpoints in ("pa", "pa_cpu") and nm > 1
    terms["pa_comm"] = collective_seconds("blocking_all_gather", spec.layers * per_block, spec.elem_bytes, nm,
                                          cluster.link(nm, min(nm, cluster.ranks_per_node), "blocking_all_gather"),
                                          spec.layers) if pa else 0.0
    host_bytes = 2 * spec.layers * math.ceil(per_block / nm) * spec.elem_bytes
    terms["host"] = (host_bytes / cluster.host.bandwidth + 2 * spec.layers * cluster.host.latency
                     if spec.checkpoints == "pa_cpu" else 0.0)
    # data parallelism: each DP group has one member per MP group; MP groups fill nodes first
    dp_members_per_node = max(1, cluster.ranks_per_node // nm)
    dp_link = {kind: cluster.link(spec.nd, min(spec.nd, dp_members_per_node), kind) for kind in HOPS}
    # one of the all-reduces is the step's statistics (a few numbers, latency only), in the step
    calls = dict(spec.dp_calls)
    if spec.dp_moved.get("all_reduce"):
        calls["all_reduce"] = max(calls.get("all_reduce", 1) - STEP_STATS_CALLS, 0)
    dp = {kind: collective_seconds(kind, moved, spec.elem_bytes, spec.nd, dp_link[kind], calls.get(kind, 1))
          for kind, moved in spec.dp_moved.items()}
    stats = collective_seconds("blocking_all_reduce", 0, spec.elem_bytes, spec.nd, dp_link["blocking_all_reduce"],
                               STEP_STATS_CALLS)
    if nm > 1:                    # and again over the MP group
        stats += mp_all_reduces(0, spec.elem_bytes, MP_STEP_STATS_CALLS)
    exposed = 1.0 - cluster.dp_overlap
    reductions = dp.get("reduce_scatter", 0.0) + dp.get("all_reduce", 0.0)
    gathers = dp.get("all_gather", 0.0) + dp.get("broadcast", 0.0)
    if spec.stage == 3:           # gathers in forward and backward (half each), reductions in backward
        terms.update(dp_forward=exposed * gathers / 2, dp_backward=exposed * (gathers / 2 + reductions),
                     dp_step=stats)
    else:                         # reductions in backward, the regather after the update (stages 1-2)
        terms.update(dp_forward=0.0, dp_backward=exposed * reductions, dp_step=gathers + stats)
    terms["optimizer"] = spec.optimizer_elements / cluster.adamw_rate
    per_pass = spec.dp_moved.get("all_gather", 0.0) / 2 if spec.stage == 3 else 0.0
    terms["stage3_forward"], terms["stage3_backward"] = (per_element * per_pass for per_element in cluster.stage3_own)
    return Prediction(terms, sum(terms.values()), f["total"] / nm)


def optimizer_elements(params_per_mp_rank: float, stage: int, nd: int) -> float:
    """Elements this rank's AdamW updates: all of them at stage 0, its 1/Nd shard otherwise."""
    return params_per_mp_rank if stage == 0 else math.ceil(params_per_mp_rank / nd)


# ------------------------------------------------------------------------- the paper's machine
def _v100_dgx2() -> Cluster:
    """400 V100-SXM3-32GB in 25 DGX-2 nodes (the paper, Sec 10.1 and the SC20 appendix)."""
    sources = {
        "block_rate": "39 TFLOPS sustained by one V100 training a 1.2B GPT-2 (Megatron-LM, Shoeybi et al. "
                      "2019, arXiv:1909.08053, Sec 5.1: 30% of peak); held constant over shapes (the GEMMs "
                      "of these models are compute-bound: the roofline of a V100 at 125 TFLOPS / 900 GB/s)",
        "intra": "NVSwitch, 300 GB/s per GPU (the paper, Sec 10.2) = 150 GB/s each direction",
        "node_bandwidth": "8 x 100 Gb/s InfiniBand per node (SC20 appendix) = 100 GB/s each direction",
        "adamw_rate": "V100 HBM2 900 GB/s (datasheet) / 28 bytes per element (fp32 master, momentum, "
                      "variance read and written, fp16 gradient read, fp16 parameter written)",
        "host": "PCIe 3.0 x16, 16 GB/s nominal (datasheet), shared by two GPUs per PCIe switch in a DGX-2",
        "latency": "assumed: 5 us per NVSwitch hop, 10 us per InfiniBand hop (NCCL's small-message "
                   "latencies are of this order); only large model-parallel groups are sensitive to it",
        "dp_overlap": "assumed 0: reductions not hidden behind compute (the paper does not say)",
    }
    rate = Rate.constant(39e12)
    rates = dict.fromkeys(("block_forward", "block_backward", "head_forward", "head_backward"), rate)
    return Cluster("V100 DGX-2 (published numbers)", rates, adamw_rate=900e9 / 28, ranks_per_node=16,
                   intra=Link(150e9, 5e-6), node_bandwidth=100e9, node_latency=10e-6, host=Link(8e9, 10e-6),
                   sources=sources)


V100_DGX2 = _v100_dgx2()
"""The paper's cluster from published numbers (``V100_DGX2.sources`` says where each comes from)."""


# ----------------------------------------------------------- the engine's own traffic at scale
def dp_traffic(layers: int, hidden: int, heads: int, stage: int, nd: int, *, nm: int = 1, vocab: int = 50257,
               seq: int = 1024, batch: int = 1, bucket_numel: int = 2**22) -> tuple[dict, dict]:
    """Elements moved and collective calls per step, by kind, of one data-parallel rank of the real
    engine (fp16) for a GPT-2-like model at the paper's scale: the engine runs one training step
    on meta tensors as rank 0 of a fake group of ``nd`` ranks (at_scale.py) and
    collective_count.CountCollectives counts what it issues. The model is built at 1 and 2 layers
    and the counts extrapolated linearly to ``layers`` (every block is laid out alike; exact up to
    a group's padding, under Nd elements per group)."""
    from .at_scale import ModelShape

    one, two = (_one_step_counts(ModelShape(depth, hidden, heads, vocab, seq), stage, nd, nm, batch, bucket_numel)
                for depth in (1, 2))

    def extrapolate(at_one: dict, at_two: dict) -> dict:
        return {kind: at_one.get(kind, 0) + (layers - 1) * (at_two.get(kind, 0) - at_one.get(kind, 0))
                for kind in set(at_one) | set(at_two)}

    return extrapolate(one[0], two[0]), extrapolate(one[1], two[1])


def _one_step_counts(shape, stage: int, nd: int, nm: int, batch: int, bucket_numel: int) -> tuple[dict, dict]:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    from .at_scale import fake_world
    from .collective_count import CountCollectives
    from ..config import ZeroConfig
    from ..engine import initialize

    with fake_world(nd * nm):
        dp_group = dist.new_group(list(range(0, nd * nm, nm)))
        model = shape.build("meta", mp=nm)
        engine = initialize(model, ZeroConfig(stage=stage, dtype="fp16", kernels="torch", bucket_numel=bucket_numel),
                            dp_group)
        tokens = torch.zeros(batch, shape.seq, dtype=torch.long, device="meta")
        for _ in range(2):              # count the second: the first also agrees on the bucket order
            with CountCollectives() as counter:
                logits = engine(tokens)
                engine.backward(F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()))
                engine.step()
                engine.zero_grad()
        engine.close()
    return dict(counter.moved), dict(counter.calls)
