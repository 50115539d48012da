"""Real training steps at world 2-4 on CPU: predicted against measured per-rank memory.

Each rank trains a GPT-2-like model (``zero_ref.analysis.at_scale.GPTLike``, bf16, no activation
checkpointing) for a few steps under every stage and measures, on its own tensors:

* ``engine``: ``engine.memory_report()`` after the last step (model states, by category);
* ``live``: the live tensor bytes after the last step, from torch's dispatch-level tracker
  ``torch.distributed._tools.mem_tracker.MemTracker``, active from before the model is built;
* ``peak_fwd_bwd`` and ``peak_step``: that tracker's peak during forward + backward and during
  ``engine.step()`` (re-entering the tracker resets its peak to what is live at that moment);
* ``max_rss``: the rank's peak resident set size (``ru_maxrss``), for information only: it also
  holds the Python interpreter, torch and gloo, and it never goes down.
* on a GPU, ``cuda_peak``: ``torch.cuda.max_memory_allocated()`` over the steps.

The prediction (``predict``) adds up, with no measured input:

* model states: ``memory_model.model_state_bytes(Ψ, stage, world)`` (2 + 2 + 12 bytes per
  parameter, sharded as the stage says);
* the optimizer step's temporaries: the torch twin of the fused AdamW (``triton_kernels.reference``,
  used on CPU) allocates three fp32 tensors of the length it updates at once (the upcast gradient,
  sqrt of the second moment, the denominator). The optimizer updates at most ``bucket_numel``
  elements per call (the paper's CB), so this is 12 bytes x min(largest segment, bucket_numel);
* activations: what autograd saves in ``Block`` per layer, in bf16: 17·b·s·h values (block input,
  ln1 output, q/k/v, attention output and its contiguous copy, residual sum, ln2 output, 4h MLP
  input and GELU output), plus fp32 layer-norm statistics (4 per token) and the attention
  log-sum-exp (b·heads·s fp32); then the last block's output and ln_f's output, the fp32
  log-softmax of the logits kept for the loss, and at the start of backward the logits' gradient
  in fp32 and bf16 (the paper's footnote counts 12·b·s·h per layer; ours saves more);
* buffers, in three phases of a step, of which the largest counts:
  - backward starts: all activations above, autograd's ``.grad`` of the largest parameter before
    the stage copies it into its flat buffer, and for stage 3 the gathered units: the root unit
    (embeddings, tied to the output layer: gathered through forward and backward) with its
    gradient bucket, and the unit in use plus ``prefetch`` more, each with its gradient bucket;
  - backward ends, reductions in flight: stages 2 and 3 keep at most two gradient buckets in
    flight plus one filling (the paper's CB): three group-sized bf16 buffers. On gloo, a
    reduce-scatter also holds a copy of its input while it runs (measured: a 2 MB reduce-scatter
    peaks at 4 MB), and stages 1-3 keep at most two in flight: two more group-sized buffers
    (stage 0's in-place all-reduce copies nothing; the fake process group and NCCL copy nothing);
  - the optimizer step: its temporaries, above.

predicted peak = states + the largest phase.
"""

from __future__ import annotations

import resource
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero_ref.analysis import memory_model as mm
from zero_ref.analysis.at_scale import ModelShape, fake_world
from zero_ref.config import ZeroConfig
from zero_ref.core.partition import pack_into_buckets
from zero_ref.core.units import build_units

BF16 = 2


@dataclass(frozen=True)
class RealRun:
    """The model and batch of the real runs (per rank: ``batch`` sequences of ``seq`` tokens)."""

    layers: int = 4
    hidden: int = 512
    heads: int = 8
    vocab: int = 2048
    seq: int = 64
    batch: int = 2
    steps: int = 2
    bucket_numel: int = 2**20
    prefetch: int = 1

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.layers, self.hidden, self.heads, self.vocab, self.seq)

    def config(self, stage: int) -> ZeroConfig:
        return ZeroConfig(stage=stage, dtype="bf16", bucket_numel=self.bucket_numel, prefetch=self.prefetch,
                          kernels="torch", weight_decay=0.0)


