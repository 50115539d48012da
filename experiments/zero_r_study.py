"""ZeRO-R: partitioned activation checkpoints (Pa, Pa+cpu) measured (Sec 6.1, Sec 8) and Fig 6 by search.

Two legs, each beside the paper's number:

* **real runs** (gloo ranks on this CPU, Megatron-style model parallelism from
  ``zero_ref.tensor_parallel``, the engine over the data-parallel ranks):
  - the paper's C1-C5 (``zero_ref.analysis.presets``) end to end at MP = 2 and 4 on 4 ranks: bytes per rank
    by category, and checkpoint bytes after a forward, plain against Pa and Pa+cpu
    (``engine.memory_report()``: live saved inputs, tracked to the moment torch frees them), against
    the expectation L x b x s x h x 4 bytes / Nm;
  - elements moved per transformer block, counted at torch's dispatcher
    (``zero_ref.analysis.collective_count``): Megatron's all-reduces against Pa's all-gather, with torch's
    checkpoint recomputing whole blocks (the paper's count) and with its early stop (the default);
* **analysis**: Sec 6.1's 100B example (125 layers x 8192, batch 32, seq 1024, MP 16, one
  checkpoint per layer): checkpoint bytes per GPU without Pa, with Pa, with Pa+cpu, at 1 and 2
  bytes per value;
* **search**: Fig 6, the largest model per configuration C1-C5 (``zero_ref.analysis.presets``) at MP 16 on
  400 GPUs, from the memory study's per-GPU accounting, at three fragmentation shares.

Writes ``checkpoint_bytes.csv``, ``comm_per_block.csv``, ``sec61_100b.csv``, ``fig6.csv``, ``zero_r.png``, ``fig6.png``,
``REPORT.md`` and ``meta.json`` into the output folder.

    python -m experiments.zero_r_study --out results/zero_r
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from experiments.provenance import ROOT, provenance
from zero_ref.core.activations import MODES

SHAPE = {"n_layer": 4, "n_embd": 128, "n_head": 8, "vocab_size": 512, "n_positions": 64}
BATCH, SEQ = 4, 64   # per data-parallel rank


def _tokens(step: int, batch: int) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (batch, SEQ), generator=torch.Generator().manual_seed(step))


def measure_configs(rank: int, world: int, mp: int) -> list[dict]:
    """Each of the paper's C1-C5 (zero_ref.analysis.presets) for two steps on a (dp, mp) mesh: checkpoint
    bytes after the first forward, model states by category after the step."""
    from torch.distributed.device_mesh import init_device_mesh

    import zero_ref
    from zero_ref.core.activations import checkpoint_blocks
    from zero_ref.models import ParallelGPT

    mesh = init_device_mesh("cpu", (world // mp, mp), mesh_dim_names=("dp", "mp"))
    rows = []
    for name, preset in zero_ref.PAPER_CONFIGS.items():
        model = ParallelGPT(**SHAPE, group=mesh.get_group("mp"))
        checkpoints = checkpoint_blocks(model.blocks, preset.checkpoints, mesh.get_group("mp"), contiguous=preset.md)
        with zero_ref.initialize(model, preset.zero_config(), mesh=mesh) as engine:
            for step in range(2):
                loss = engine(_tokens(step, BATCH))
                if step == 0:
                    live = engine.memory_report()
                engine.backward(loss)
                engine.step()
            after = engine.memory_report()
        rows.append({"config": name, "stage": preset.stage, "mode": preset.checkpoints, "mp": mp, "dp": world // mp,
                     "rank": rank, "device_bytes": live["activation_checkpoints"],
                     "host_bytes": live["activation_checkpoints_host"],
                     "arena_bytes": live["activation_checkpoints_arena"],
                     "host_traffic_bytes_per_step": checkpoints.host_traffic_bytes // 2,
                     "plain_expected_bytes": SHAPE["n_layer"] * BATCH * SEQ * SHAPE["n_embd"] * 4,
                     **{k: after[k] for k in ("params", "grads", "optimizer_states", "comm_buffers")}})
    return rows


CB_SHAPES = ((2, 128), (24, 128))   # (layers, hidden): Ψ grows about 9x
CB_BUCKET = 2**16


def measure_cb(rank: int, world: int) -> list[dict]:
    """Gradient buffer bytes per rank (stage 2, after two steps) with constant-size buckets (CB)
    against one bucket as large as the model (flatten everything), for two model sizes."""
    import zero_ref
    from zero_ref.analysis.at_scale import ModelShape

    rows = []
    for layers, hidden in CB_SHAPES:
        shape = ModelShape(layers, hidden, 4, vocab=1024, seq=32)
        for scheme, bucket in (("CB", CB_BUCKET), ("flatten everything", shape.params)):
            torch.manual_seed(0)
            with zero_ref.initialize(shape.build("cpu"), zero_ref.ZeroConfig(stage=2, bucket_numel=bucket)) as engine:
                for step in range(2):
                    tokens = _tokens(step, 4)[:, :32]   # ids < 512: inside the vocabulary of 1024
                    logits = engine(tokens)
                    engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()))
                    engine.step()
                rows.append({"psi": shape.params, "shape": shape.label(), "scheme": scheme, "bucket_numel": bucket,
                             "comm_buffer_bytes": engine.memory_report()["comm_buffers"]})
    return rows


def cb_analysis() -> pd.DataFrame:
    """Sec 6.2's fused-buffer examples: an fp32 buffer of all gradients (1.5B: 6 GB, 3B: 12 GB)
    against one constant-size buffer of the engine's default 2**22 elements."""
    from zero_ref.analysis import memory_model as mm

    return pd.DataFrame([{"psi": psi, "paper_gb": paper, "fused_gb": mm.constant_buffer_bytes(int(psi), 4) / mm.GB,
                          "cb_gb": mm.constant_buffer_bytes(2**22, 4) / mm.GB} for psi, paper in ((1.5e9, 6), (3e9, 12))])


