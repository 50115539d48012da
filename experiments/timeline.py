"""One ZeRO step as it really happens: a traced timeline per stage (the walkthrough's figures).

What runs: a tiny model of three residual MLP blocks (`TinyBlocks`, Ψ = 395,136 parameters; bf16
parameters and gradients, fp32 AdamW state: the paper's 2 + 2 + K bytes per parameter, K = 12), at
world size 2 on gloo (two spawned CPU ranks), for each stage 0-3. `bucket_numel` is one block, so
stages 0-2 reduce one bucket per block and stage 3 gathers one unit per block. Each rank runs one
warm-up step (the engine learns its bucket order and gather schedule and makes its constant-size
buckets), then one traced step, under torch.profiler with memory profiling from the moment the
model is built.

What is read from the trace (nothing is timed by hand):

* the engine's labels (labels.py, engine.py): the phases "zero_ref.forward/backward/optimizer/
  after_update"; every collective's "zero_ref::issue <kind> #n" and "zero_ref.wait <kind> #n", and
  the stage's event around the issue ("zero_ref::gather unit g", "::reduce bucket g", "::regather
  bucket g", "::schedule round"); "zero_ref::free unit g", "::take bucket g", "::reduced bucket g";
* gloo's own "gloo:<kind>" events on its worker threads: when a collective really ran (gloo carries
  out our reduce-scatter as an all-to-all: comm.Comm.reduce_scatter);
* compute per block: forward, a label opened when the block's first Linear starts and closed when
  its second returns; backward, autograd's nodes whose sequence numbers are those of the ops the
  block's forward recorded; the update, the optimizer's ops between two regathers (stages 1-2);
* bytes alive on each rank: every allocation and free of the CPU allocator since the model was
  built (the profiler's memory events), summed in order. Beside it `engine.memory_report()`, read
  between the step's calls, and the paper's model-state formula (zero_ref.analysis.memory_model).

`trace(stages)` runs the ranks and returns each stage's raw traces; `rows_of(raw)` turns one rank's
trace into the step's story (one row per phase, computation, collective and buffer event);
`check(rows, stage)` lists what contradicts what the walkthrough shows (gather before use and free
after, reductions during backward, regather after the update). Two front ends read them, and this
module imports neither: experiments/timeline_report.py (the walkthrough study: it traces, draws and
writes results/walkthrough) and experiments/explain.py (prints the rows).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

HIDDEN, UNITS, ROWS_PER_RANK, WORLD = 128, 3, 16, 2
BLOCK_NUMEL = 8 * HIDDEN * HIDDEN + 5 * HIDDEN     # fc1 (h -> 4h) and fc2 (4h -> h), with biases
PSI = UNITS * BLOCK_NUMEL
PHASES = ("forward", "backward", "optimizer", "after_update")
GLOO_KIND = {"all_gather": "all_gather", "control": "all_gather", "reduce_scatter": "all_to_all",
             "all_reduce": "all_reduce", "broadcast": "broadcast"}
"""Our collective -> the gloo event that carries it out."""


class Block(nn.Module):
    """x + fc2(gelu(fc1(x))): one unit of stage 3, one bucket of stages 0-2."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class TinyBlocks(nn.Module):
    def __init__(self, hidden: int = HIDDEN, units: int = UNITS):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def config(stage: int):
    from zero_ref import ZeroConfig

    return ZeroConfig(stage=stage, dtype="bf16", lr=1e-3, bucket_numel=BLOCK_NUMEL, overlap=True, prefetch=1)


# --- on each rank ------------------------------------------------------------------------------------
def trace(stages: tuple[int, ...] = (0, 1, 2, 3), world: int = WORLD) -> list[list[dict]]:
    """Spawn `world` gloo ranks; for each stage, every rank's raw trace of one step (rank order)."""
    from zero_ref.launch import spawn

    per_rank = spawn(trace_rank, world, tuple(stages), timeout=600)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(stages))]


def trace_rank(rank: int, world: int, stages: tuple[int, ...]) -> list[dict]:
    """Every stage's traced step on this rank."""
    from zero_ref.core.comm import Comm, CommLedger

    torch.set_num_threads(1)
    # the engines' channel groups, made before any profile so that no stage's trace holds their set-up
    Comm(None, CommLedger(), torch.device("cpu"), config(0).comm_timeout_s, gather_channel=True)
    x = torch.randn(ROWS_PER_RANK * world, HIDDEN, generator=torch.Generator().manual_seed(1234))
    x = x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
    return [_trace_stage(stage, rank, world, x, x.roll(1, dims=1)) for stage in stages]


