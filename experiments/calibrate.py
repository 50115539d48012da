"""The machine at hand, measured for the performance model (zero_ref.analysis.perf_model): compute rates, the
AdamW rate and the collectives' latency and bandwidth. Nothing here is fitted to the paper.

* **block rates**: forward, and forward + backward, of one GPT-2 block (models.ParallelGPTBlock,
  the block the timed runs train) on a grid of (tokens, hidden) at ``seq`` positions, FLOPs as
  perf_model.training_flops counts them (backward = 2x forward) over the median times: FLOP/s;
* **head rates**: the same for the logits (tied embedding) and the loss: 2·t·h·V FLOPs forward;
* **step rate**: the engine's whole optimizer step per element (norm, AdamW, clearing gradients)
  on a model unlike the timed ones;
* all three with one thread per rank (as the timed runs) and, for each world size p, p ranks
  measuring at once: ranks that share the machine's cores, caches and memory bandwidth slow each
  other down, and that is part of what a rank of a p-rank run computes at;
* **stage 3's own work** (``stage3_own``): stage 3 minus stage 0 on one rank, forward and
  backward, per element of a gather pass (its hooks, buffers and bookkeeping beside the collectives);
* **links**: at each world size p, all-reduce, reduce-scatter and all-gather of 16K..4M fp32
  elements through the engine's own ``Comm`` over gloo, ``BURST`` calls in flight at once as the
  engine issues them, and the model-parallel layers' all-reduce and all-gather one blocking call
  at a time as they issue them (``blocking_*``), timed (median of the slowest rank), and
  per kind one ring ``Link(bandwidth, latency)`` fitted by least squares to
  t = (p-1)/p·moved·4/bandwidth + hops·(p-1)·latency.

``cpu_cluster(calibration, world)`` turns the measurements into a perf_model.Cluster for a run of
``world`` ranks on this machine.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F

from zero_ref.analysis import perf_model as pm

SEQ = 128
GRID_TOKENS = (128, 256, 512, 1024)
GRID_HIDDEN = (128, 256, 384)
LINK_SIZES = (2**14, 2**16, 2**18, 2**20, 2**22)


def model_head_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss the timed model's head ends in (models.ParallelGPT.forward, not split): the
    vocabulary-parallel cross-entropy of each next token, its mean."""
    from zero_ref.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits[:, :-1], labels[:, 1:], 0, None).mean()