def count_per_block(rank: int, world: int) -> list[dict]:
    """Elements one forward + backward moves per block (MP = world, no data parallelism): the
    difference between a model of 2 blocks and one of 1 block, counted at the dispatcher."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from zero_ref.core.activations import checkpoint_blocks
    from zero_ref.analysis.collective_count import CountCollectives
    from zero_ref.models import ParallelGPT

    rows = []
    for early_stop in (False, True):
        for mode in ("plain", "pa"):
            moved, gathered = {}, {}
            for layers in (1, 2):
                model = ParallelGPT(**{**SHAPE, "n_layer": layers}, group=dist.group.WORLD)
                checkpoints = checkpoint_blocks(model.blocks, mode, dist.group.WORLD)
                with CountCollectives() as counter, set_checkpoint_early_stop(early_stop):
                    model(_tokens(0, BATCH)).backward()
                moved[layers], gathered[layers] = counter.moved, checkpoints.gathered_elements
            rows.append({"mp": world, "mode": mode, "early_stop": early_stop,
                         "block_elements": BATCH * SEQ * SHAPE["n_embd"],
                         "all_reduce": moved[2]["all_reduce"] - moved[1]["all_reduce"],
                         "all_gather": moved[2]["all_gather"] - moved[1]["all_gather"],
                         "gathered_by_pa": gathered[2] - gathered[1]})
    return rows


def sec61_analysis() -> pd.DataFrame:
    """Sec 6.1: a 100B model (125 x 8192), batch 32, seq 1024, MP 16: checkpoint bytes per GPU."""
    from experiments.paper_values import headline
    from zero_ref.analysis import memory_model as mm

    shape = {"hidden": 8192, "batch": 32, "seq": 1024, "layers": 125, "checkpointing": True, "nm": 16}
    plain = "100B model activation checkpoints per GPU at batch 32 seq 1024 MP 16 (one per layer)"
    paper = {"plain": float(headline(plain)["value"]), "pa": float(headline("same with Pa")["value"]),
             "pa_cpu": 0.0}   # GB per GPU, Sec 6.1 ("about"; with Pa+cpu "almost zero")
    rows = []
    for mode in MODES:
        # Pa+cpu: the slices leave the GPU, nothing is kept there
        values = 0 if mode == "pa_cpu" else mm.activation_values(**shape, pa=mode == "pa")
        for bytes_per_value in (1, 2):
            rows.append({"mode": mode, "bytes_per_value": bytes_per_value, "values_per_gpu": values,
                         "ours_gb": values * bytes_per_value / mm.GB, "paper_gb": paper[mode]})
    return pd.DataFrame(rows)


QUICK_FIG6_ENGINE = ("C1", "C3")
"""The configurations whose Fig 6 shapes --quick confirms with the engine at scale (the two with the
fewest layers: the engine's time grows with the tensor count); full runs confirm all five."""


def fig6(quick: bool = False) -> pd.DataFrame:
    """Fig 6 by analysis and search: the largest model per C1-C5 at MP 16 on 400 GPUs, at the memory
    study's assumptions, for fragmentation shares 0, 15% (the memory study's choice) and 30%."""
    from experiments.max_model_size import FIG6_GPUS, FIG6_NM, Assumptions, fig6_rows
    from zero_ref.analysis import memory_model as mm
    from zero_ref.analysis.at_scale import ModelShape, measure_at_scale

    rows = pd.DataFrame([row for fragmentation in (0.0, 0.15, 0.3)
                         for row in fig6_rows(Assumptions(fragmentation=fragmentation))])
    # the engine at scale: one rank of the MP 16 x DP 25 grid (its MP slice, a fake group of 25)
    # holds the model states the search counted, for each shape found at 15%
    engine_gb = {}
    for _, r in rows[rows.fragmentation == 0.15].iterrows():
        if quick and r.config not in QUICK_FIG6_ENGINE:
            continue
        shape = ModelShape(int(r.layers), int(r.hidden), int(r.heads), vocab=Assumptions().vocab, seq=Assumptions().seq)
        engine_gb[r.config] = measure_at_scale(shape, int(r.stage), FIG6_GPUS // FIG6_NM, mp=FIG6_NM).engine_total / mm.GB
    rows["engine_states_gb"] = [engine_gb.get(c, float("nan")) if f == 0.15 else None
                                for c, f in zip(rows.config, rows.fragmentation)]
    return rows


def plot(out: Path, checkpoints: pd.DataFrame, comm: pd.DataFrame, sec61: pd.DataFrame) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid")
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4))   # 1,560 px at 120 dpi
    per_rank = checkpoints[checkpoints.stage == 2].groupby(["mp", "mode"], as_index=False)[
        ["device_bytes", "host_bytes"]].max()
    per_rank["where"] = "device"
    host = per_rank.assign(device_bytes=per_rank.host_bytes, where="host (Pa+cpu)")
    both = pd.concat([per_rank, host[host.device_bytes > 0]])
    both["label"] = both["mode"] + " / " + both["where"]
    both["MiB"] = both.device_bytes / 2**20
    order = ["plain / device", "pa / device", "pa_cpu / device", "pa_cpu / host (Pa+cpu)"]
    sns.barplot(data=both, x="mp", y="MiB", hue="label", hue_order=order, ax=axes[0])
    axes[0].set(title="checkpoint bytes per rank after forward (measured)", xlabel="model-parallel ranks Nm")
    c = comm[comm["mode"] == "pa"].copy()
    c["recompute"] = c.early_stop.map({False: "whole block (paper)", True: "early stop (torch)"})
    long = pd.concat([c.assign(kind="MP all-reduces (2n each)", per_block=c.all_reduce / c.block_elements),
                      c.assign(kind="Pa all-gather", per_block=c.all_gather / c.block_elements)])
    sns.barplot(data=long, x="recompute", y="per_block", hue="kind", ax=axes[1])
    axes[1].axhline(12, ls="--", c="gray")
    axes[1].set(title="elements per block / (b x s x h), MP=2 (measured)", xlabel="", ylabel="x b·s·h")
    bars = sec61.assign(ours=lambda d: "ours, " + d.bytes_per_value.map({1: "1 byte/value", 2: "fp16"}))
    sns.barplot(data=bars, x="mode", y="ours_gb", hue="ours", ax=axes[2])
    paper = sec61.drop_duplicates("mode")
    axes[2].scatter(range(len(paper)), paper.paper_gb, color="tab:red", zorder=3, label="paper", marker="D")
    axes[2].set(title="Sec 6.1: 100B, MP 16, batch 32: GB per GPU", ylabel="GB", xlabel="")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out / "zero_r.png", dpi=120)
    plt.close(fig)