def _trace_stage(stage: int, rank: int, world: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Build, warm up and trace one step at `stage`; everything it made is gone when it returns."""
    import gc

    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from zero_ref import initialize

    gc.collect()   # the previous stage's engine dies before this profile starts counting bytes
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        torch.manual_seed(0)
        model = TinyBlocks()
        engine = initialize(model, config(stage))
        handles = _mark_blocks(model)
        loss = ((engine(x).float() - y) ** 2).mean()      # the warm-up step
        engine.backward(loss)
        engine.step()
        del loss
        dist.barrier()
        reports = []

        def report(when: str) -> None:
            with record_function(f"walkthrough.report {when}"):
                reports.append((when, engine.memory_report()))

        with record_function("walkthrough.step"):
            report("start")
            loss = ((engine(x).float() - y) ** 2).mean()
            report("after forward")
            engine.backward(loss)
            report("after backward")
            engine.step()
            report("after step")
        del loss
        dist.barrier()
    names = {id(p): n.rsplit(".", 2)[0] for n, p in model.named_parameters()}
    result = {"stage": stage, "rank": rank, "world": world, "psi": sum(p.numel() for p in model.parameters()),
              "names": [", ".join(sorted({names[id(p)] for p in g.params})) for g in engine.stage.groups],
              "numels": [g.padded_numel for g in engine.stage.groups],
              "comm": engine.comm_stats()["last_step"], **_raw(prof, reports)}
    for handle in handles:
        handle.remove()
    engine.close()
    return result


def _mark_blocks(model: TinyBlocks) -> list:
    """Label each block's forward computation, from its fc1's start to its fc2's return (leaf
    modules: the engine's own hooks sit on the blocks, outside this label)."""
    from torch.autograd.profiler import record_function

    handles, open_labels = [], {}
    for k, block in enumerate(model.blocks):
        def start(module, args, k=k):
            open_labels[k] = record_function(f"walkthrough.forward blocks.{k}")
            open_labels[k].__enter__()

        def stop(module, args, output, k=k):
            open_labels.pop(k).__exit__(None, None, None)

        handles += [block.fc1.register_forward_pre_hook(start), block.fc2.register_forward_hook(stop)]
    return handles


def _raw(prof, reports: list) -> dict:
    """The traced step's events as (name, thread, start µs, end µs, sequence number, first input's
    elements), times from the step's start, and the bytes alive at every allocation or free in it."""
    events = list(prof.profiler.kineto_results.events())
    step = next(e for e in events if e.name() == "walkthrough.step")
    t0, t1, main = step.start_ns(), step.end_ns(), step.start_thread_id()
    us = lambda ns: (ns - t0) / 1e3   # noqa: E731
    keep = []
    for e in events:
        name = e.name()
        if e.end_ns() < t0 or e.start_ns() > t1 or name == "[memory]":
            continue
        ours = name.startswith(("zero_ref", "walkthrough.", "gloo:", "autograd::engine::evaluate_function"))
        if ours or (e.start_thread_id() == main and name.startswith("aten::")):
            shapes = e.shapes() if name.startswith("gloo:") else []
            numel = int(torch.Size(shapes[0]).numel()) if shapes and shapes[0] else 0
            thread = "main" if e.start_thread_id() == main else f"thread {e.start_thread_id()}"
            keep.append((name, thread, us(e.start_ns()), us(e.end_ns()), e.sequence_nr(), numel))
    memory, live = [], 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if e.start_ns() >= t0 and not memory:
            memory.append((0.0, live))
        live += e.nbytes()
        if t0 <= e.start_ns() <= t1:
            memory.append((us(e.start_ns()), live))
    memory = (memory or [(0.0, live)]) + [(us(t1), live)]
    marks = {e.name().split(" ", 1)[1]: us(e.start_ns()) for e in events if e.name().startswith("walkthrough.report")}
    return {"events": sorted(keep, key=lambda e: (e[2], -e[3])), "memory": memory, "step_us": us(t1),
            "reports": [{"when": when, "t_us": marks[when], **report} for when, report in reports]}


# --- the story (pure functions of the raw trace; the tests feed them edited rows too) -----------------
def rows_of(raw: dict) -> list[dict]:
    """The traced step on one rank, ordered by start: one row per phase, computation, collective and
    buffer event. Columns: stage, rank, lane ("phase", "compute", "collective", "buffers"), what,
    group (unit or bucket index, -1: none), name (the block it holds), kind (of collective), seq
    (its number on the rank), start_us, end_us (a collective's: the end of the host's wait),
    wait_start_us, done_us (when gloo finished it), elements, bytes (a collective's size; a buffer
    event's allocation, negative when freed), bytes_alive (on this rank at the row's start)."""
    main = [e for e in raw["events"] if e[1] == "main"]
    rows = []

    def add(lane, what, start, end, group=-1, **extra):
        rows.append({"stage": raw["stage"], "rank": raw["rank"], "lane": lane, "what": what, "group": group,
                     "name": raw["names"][group] if group >= 0 else "", "kind": "", "seq": -1, "start_us": start,
                     "end_us": end, "wait_start_us": None, "done_us": None, "elements": 0, "bytes": 0} | extra)

    for name, _, start, end, *_ in main:
        if name.startswith("zero_ref.") and name.split(".", 1)[1] in PHASES:
            add("phase", name.split(".", 1)[1], start, end)
    _compute_rows(raw, main, add)
    labels = [(n.split("::", 1)[1], a, b) for n, _, a, b, *_ in main
              if n.startswith("zero_ref::") and not n.startswith("zero_ref::issue")]
    _collective_rows(raw, main, labels, add)
    for what, start, end in labels:
        words = what.split()
        if words[0] in ("free", "take", "reduced") and len(words) == 3:
            add("buffers", " ".join(words[:2]), start, end, group=int(words[2]),
                bytes=_alive_at(raw["memory"], end) - _alive_at(raw["memory"], start))
    for row in rows:
        row["bytes_alive"] = _alive_at(raw["memory"], row["start_us"])
    return sorted(rows, key=lambda r: (r["start_us"], r["end_us"]))


def _compute_rows(raw: dict, main: list, add) -> None:
    """Forward and backward of each block, and the optimizer's update."""
    for name, _, start, end, *_ in main:
        if name.startswith("walkthrough.forward "):
            block = name.split()[1]
            group = next((g for g, n in enumerate(raw["names"]) if n == block), -1)
            add("compute", f"forward {block}", start, end, group=group)
            # autograd gives each backward node the sequence number of the forward op that made it
            made = {seq for n, _, a, b, seq, _ in main if seq >= 0 and start <= a and b <= end and n.startswith("aten::")}
            spans = [(a, b) for n, _, a, b, seq, _ in main
                     if seq in made and n.startswith("autograd::engine::evaluate_function")]
            if spans:
                add("compute", f"backward {block}", min(a for a, _ in spans), max(b for _, b in spans), group=group)
    phase = next(((a, b) for n, _, a, b, *_ in main if n == "zero_ref.optimizer"), None)
    if phase is None:
        return
    inner = [(a, b) for n, _, a, b, *_ in main if n.startswith("zero_ref::")]
    ops = [(a, b) for n, _, a, b, *_ in main if n.startswith("aten::") and phase[0] <= a and b <= phase[1]
           and not any(la <= a and b <= lb for la, lb in inner)]
    regathers = sorted((a, int(n.split()[2])) for n, _, a, b, *_ in main if n.startswith("zero_ref::regather bucket"))
    previous = phase[0]
    for cut, g in regathers + [(phase[1], None)]:   # stages 1-2: segment g is updated just before its regather
        mine = [(a, b) for a, b in ops if previous <= a < cut]
        what = "update" if not regathers else f"update bucket {g}" if g is not None else "update after the last regather"
        if mine:
            add("compute", what, min(a for a, _ in mine), max(b for _, b in mine), group=-1 if g is None else g)
        previous = cut


def _collective_rows(raw: dict, main: list, labels: list, add) -> None:
    """One row per collective: what it was for (the stage's label around its issue), issue -> wait,
    and when gloo finished it (the first unmatched gloo event of its kind and size after the issue)."""
    waits = {n.split()[2]: (a, b) for n, _, a, b, *_ in main if n.startswith("zero_ref.wait ") and len(n.split()) > 2}
    gloo = sorted((a, b, n.split(":", 1)[1], numel) for n, _, a, b, _, numel in raw["events"] if n.startswith("gloo:"))
    used = set()
    for name, _, start, end, *_ in main:
        if not name.startswith("zero_ref::issue"):
            continue
        _, kind, seq, elements, nbytes = name.split()
        around = [(what, a) for what, a, b in labels if a <= start and end <= b]
        words = max(around, key=lambda w: w[1])[0].split() if around else []
        group = int(words[2]) if len(words) > 2 and words[1] in ("unit", "bucket") else -1
        what = " ".join(words[:2]) if words else "step statistics" if kind == "all_reduce" else kind
        shard = int(elements) // raw["world"] if kind in ("all_gather", "control") else int(elements)
        done = next((i for i, (a, _, k, numel) in enumerate(gloo) if i not in used and k == GLOO_KIND[kind]
                     and numel == shard and a >= start), None)
        used.add(done)
        wait = waits.get(seq)
        add("collective", what, start, wait[1] if wait else end, group=group, kind=kind, seq=int(seq[1:]),
            wait_start_us=wait[0] if wait else None, done_us=gloo[done][1] if done is not None else None,
            elements=int(elements), bytes=int(nbytes))


def _alive_at(memory: list, t: float) -> int:
    """Bytes alive at time t: after every allocation and free up to t."""
    alive = memory[0][1]
    for when, live in memory:
        if when > t:
            break
        alive = live
    return alive


# --- what the timeline must show ----------------------------------------------------------------------
def check(rows: list[dict], stage: int) -> list[str]:
    """What, in one rank's rows, contradicts the walkthrough (an empty list: everything holds).

    Every stage: gradient reductions overlap backward (at least one is issued before backward's
    last computation ends). Stage 3: for each block's forward and backward computation, the gather
    of its unit has completed (the host's wait for it returned; with no wait, gloo's work ended)
    before the computation starts, the unit is not freed while in use, and it is freed after the
    computation and before it is gathered again. Stages 1-2: each bucket's parameters are
    all-gathered after the optimizer has updated that bucket's shard (no update after the last
    regather) and after every reduction."""
    def lane(name, prefix):
        return [r for r in rows if r["lane"] == name and r["what"].startswith(prefix)]

    problems = []
    backward = lane("compute", "backward ")
    reductions = lane("collective", "reduce bucket")
    backward_end = max((r["end_us"] for r in backward), default=None)
    if not reductions or backward_end is None:
        problems.append("no gradient reduction or no backward computation in the trace")
    elif not any(r["start_us"] < backward_end for r in reductions):
        problems.append(f"no reduction is issued before backward's last computation ends at {backward_end:.0f} µs: "
                        "the reductions do not overlap backward")
    if stage == 3:
        problems += _check_gathers(lane("compute", "forward ") + backward, lane("collective", "gather unit"),
                                   lane("buffers", "free unit"))
    if stage in (1, 2):
        problems += _check_regathers(rows, reductions, lane("collective", "regather bucket"), lane("compute", "update"))
    return problems


def _check_gathers(computes: list[dict], gathers: list[dict], frees: list[dict]) -> list[str]:
    problems = []
    for c in computes:
        g, what = c["group"], c["what"]
        issued = [r for r in gathers if r["group"] == g and r["start_us"] <= c["start_us"]]
        if not issued:
            problems.append(f"{what}: unit {g} was not gathered before it")
            continue
        gather = max(issued, key=lambda r: r["start_us"])
        # The host's wait returns only once gloo has completed the gather: its end proves completion.
        # gloo's own event is matched by kind and size, and it closes on gloo's thread after the
        # completion wakes the waiter (later still when that thread loses the core), so it decides
        # only for a gather nobody waited for.
        waited = gather["wait_start_us"] is not None
        finished = gather["end_us"] if waited or gather["done_us"] is None else max(gather["end_us"], gather["done_us"])
        if finished > c["start_us"]:
            problems.append(f"{what}: unit {g}'s gather #{gather['seq']} finishes at {finished:.0f} µs, after the "
                            f"computation starts at {c['start_us']:.0f} µs")
        if any(gather["start_us"] < f["start_us"] < c["end_us"] for f in frees if f["group"] == g):
            problems.append(f"{what}: unit {g} is freed while gathered for it")
        regather = min((r["start_us"] for r in gathers if r["group"] == g and r["start_us"] >= c["end_us"]),
                       default=float("inf"))
        if not any(c["end_us"] <= f["start_us"] < regather for f in frees if f["group"] == g):
            problems.append(f"{what}: unit {g} is not freed after the computation (before it is gathered again)")
    return problems


def _check_regathers(rows: list[dict], reductions: list[dict], regathers: list[dict], updates: list[dict]) -> list[str]:
    problems = []
    optimizer = next((r for r in rows if r["lane"] == "phase" and r["what"] == "optimizer"), None)
    reduced = max((r["end_us"] for r in reductions), default=0.0)
    if optimizer is None or not regathers:
        return ["no optimizer step or no parameter all-gather in the trace"]
    missing = {r["group"] for r in reductions} - {r["group"] for r in regathers}
    if missing:
        problems.append(f"buckets {sorted(missing)} are reduced but their parameters are never all-gathered")
    for r in regathers:
        g = r["group"]
        updated = [u["end_us"] for u in updates if u["group"] == g and u["what"] == f"update bucket {g}"]
        if r["start_us"] < optimizer["start_us"] or r["start_us"] < reduced:
            problems.append(f"bucket {g}'s parameters are all-gathered at {r['start_us']:.0f} µs, before the "
                            f"optimizer step (from {optimizer['start_us']:.0f} µs, reductions done at {reduced:.0f} µs)")
        elif not updated or max(updated) > r["start_us"]:
            problems.append(f"bucket {g}'s parameters are all-gathered before the update of its shard has finished")
    if any(u["what"] == "update after the last regather" for u in updates):
        problems.append("the optimizer computes after the last all-gather was issued: a bucket was gathered before "
                        "its update")
    return problems