def compute_rates(vocab: int, seq: int = SEQ, tokens=GRID_TOKENS, hiddens=GRID_HIDDEN, reps: int = 5,
                  sync=lambda: None, device: torch.device = torch.device("cpu"),
                  dtype: torch.dtype = torch.float32, head_loss=model_head_loss) -> dict[str, dict]:
    """FLOP/s of a block's and of the head's forward and backward at each (tokens, hidden) in
    ``dtype`` on ``device`` (the CPU: at this process's thread count): {"block_forward":
    {(tokens, hidden): FLOP/s}, ...}. ``sync()`` runs before each measurement (a barrier, when
    several ranks measure at once). ``head_loss(logits, labels)``: the loss the head ends in
    (default: the timed model's, ``model_head_loss``)."""
    from zero_ref.models import ParallelGPTBlock

    rates = {name: {} for name in ("block_forward", "block_backward", "head_forward", "head_backward")}
    for hidden in hiddens:
        block = ParallelGPTBlock(hidden, hidden // 64, None, iter(range(10))).to(device, dtype)
        embedding = torch.randn(vocab, hidden, device=device, dtype=dtype, requires_grad=True)
        for t in tokens:
            x = torch.randn(t // seq, seq, hidden, device=device, dtype=dtype, requires_grad=True)
            labels = torch.randint(0, vocab, (t // seq, seq), device=device)
            parts = {"block": lambda: block(x).sum(),
                     "head": lambda: head_loss(F.linear(x, embedding), labels)}
            flops = pm.training_flops(1, hidden, seq, vocab, t // seq, recompute=False)
            forward_flops = {"block": flops["forward"], "head": flops["head"] / 3}
            for part, run in parts.items():
                sync()
                forward, backward = forward_backward_seconds(run, device, reps)
                rates[f"{part}_forward"][(t, hidden)] = forward_flops[part] / forward
                rates[f"{part}_backward"][(t, hidden)] = 2 * forward_flops[part] / backward
    return rates


def forward_backward_seconds(run, device: torch.device, reps: int, warmup: int = 1) -> tuple[float, float]:
    """Median seconds of ``run()`` (a forward ending in a scalar) and of that scalar's backward,
    both timed within the same iterations (on CUDA to the end of their kernels), so that whatever
    slows this rank down meanwhile (other ranks sharing its cores) weighs on both alike."""
    from experiments.device_clock import synchronizer

    sync = synchronizer(device)
    for _ in range(warmup):
        run().backward()
    forward, backward = [], []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        loss = run()
        sync()
        middle = time.perf_counter()
        loss.backward()
        sync()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    return statistics.median(forward), statistics.median(backward)


def step_rate(group, width: int = 1024, reps: int = 9, sync=lambda: None, device: torch.device | None = None,
              dtype: str = "fp32") -> float:
    """Elements per second of the engine's whole optimizer step (gradient norm and overflow check,
    AdamW, clearing the gradients) over ``group`` (here: this rank alone), stage 0, ``dtype``, on a
    model unlike the timed ones (four ``width`` x ``width`` linear layers); on ``device`` (None: the
    CPU), timed to the end of its kernels."""
    import zero_ref
    from experiments.device_clock import synchronizer

    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).to(device)
    params = sum(p.numel() for p in model.parameters())
    config = zero_ref.ZeroConfig(stage=0, dtype=dtype, bucket_numel=width * width)
    engine = zero_ref.initialize(model, config, group, device=device)
    x = torch.randn(8, width, device=device)
    done = synchronizer(device)
    times = []
    for _ in range(reps + 2):
        engine.backward(engine(x).square().mean())
        sync()
        done()
        start = time.perf_counter()
        engine.step()
        done()
        times.append(time.perf_counter() - start)
    engine.close()
    return params / statistics.median(times[2:])


OWN_SHAPE = {"layers": 4, "hidden": 384, "heads": 6, "batch": 1}
"""The GPT measured for stage 3's own work: a calibration point (hidden 384), not a timed model."""


def stage3_own(group, vocab: int, seq: int = SEQ, shape: dict = OWN_SHAPE, reps: int = 9, sync=lambda: None,
               device: torch.device | None = None, dtype: str = "fp32") -> tuple[float, float, float]:
    """Stage 3's own work beside its collectives, in seconds per element of one gather pass:
    (forward, backward, copy). Forward and backward: what the engine does that stage 0 does not,
    on the same model at the same moment: the hooks that gather and free each unit, reallocating
    its full buffer, its gradients sorted into buckets, the bookkeeping of the schedule, and the
    collectives, which over one rank are local copies (comm.Comm): the gather's (1 per pass) and
    the reduce-scatter's (backward). ``copy``: those copies' own time, one pass of elements. A real
    ring writes those elements itself, and the fitted links hold that: ``cpu_cluster`` takes the
    copies off again where there are links (1 in forward, 2 in backward).

    Measured over ``group`` (here: this rank alone, while the other ranks of a calibration do the
    same, so the cores are shared as in a run): a stage-0 and a stage-3 engine of the same GPT
    (``shape``), steps interleaved, the median over ``reps`` of stage 3's forward (and backward)
    minus stage 0's."""
    import zero_ref
    from experiments.device_clock import synchronizer
    from zero_ref.core.activations import checkpoint_blocks
    from zero_ref.models import ParallelGPT

    done = synchronizer(device)
    bucket_numel = 12 * shape["hidden"] ** 2          # about one block, as the timed runs' buckets
    engines = {}
    for stage in (0, 3):
        with torch.device("meta"):
            model = ParallelGPT(shape["layers"], shape["hidden"], shape["heads"], vocab, seq, seed=0)
        checkpoint_blocks(model.blocks, "plain", None)
        config = zero_ref.ZeroConfig(stage=stage, dtype=dtype, bucket_numel=bucket_numel)
        engines[stage] = zero_ref.initialize(model, config, group, device=device)
    elements = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, vocab, (shape["batch"], seq), device=device)
    extra = []
    for rep in range(reps + 1):
        phases = {}
        for stage, engine in engines.items():
            sync()
            done()
            start = time.perf_counter()
            loss = engine(tokens)
            done()
            middle = time.perf_counter()
            engine.backward(loss)
            done()
            phases[stage] = (middle - start, time.perf_counter() - middle)
            engine.step()
        if rep:                       # the first pair warms up
            extra.append([three - zero for three, zero in zip(phases[3], phases[0])])
    for engine in engines.values():
        engine.close()
    forward, backward = (max(statistics.median(e[i] for e in extra), 0.0) for i in (0, 1))
    copy = _copy_seconds(elements, bucket_numel, reps, sync, device, dtype)
    return forward / elements, backward / elements, copy / elements


def _copy_seconds(elements: int, piece: int, reps: int, sync, device, dtype: str) -> float:
    """Median seconds to copy ``elements`` elements in pieces of ``piece`` into buffers written before."""
    from experiments.device_clock import synchronizer
    from zero_ref.config import DTYPES

    done = synchronizer(device)
    kind = DTYPES[dtype]
    sizes = [min(piece, elements - start) for start in range(0, elements, piece)]
    sources = [torch.randn(n, device=device).to(kind) for n in sizes]
    targets = [torch.zeros_like(source) for source in sources]
    times = []
    for _ in range(reps):
        sync()
        done()
        start = time.perf_counter()
        for target, source in zip(targets, sources):
            target.copy_(source)
        done()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rates_at_world(rank: int, world: int, vocab: int, reps: int) -> tuple[dict, float, tuple]:
    """Every rank of ``world`` measures the same rates at the same time (one thread each, a barrier
    before each measurement), so the rates include what ranks sharing this machine cost each other."""
    torch.set_num_threads(1)
    alone = [dist.new_group([r]) for r in range(world)]       # every rank calls new_group for every group
    rates = compute_rates(vocab, reps=reps, sync=dist.barrier)
    step = step_rate(alone[rank], sync=dist.barrier)
    return rates, step, stage3_own(alone[rank], vocab, reps=2 * reps, sync=dist.barrier)


BURST = 4
"""Collectives issued back to back before the first wait, as the engine issues its bucket reductions
and regathers (several in flight; the time per call is the burst's over BURST)."""


def _time_collectives(rank: int, world: int, sizes, reps: int) -> list[dict]:
    """Each collective timed as it is issued in a step. The engine's own, through its ``Comm``
    (zero_ref.core.comm), ``BURST`` calls in flight before the first wait: what a step runs, not a single
    blocking call of the backend's (on gloo the engine's reduce-scatter is an all-to-all and a local
    sum, 1.2-2x faster than gloo's own; a burst pays the per-call latency less than back-to-back
    blocking calls; both measured at 2-4 ranks). The model-parallel layers' all-reduces and gathers
    (``blocking_*``), through torch.distributed, each waited for at once, as tensor_parallel and
    activations issue them. Small messages are timed more often (their times are the noisiest:
    scheduling decides them when ranks share cores)."""
    from zero_ref.core.comm import Comm, CommLedger, all_gather_tensor

    torch.set_num_threads(1)          # as the timed runs' ranks
    comm = Comm(None, CommLedger(), torch.device("cpu"))
    rows = []
    for numel in sizes:
        numel -= numel % world
        fulls = [torch.randn(numel) for _ in range(BURST)]
        shards = [torch.randn(numel // world) for _ in range(BURST)]
        ops = {"all_reduce": (lambda i: comm.all_reduce(fulls[i], async_op=True), 2 * numel, BURST),
               "reduce_scatter": (lambda i: comm.reduce_scatter(shards[i], fulls[i], async_op=True), numel, BURST),
               "all_gather": (lambda i: comm.all_gather(fulls[i], shards[i], async_op=True), numel, BURST),
               "blocking_all_reduce": (lambda i: dist.all_reduce(fulls[i]), 2 * numel, 1),
               "blocking_all_gather": (lambda i: all_gather_tensor(fulls[i], shards[i]), numel, 1)}
        for kind, (issue, moved, in_flight) in ops.items():
            times = []
            for rep in range(reps * max(1, max(sizes) // numel // 16) + 1):
                dist.barrier()
                start = time.perf_counter()
                for pending in [issue(i) for i in range(in_flight)]:
                    if pending is not None:
                        pending.wait()
                elapsed = torch.tensor([(time.perf_counter() - start) / in_flight])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep:
                    times.append(elapsed.item())
            rows.append({"world": world, "kind": kind, "numel": numel, "moved": moved,
                         "seconds": statistics.median(times)})
    return rows


def fit_link(rows: list[dict]) -> pm.Link:
    """The ring Link that best fits timed collectives of one kind and world size (least squares
    relative to each time, so small and large messages weigh alike; both coefficients >= 0)."""
    world = rows[0]["world"]
    x = np.array([[(world - 1) / world * r["moved"] * 4, pm.HOPS[r["kind"]] * (world - 1)] for r in rows])
    y = np.array([r["seconds"] for r in rows])
    (inv_bw, latency), *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    return pm.Link(1.0 / max(inv_bw, 1e-15), max(latency, 0.0))


def measure_links(worlds=(2, 3, 4), sizes=LINK_SIZES, reps: int = 5) -> tuple[dict, list[dict]]:
    """A fitted ring Link per (world size, kind): each collective is implemented its own way (the
    engine's gloo reduce-scatter is an all-to-all), so each kind has its own constants."""
    from zero_ref.launch import spawn

    links, rows = {}, []
    for world in worlds:
        measured = spawn(_time_collectives, world, sizes, reps, timeout=600)[0]
        rows += measured
        for kind in dict.fromkeys(r["kind"] for r in measured):
            links[(world, kind)] = fit_link([r for r in measured if r["kind"] == kind])
    return links, rows


def _mean_over_ranks(per_rank: list[tuple]) -> tuple:
    """One rank's rates at a world size: each rate's harmonic mean over the ranks that measured it
    at once (work over the mean time), as the timed runs' phases are each rank's mean; stage 3's
    own seconds per element, their mean. Ranks that share cores are not served alike: one may
    finish a short measurement before the scheduler lets another in, so a single rank's numbers
    would say little about a typical one."""
    def harmonic(values):
        return len(values) / sum(1.0 / v for v in values)

    rates_by_rank, steps, owns = zip(*per_rank)
    rates = {name: {point: harmonic([r[name][point] for r in rates_by_rank]) for point in points}
             for name, points in rates_by_rank[0].items()}
    return rates, harmonic(steps), tuple(statistics.mean(values) for values in zip(*owns))


def calibrate(vocab: int, quick: bool = False, worlds=(1, 2, 3, 4)) -> dict:
    """Everything cpu_cluster needs, measured now on this machine: compute and step rates with
    ``world`` one-thread ranks computing at once (their mean over the ranks), for each world size,
    and the collectives."""
    from zero_ref.launch import spawn

    start = time.perf_counter()
    measured = {w: _mean_over_ranks(spawn(_rates_at_world, w, vocab, 3 if quick else 5, timeout=900)) for w in worlds}
    links, link_rows = measure_links([w for w in worlds if w > 1], reps=3 if quick else 5)
    return {"cores": len(os.sched_getaffinity(0)), "worlds": list(worlds),
            "rates": {w: rates for w, (rates, _, _) in measured.items()},
            "adamw": {w: step for w, (_, step, _) in measured.items()},
            "stage3_own": {w: own for w, (_, _, own) in measured.items()}, "links": links, "link_rows": link_rows,
            "vocab": vocab, "seconds": time.perf_counter() - start}


def average(before: dict, after: dict) -> dict:
    """Two calibrations of the same world sizes (one taken before a study's runs, one after) as
    one: each rate their geometric mean, the links fitted to both sets of timings. The machine
    drifts while the runs take their turn; the two bracket that."""
    def mean(a: float, b: float) -> float:
        return (a * b) ** 0.5

    rates = {w: {name: {point: mean(value, after["rates"][w][name][point]) for point, value in points.items()}
                 for name, points in by_name.items()} for w, by_name in before["rates"].items()}
    rows = before["link_rows"] + after["link_rows"]
    links = {(w, kind): fit_link([r for r in rows if r["world"] == w and r["kind"] == kind])
             for w, kind in before["links"]}
    own = {w: tuple((a + b) / 2 for a, b in zip(v, after["stage3_own"][w]))
           for w, v in before.get("stage3_own", {}).items()}
    return {**before, "rates": rates, "adamw": {w: mean(v, after["adamw"][w]) for w, v in before["adamw"].items()},
            "stage3_own": own, "links": links, "link_rows": rows, "seconds": before["seconds"] + after["seconds"],
            "drift": {w: drift(before, after, w) for w in before["worlds"]}}


def drift(before: dict, after: dict, world: int) -> float:
    """How far the machine moved between two calibrations at ``world``: the median over the compute
    rates' grid points of |after / before - 1|."""
    changes = [abs(after["rates"][world][name][point] / value - 1.0)
               for name, points in before["rates"][world].items() for point, value in points.items()]
    return statistics.median(changes)


def merge(earlier: dict, later: dict) -> dict:
    """Two calibrations as one: ``later``'s world sizes replace ``earlier``'s (a study calibrates
    each world size just before it times runs there, so that the machine's drift over the study,
    shared with other work, lies between a measurement and its use for seconds, not minutes)."""
    if not earlier:
        return later
    worlds = sorted(set(earlier["worlds"]) | set(later["worlds"]))
    links = {key: link for key, link in earlier["links"].items() if key[0] not in later["worlds"]} | later["links"]
    rows = [row for row in earlier["link_rows"] if row["world"] not in later["worlds"]] + later["link_rows"]
    return {**earlier, "worlds": worlds, "rates": earlier["rates"] | later["rates"],
            "adamw": earlier["adamw"] | later["adamw"],
            "stage3_own": earlier.get("stage3_own", {}) | later.get("stage3_own", {}),
            "links": links, "link_rows": rows,
            "seconds": earlier["seconds"] + later["seconds"],
            "drift": earlier.get("drift", {}) | later.get("drift", {})}


def cpu_cluster(cal: dict, world: int, alone: bool = False, smooth: bool = True) -> pm.Cluster:
    """The perf_model.Cluster of ``world`` one-thread ranks on this machine (one node): compute at
    the rates measured with ``world`` ranks computing at once (``alone``: with one, as if every rank
    had the machine to itself), smoothed over the grid (``Rate.fitted``: a single point measured
    while ranks share two cores is off by 10-15%; ``smooth=False`` keeps the measured points, as for
    one rank on an idle GPU, whose rates are not noisy and follow no smooth surface), collectives at
    the links fitted at ``world``, stage 3's own work as measured at the same ranks (``_stage3_own``).
    More ranks than cores (``cal["cores"]``) share them: no rank can then sustain more than cores /
    world of a lone rank's rate, and a measurement above that share (its window overlapped the other
    ranks' idle moments at the barriers: at 3 ranks on 2 cores the short ones summed to 2.4 cores) is
    held to it (``fair_share``)."""
    by_kind = {kind: link for (w, kind), link in cal["links"].items() if w == world}
    link = by_kind.get("all_reduce", pm.Link(float("inf"), 0.0))
    at = 1 if alone else world
    rate = pm.Rate.fitted if smooth else pm.Rate
    measured, adamw = fair_share(cal, at)
    rates = {name: rate(points) for name, points in measured.items()}
    return pm.Cluster(f"this machine, {world} one-thread rank(s)", rates, adamw, world, link,
                      link.bandwidth, link.latency, pm.Link(float("inf"), 0.0), intra_by_kind=by_kind,
                      stage3_own=_stage3_own(cal, at, collectives_local=world == 1))


def fair_share(cal: dict, world: int) -> tuple[dict, float]:
    """The compute rates and the optimizer step rate measured with ``world`` one-thread ranks at once,
    each at most ``cores / world`` of the same rate measured with one rank (where the calibration
    has the machine's core count and one rank's rates): ranks that outnumber the cores share them."""
    rates, adamw = cal["rates"][world], cal["adamw"][world]
    cores, lone = cal.get("cores"), cal["rates"].get(1)
    if not cores or world <= cores or lone is None:
        return rates, adamw
    share = cores / world
    held = {name: {point: min(value, share * lone[name].get(point, math.inf)) for point, value in points.items()}
            for name, points in rates.items()}
    return held, min(adamw, share * cal["adamw"].get(1, math.inf))


def _stage3_own(cal: dict, at: int, collectives_local: bool) -> tuple[float, float]:
    """Stage 3's own seconds per element of a pass (forward, backward) as measured at ``at`` ranks
    (``stage3_own``); where the collectives are not local, less the copies the links already hold."""
    forward, backward, copy = cal.get("stage3_own", {}).get(at, (0.0, 0.0, 0.0))
    if collectives_local:
        return forward, backward
    return max(forward - copy, 0.0), max(backward - 2 * copy, 0.0)