def _paper_order(size: pd.Series) -> bool:
    """Fig 6's order: C1 < C2 and C3 < C4 < C5."""
    return size["C1"] < size["C2"] and size["C3"] < size["C4"] < size["C5"]


def plot_fig6(out: Path, rows: pd.DataFrame, measured: pd.DataFrame | None) -> None:
    """The paper's sizes beside ours at each fragmentation share: 0, 15% (chosen by the memory
    study) and 30%, and, where the fragmentation study has run, the share it measured per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid")
    fig, ax = plt.subplots(figsize=(8, 5.2))
    long = pd.concat([rows[rows.fragmentation == 0.15][["config", "paper_b"]].rename(columns={"paper_b": "B"})
                      .assign(source="paper"),
                      rows.rename(columns={"ours_b": "B"}).assign(
                          source=lambda d: "ours, fragmentation " + (100 * d.fragmentation).round().astype(int).astype(str) + "%")
                      [["config", "B", "source"]]])
    if measured is not None and len(measured):
        shares = f"{100 * measured.fragmentation.min():.1f}-{100 * measured.fragmentation.max():.1f}%"
        long = pd.concat([long, measured.assign(config=measured.case.str.split().str[-1], B=measured.ours_b,
                                                source=f"ours, fragmentation measured ({shares})")
                          [["config", "B", "source"]]])
    sns.barplot(data=long, x="config", y="B", hue="source", ax=ax)
    ax.set(title="Fig 6: largest model per configuration, MP 16 on 400 GPUs\n15%: the memory study's chosen share; "
                 "measured: the fragmentation study's", ylabel="parameters (B)", xlabel="")
    sns.move_legend(ax, "upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, title=None, frameon=False)
    fig.tight_layout()
    fig.savefig(out / "fig6.png", dpi=120)
    plt.close(fig)


def write_report(out: Path, checkpoints: pd.DataFrame, comm: pd.DataFrame, sec61: pd.DataFrame,
                 fig6_table: pd.DataFrame, meta: dict) -> list[dict]:
    """REPORT.md of this study; returns the headline rows for results/REPORT.md."""
    headline = []
    worst = checkpoints[checkpoints.stage == 2].groupby(["mp", "mode"], as_index=False)[
        ["device_bytes", "host_bytes", "arena_bytes", "host_traffic_bytes_per_step", "plain_expected_bytes"]].max()
    worst = worst.sort_values(["mp", "mode"], key=lambda c: c.map(MODES.index) if c.name == "mode" else c)
    lines = ["# ZeRO-R: partitioned activation checkpoints (Pa, Pa+cpu)", "",
             f"Generated by `{meta['command']}` at git `{meta['git_revision']}` on {meta['date_utc']} "
             f"({meta['hardware']['cpu']}, {meta['hardware']['cores']} cores).", "",
             f"Model: `ParallelGPT` {SHAPE}, batch {BATCH} x seq {SEQ} per data-parallel rank, fp32, engine "
             "stage 2 over the data-parallel ranks of a (dp, mp) DeviceMesh of 4 gloo ranks.", "",
             "## Checkpoint bytes per rank after a forward (measured, C3/C4/C5: stage 2 with plain, Pa, Pa+cpu)", "",
             "Every configuration runs with MD: the kept inputs live in one contiguous arena (bytes in it shown). "
             "Pa+cpu's host traffic per step is its slices to the host in forward and back in backward: twice "
             "its host bytes.", "",
             "| MP | mode | device bytes | host bytes | in the MD arena | host traffic per step | plain / Nm expected "
             "| ratio to plain |",
             "|---|---|---|---|---|---|---|---|"]
    for mp in sorted(worst.mp.unique()):
        plain = worst[(worst.mp == mp) & (worst["mode"] == "plain")].device_bytes.item()
        for _, r in worst[worst.mp == mp].iterrows():
            kept = r.device_bytes + r.host_bytes
            lines.append(f"| {mp} | {r['mode']} | {r.device_bytes:,} | {r.host_bytes:,} | {r.arena_bytes:,} | "
                         f"{r.host_traffic_bytes_per_step:,} | "
                         f"{(r.plain_expected_bytes if r['mode'] == 'plain' else r.plain_expected_bytes // mp):,} | "
                         f"{kept / plain:.3f} |")
            if r["mode"] != "plain":
                headline.append({"item": f"Sec 6.1: checkpoint bytes per rank with {r['mode']}, MP {mp}",
                                 "paper": f"1/Nm = {1 / mp:.3f} of plain" + (", none on the GPU" if r["mode"] == "pa_cpu" else ""),
                                 "ours": f"{kept / plain:.3f} of plain ({r.device_bytes:,} B device, "
                                         f"{r.host_bytes:,} B host)",
                                 "error": f"{abs(kept / plain - 1 / mp) * mp:.1%}", "how": "real run"})
    lines += ["", "## C1-C5 end to end: bytes per rank by category (measured, largest over ranks)", "",
              "| config | MP x DP | stage | checkpoints | params | grads | optimizer states | comm buffers | "
              "checkpoints (device) | checkpoints (host) |", "|---|---|---|---|---|---|---|---|---|---|"]
    categories = ["params", "grads", "optimizer_states", "comm_buffers", "device_bytes", "host_bytes"]
    for (config, mp), r in checkpoints.groupby(["config", "mp"])[["stage", "mode", "dp", *categories]].max().iterrows():
        lines.append(f"| {config} | {mp} x {r.dp} | {r.stage} | {r['mode']} | "
                     + " | ".join(f"{r[k]:,}" for k in categories) + " |")
    lines += ["", "## Elements moved per transformer block, MP = 2 (counted at torch's dispatcher)", "",
              "| recomputation | mode | MP all-reduce elements | Pa all-gather elements | in b·s·h | Pa / MP |",
              "|---|---|---|---|---|---|"]
    for _, r in comm.iterrows():
        share = r.all_gather / r.all_reduce
        lines.append(f"| {'early stop (torch default)' if r.early_stop else 'whole block'} | {r['mode']} | "
                     f"{r.all_reduce:,} | {r.all_gather:,} | {r.all_reduce / r.block_elements:.0f} + "
                     f"{r.all_gather / r.block_elements:.0f} | {share:.3f} |")
        if r["mode"] == "pa":
            headline.append({"item": "Sec 8: Pa's all-gather per block against Megatron's all-reduces, "
                                     + ("whole-block recomputation" if not r.early_stop else "torch's early stop"),
                             "paper": "1 : 12 (under 10%)", "ours": f"1 : {r.all_reduce / r.all_gather:.0f} ({share:.1%})",
                             "error": f"{share - 1 / 12:+.1%} points", "how": "real run"})
    lines += ["", "torch's non-reentrant checkpoint stops recomputing a block as soon as everything backward "
              "needs is rebuilt, so the block's last all-reduce (the MLP's output, which nothing saves) is "
              "not repeated: 10 b·s·h of all-reduces per block instead of the paper's 12.", "",
              "## Sec 6.1 by analysis: 100B (125 x 8192), batch 32, seq 1024, MP 16", "",
              "| mode | bytes per value | values per GPU | ours GB | paper GB |", "|---|---|---|---|---|"]
    for _, r in sec61.iterrows():
        lines.append(f"| {r['mode']} | {r.bytes_per_value} | {r.values_per_gpu:,.0f} | {r.ours_gb:.1f} | {r.paper_gb:g} |")
    fp16 = sec61[(sec61.bytes_per_value == 2) & (sec61["mode"] != "pa_cpu")].set_index("mode")
    byte = sec61[(sec61.bytes_per_value == 1) & (sec61["mode"] != "pa_cpu")].set_index("mode")
    lines += ["", f"The paper's {byte.paper_gb['plain']:g} GB and {byte.paper_gb['pa']:g} GB match 1 byte per value "
              f"({byte.ours_gb['plain']:.1f} and {byte.ours_gb['pa']:.1f} GB); fp16 checkpoints (2 bytes) are "
              f"{fp16.ours_gb['plain']:.1f} and {fp16.ours_gb['pa']:.1f} GB. The paper's footnote formula for all "
              "activations is in fp16 elements, so the checkpoint example looks like a unit slip. These two numbers "
              "get one verdict, the activation study's ([activations](../activations/REPORT.md): not reproduced in "
              "fp16); Pa's ratio, 1/Nm, is measured above.", "",
              "![ZeRO-R](zero_r.png)", "",
              "## Fig 6 by analysis and search: the largest model per configuration, MP 16 on 400 GPUs", "",
              "The memory study's per-GPU accounting (`experiments/max_model_size.py`: model states, constant "
              "buffers, checkpoints (replicated, 1/Nm with Pa, none on the GPU with Pa+cpu), one recomputed "
              "layer, logits, 1 GB context) searched over the widths of Fig 6's runs (6144 and 8192), batch 16 "
              "per model-parallel group (appendix). Here the allocator's waste is the memory study's fragmentation "
              "share, **chosen, not measured**; the table shows how the answer moves with it. The share measured "
              "per configuration (traces through a caching-allocator model, with MD) and the search done again "
              "with it are in [../fragmentation/REPORT.md](../fragmentation/REPORT.md).", "",
              "| config | stage | checkpoints | paper B | ours B (frag 0%) | ours B (15%) | ours B (30%) | shape (15%) | "
              "error (15%) | states GB: search / engine at scale |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    at = {f: fig6_table[fig6_table.fragmentation == f].set_index("config") for f in (0.0, 0.15, 0.3)}
    for config, r in at[0.15].iterrows():
        lines.append(f"| {config} | {r.stage} | {r.checkpoints} | {r.paper_b} | {at[0.0].loc[config, 'ours_b']:.1f} | "
                     f"{r.ours_b:.1f} | {at[0.3].loc[config, 'ours_b']:.1f} | {r.ours_shape} | {r.error_pct:+.1f}% | "
                     f"{r.states_gb:.2f} / " + (f"{r.engine_states_gb:.2f}" if pd.notna(r.engine_states_gb) else "not run (--quick)") + " |")
        headline.append({"item": f"Fig 6: largest model, {config} ({'Pos' if r.stage == 1 else 'Pos+g'}, "
                                 f"checkpoints {r.checkpoints}), MP 16, 400 GPUs",
                         "paper": f"{r.paper_b}B" + (" (inferred)" if config == "C3" else ""),
                         "ours": f"{r.ours_b:.1f}B ({r.ours_shape})",
                         "error": f"{r.error_pct:+.1f}% (fragmentation 15%, chosen)", "how": "search"})
    mean = {f: t.error_pct.abs().mean() for f, t in at.items()}
    lines += ["", "Mean absolute error: " + ", ".join(f"{m:.1f}% at {100 * f:.0f}% fragmentation" for f, m in mean.items())
              + ". The order of the paper's bars (C1 < C2, C3 < C4 < C5) "
              + ("holds at every share." if all(_paper_order(t.ours_b) for t in at.values()) else
                 "does not hold at every share: see the table."), "",
              "![Fig 6](fig6.png)", ""]
    (out / "REPORT.md").write_text("\n".join(lines))
    return headline


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """Run both legs, write everything into `out`; return the headline rows."""
    from zero_ref.launch import spawn

    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    checkpoints = pd.DataFrame([row for mp in ((2,) if quick else (2, 4))
                                for rank_rows in spawn(measure_configs, 4, mp, timeout=600) for row in rank_rows])
    comm = pd.DataFrame(spawn(count_per_block, 2, timeout=600)[0])
    sec61 = sec61_analysis()
    fig6_table = fig6(quick)
    fig6_table.to_csv(out / "fig6.csv", index=False)
    cb = pd.DataFrame(spawn(measure_cb, 2, timeout=600)[0])
    cb.to_csv(out / "cb.csv", index=False)
    cb_paper = cb_analysis()
    cb_paper.to_csv(out / "cb_analysis.csv", index=False)
    searches = out.parent / "fragmentation" / "searches.csv"
    measured = pd.read_csv(searches) if searches.exists() else None
    plot_fig6(out, fig6_table, None if measured is None else measured[measured.case.str.startswith("Fig 6")])
    checkpoints.to_csv(out / "checkpoint_bytes.csv", index=False)
    comm.to_csv(out / "comm_per_block.csv", index=False)
    sec61.to_csv(out / "sec61_100b.csv", index=False)
    plot(out, checkpoints, comm, sec61)
    meta = provenance() | {"quick": quick, "seconds": round(time.perf_counter() - start, 1), "shape": SHAPE,
                           "batch_per_dp_rank": BATCH, "seq": SEQ}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    headline = write_report(out, checkpoints, comm, sec61, fig6_table, meta)
    headline += write_cb_section(out, cb, cb_paper)
    return {"headline": headline, "meta": meta}


def write_cb_section(out: Path, cb: pd.DataFrame, cb_paper: pd.DataFrame) -> list[dict]:
    """Append the CB section to REPORT.md; return its headline rows."""
    small, large = sorted(cb.psi.unique())
    lines = ["## CB: constant-size buffers (Sec 6.2)", "",
             f"Measured (stage 2, world 2, fp32, after two steps): `memory_report()['comm_buffers']`, the gradient "
             f"buckets the engine keeps for reuse, with {CB_BUCKET:,}-element buckets against one bucket as large as "
             f"the model, as Ψ grows {large / small:.1f}x.", "",
             "| Ψ | shape | scheme | bucket elements | buffer bytes |", "|---|---|---|---|---|"]
    for _, r in cb.iterrows():
        lines.append(f"| {r.psi:,} | {r['shape']} | {r.scheme} | {r.bucket_numel:,} | {r.comm_buffer_bytes:,} |")
    growth = {scheme: g.set_index("psi").comm_buffer_bytes for scheme, g in cb.groupby("scheme")}
    lines += ["", "By analysis, the paper's examples: an fp32 buffer fused over all gradients against one "
              "constant buffer of 2**22 fp32 elements.", "", "| Ψ | paper GB | fused buffer GB | CB GB |", "|---|---|---|---|"]
    headline = [{"item": f"Sec 6.2: gradient buffer bytes as Ψ grows {large / small:.1f}x ({scheme})",
                 "paper": "constant with CB" if scheme == "CB" else "grows with Ψ",
                 "ours": f"x{g[large] / g[small]:.2f} ({g[small]:,} -> {g[large]:,} B)",
                 "error": "", "how": "real run"} for scheme, g in growth.items()]
    for _, r in cb_paper.iterrows():
        lines.append(f"| {r.psi / 1e9:g}B | {r.paper_gb:g} | {r.fused_gb:g} | {r.cb_gb:.4f} |")
        headline.append({"item": f"Sec 6.2: fused fp32 gradient buffer, {r.psi / 1e9:g}B", "paper": f"{r.paper_gb:g} GB",
                         "ours": f"{r.fused_gb:g} GB (CB: {r.cb_gb * 1e3:.1f} MB)",
                         "error": f"{r.fused_gb / r.paper_gb - 1:+.1%}", "how": "analysis"})
    with open(out / "REPORT.md", "a") as report:
        report.write("\n".join(lines) + "\n")
    return headline


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "zero_r")
    parser.add_argument("--quick", action="store_true", help="MP = 2 only; Fig 6 confirmed by the engine for C1 and C3 only")
    args = parser.parse_args(argv)
    result = run_study(args.out, args.quick)
    print(f"wrote {args.out}/REPORT.md ({result['meta']['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