# ------------------------------------------------------------------------------- prediction
def _largest_segment(run: RealRun, stage: int, world: int) -> tuple[int, int]:
    """(elements of the largest optimizer segment, elements of the largest flat group), from the
    engine's layout rules applied to the model's shapes (built on the meta device)."""
    model = run.shape.build("meta")
    params = list(model.parameters())
    if stage == 0:
        return sum(p.numel() for p in params), 0
    if stage in (1, 2):
        groups = pack_into_buckets(params[::-1], run.bucket_numel, world)
        return max(g.shard_numel for g in groups), max(g.padded_numel for g in groups)
    sizes = [sum(p.numel() for p in unit) for _, unit in build_units(model, params, run.bucket_numel)]
    padded = [-(-n // world) * world for n in sizes]
    return max(padded) // world, max(padded)


def activation_bytes(run: RealRun) -> int:
    """Bytes autograd holds at the start of backward for ``GPTLike`` (see the module docstring)."""
    b, s, h, a, v = run.batch, run.seq, run.hidden, run.heads, run.vocab
    per_layer = BF16 * 17 * b * s * h + 4 * 4 * b * s + 4 * b * a * s
    head = BF16 * 2 * b * s * h + 4 * 2 * b * s        # last block output, ln_f output, ln_f stats
    loss = 4 * b * (s - 1) * v                          # fp32 log-softmax saved for the loss
    logits_grad = (4 + 4 + BF16) * b * s * v            # its gradient, the fp32 upcast's, in bf16
    return run.layers * per_layer + head + loss + logits_grad


def predict(run: RealRun, stage: int, world: int, gloo: bool = True) -> dict[str, float]:
    """Predicted per-rank bytes: model states, each phase's transient bytes, and the peak.

    ``gloo=False`` is for collectives that copy nothing (the fake process group; NCCL)."""
    psi = run.shape.params
    states = mm.model_state_bytes(psi, stage, world).total
    segment, group = _largest_segment(run, stage, world)
    largest_param = max(p.numel() for p in run.shape.build("meta").parameters())
    backward_start = activation_bytes(run) + BF16 * largest_param
    if stage == 3:
        units = 2 + run.prefetch                        # the root, the unit in use, the prefetched
        backward_start += BF16 * group * 2 * units      # each gathered, each with a gradient bucket
    buckets = 0 if stage < 2 else 3 * BF16 * group      # stages 2-3: two in flight, one filling
    copies = 0 if stage == 0 or not gloo else 2 * BF16 * group
    step = 12 * min(segment, run.bucket_numel)
    phases = {"backward_start": backward_start, "reductions_in_flight": buckets + copies, "step_temporaries": step}
    return {"states": states, **phases, "peak": states + max(phases.values())}


# ------------------------------------------------------------------------------- measurement
def _snapshot(tracker, device: torch.device, kind: str) -> int:
    return tracker.get_tracker_snapshot(kind).get(device, {}).get("Total", 0)


def measure_stage(rank: int, world: int, run: RealRun, stage: int, device: str = "cpu") -> dict:
    """Train ``run.steps`` steps under ``stage`` on this rank and measure its memory."""
    import zero_ref
    from torch.distributed._tools.mem_tracker import MemTracker
    from zero_ref.models import lm_loss, token_batches

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    tracker = MemTracker()
    with warnings.catch_warnings():
        # MemTracker's own gradient hook runs after the engine's, which has already moved .grad into
        # its flat buffer and cleared it: the tracker warns about the None it then sees.
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable")
        with tracker:
            torch.manual_seed(0)
            model = run.shape.build(dev)
            engine = zero_ref.initialize(model, run.config(stage))
        init_peak = _snapshot(tracker, dev, "peak")
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        peak_fb = peak_step = 0
        losses = []
        batches = token_batches(run.vocab, run.batch * world, run.seq, rank, world, seed=1)
        for _, (_, tokens) in zip(range(run.steps), batches):
            tracker.reset_mod_stats()   # MemTracker keeps per-module stats for one iteration
            with tracker:               # entering resets the peak to the bytes live now
                loss = lm_loss(engine(tokens.to(dev)), tokens.to(dev))
                engine.backward(loss)
                losses.append(loss.item())
                del loss
            peak_fb = max(peak_fb, _snapshot(tracker, dev, "peak"))
            with tracker:
                engine.step()
            peak_step = max(peak_step, _snapshot(tracker, dev, "peak"))
        report = engine.memory_report()
        live = _snapshot(tracker, dev, "current")
    out = {"stage": stage, "scheme": mm.PAPER_NAMES[stage], "world": world, "rank": rank, "device": device,
           "collectives": dist.get_backend(),
           "psi": run.shape.params, "losses": losses, "engine_states": report["params"] + report["grads"]
           + report["optimizer_states"], "engine_comm_buffers": report["comm_buffers"], "live": live, "init_peak": init_peak, "peak_fwd_bwd": peak_fb,
           "peak_step": peak_step, "peak": max(peak_fb, peak_step),
           "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if cuda:
        out["cuda_peak"] = torch.cuda.max_memory_allocated(dev)
    del engine, model
    return out


def rank_main(rank: int, world: int, run: RealRun, stages: list[int]) -> list[dict]:
    """What each spawned gloo rank runs: every stage in turn, largest memory last."""
    return [measure_stage(rank, world, run, stage) for stage in stages]


def one_rank_of(nd: int, run: RealRun, stages: list[int], device: str = "cuda") -> list[dict]:
    """Real allocations, fake communication: this process is rank 0 of a fake group of ``nd``
    ranks and trains on ``device`` (values are meaningless, per-rank memory is real). This is how
    a single GPU measures ``torch.cuda.max_memory_allocated`` for one rank of Nd (memory_study
    runs it when CUDA is available); the tests run it on the CPU."""
    rows = []
    for stage in stages:
        with fake_world(nd):
            rows.append(measure_stage(0, nd, run, stage, device))
    return rows


def compare(rows: list[dict], run: RealRun) -> list[dict]:
    """Every measured rank beside the prediction, with the errors."""
    table = []
    for row in rows:
        p = predict(run, row["stage"], row["world"], gloo=row["collectives"] == "gloo")
        table.append({
            "world": row["world"], "rank": row["rank"], "stage": row["stage"], "scheme": row["scheme"],
            "device": row["device"], "collectives": row["collectives"],
            "psi": row["psi"], "states_predicted": p["states"], "states_engine": row["engine_states"],
            "comm_buffers_engine": row["engine_comm_buffers"], "states_live_tracker": row["live"],
            "states_error_pct": 100 * (row["engine_states"] - p["states"]) / p["states"],
            "live_vs_engine_pct": 100 * (row["live"] - row["engine_states"] - row["engine_comm_buffers"])
            / (row["engine_states"] + row["engine_comm_buffers"]),
            "backward_start_predicted": p["backward_start"],
            "reductions_in_flight_predicted": p["reductions_in_flight"],
            "step_temporaries_predicted": p["step_temporaries"], "peak_predicted": p["peak"],
            "peak_fwd_bwd_measured": row["peak_fwd_bwd"], "peak_step_measured": row["peak_step"],
            "peak_measured": row["peak"],
            "peak_error_pct": 100 * (row["peak"] - p["peak"]) / p["peak"],
            "init_peak_measured": row["init_peak"], "max_rss": row["max_rss"],
            "cuda_peak": row.get("cuda_peak"), "loss_first": row["losses"][0], "loss_last": row["losses"][-1],
        })
    return table
