"""The ZeRO paper's analytic memory model, as plain arithmetic (no torch).

Everything here is a formula printed in the paper (Rajbhandari et al., SC20 / arXiv 1910.02054),
written once so that tests, experiments and the engine's own memory report can be checked
against the same numbers. Units: bytes, and ``GB = 1e9`` bytes as the paper uses them.

Model states (Sec 3.1, 5). Mixed-precision Adam keeps, for Ψ parameters, fp16 parameters (2Ψ),
fp16 gradients (2Ψ) and K·Ψ bytes of optimizer state (fp32 master weights, momentum and
variance: K = 12). Each ZeRO-DP stage splits one more of the three over the Nd data-parallel
ranks, and model parallelism of degree Nm splits all of them once more::

    stage  paper name  params   grads     optimizer   per device (Nm = 1)
    0      baseline    2Ψ       2Ψ        KΨ          (2 + 2 + K)Ψ
    1      Pos         2Ψ       2Ψ        KΨ/Nd       4Ψ + KΨ/Nd
    2      Pos+g       2Ψ       2Ψ/Nd     KΨ/Nd       2Ψ + (2 + K)Ψ/Nd
    3      Pos+g+p     2Ψ/Nd    2Ψ/Nd     KΨ/Nd       (2 + 2 + K)Ψ/Nd

This reproduces every cell of the paper's Table 1 (the paper truncates some 128B and 1T cells,
e.g. 513.5 -> 513, so a comparison needs 1 GB of slack), Figure 1 (7.5B, Nd = 64: 120 / 31.4 /
16.6 / 1.9 GB) and the theory columns of Table 2 (see ``max_params_fitting``).

Parameter counts (``gpt2_like_params``) for the paper's shapes, relative to the size it names
(SC20 Table IV and the artifact appendix, with embeddings, vocab 50257, seq 1024)::

    1.5B 48x1600 +3.8%   8B 72x3072 +3.9%    20B 98x4096 -0.3%   40B 88x6144 +0.5%
    60B 132x6144 +0.2%   80B 100x8192 +1.2%  100B 125x8192 +1.1% 120B 150x8192 +1.0%
    140B 175x8192 +1.0%  170B 212x8192 +0.7% 60B 75x8192 +1.4%   40B 50x8192 +1.7%
    50B 62x8192 +0.7%    150B 187x8192 +0.7%
    Fig 4 (no MP): 1.5B 34x1920 +6.9%  2.5B 54x1920 -0.5%  4B 64x2304 +4.9%
      6B 52x3072 +0.8%  8B 72x3072 +3.9%  10B 50x4096 +2.8%  11B 54x4096 +0.8%
      12B 58x4096 -0.9%  13B 62x4096 -2.3%  baseline 1.16B 24x1920 +0.1%
      baseline 1.38B 40x1536 -12.2%  (the one shape the paper names far from its count)

The paper names sizes loosely; all but two shapes are within 5%. The formula itself is exact for
GPT-2: it gives 124,439,808 / 354,823,168 / 774,030,080 / 1,557,611,200 for GPT-2 small /
medium / large / XL, the counts of Hugging Face's ``GPT2LMHeadModel`` (tied output embedding).

Activations (Sec 3.2, 6.1) and constant buffers (Sec 3.2, 6.2): see ``activation_values`` and
``constant_buffer_bytes``, whose docstrings say which headline numbers reproduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from fractions import Fraction
from numbers import Integral, Real

GB = 1e9
"""The paper's gigabyte: 10**9 bytes (Table 1 and Table 2 use it)."""

ADAM_K = 12
"""Optimizer-state bytes per parameter for mixed-precision Adam: fp32 weights, momentum, variance."""

PAPER_NAMES = ("baseline", "Pos", "Pos+g", "Pos+g+p")
"""The paper's names of the four schemes, indexed by our stage number."""


class Stage(IntEnum):
    """ZeRO-DP stages, numbered as DeepSpeed and this project number them."""

    BASELINE = 0  # plain data parallelism: everything replicated
    POS = 1  # optimizer states partitioned
    POS_G = 2  # + gradients partitioned
    POS_G_P = 3  # + parameters partitioned

    @property
    def paper_name(self) -> str:
        return PAPER_NAMES[self]


def parse_stage(stage: int | str | Stage) -> Stage:
    """Turn ``0..3``, a ``Stage`` or a paper name ("baseline", "Pos", "Pos+g", "Pos+g+p") into a Stage.

    Names are matched without regard to case or surrounding spaces. Anything else raises a
    ValueError that names the argument and lists the allowed values.
    """
    if isinstance(stage, str):
        wanted = stage.strip().lower()
        for number, name in enumerate(PAPER_NAMES):
            if name.lower() == wanted:
                return Stage(number)
    elif isinstance(stage, Integral) and not isinstance(stage, bool) and 0 <= stage <= 3:
        return Stage(int(stage))
    raise ValueError(
        f"stage must be one of 0, 1, 2, 3 or {', '.join(map(repr, PAPER_NAMES))}; got {stage!r}"
    )


# ----------------------------------------------------------------------------------------------
# argument checks (each names the offending argument)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return int(value)


def _check_real(name: str, value, *, positive: bool = False) -> float:
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}")
    return value


def _check_count(name: str, value, minimum: int = 0) -> int:
    """An element count: an int, or an integral float such as ``1.5e9``."""
    if isinstance(value, Real) and not isinstance(value, (bool, Integral)):
        if math.isfinite(value) and float(value).is_integer():
            value = int(value)
    return _check_int(name, value, minimum)


# ----------------------------------------------------------------------------------------------
# model states


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-device bytes of the three model states; ``total`` is what Table 1 prints (÷ GB)."""

    params: float
    grads: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer_states


def shard_counts(stage: int | str | Stage, nd: int) -> tuple[int, int, int]:
    """Over how many data-parallel ranks (params, grads, optimizer states) are split.

    This is the whole idea of ZeRO-DP in one line: each stage turns one more ``1`` into ``nd``.
    """
    stage = parse_stage(stage)
    nd = _check_int("nd", nd, 1)
    return tuple(nd if stage >= level else 1 for level in (Stage.POS_G_P, Stage.POS_G, Stage.POS))


def model_state_bytes(
    psi: float,
    stage: int | str | Stage,
    nd: int,
    *,
    k: float = ADAM_K,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    nm: int = 1,
) -> ModelStateBytes:
    """Per-device model-state bytes for ``psi`` parameters under a ZeRO stage (paper Sec 5).

    ``nd`` is the data-parallel degree, ``nm`` the model-parallel degree: each model-parallel
    rank holds Ψ/Nm parameters, so every term is divided by Nm as well (the paper's largest
    reduction, Nd × Nm, is stage 3 with both).

    >>> round(model_state_bytes(7.5e9, "Pos", 64).total / GB, 1)   # Figure 1
    31.4
    """
    psi = _check_real("psi", psi)
    nm = _check_int("nm", nm, 1)
    k = _check_real("k", k)
    param_bytes = _check_real("param_bytes", param_bytes)
    grad_bytes = _check_real("grad_bytes", grad_bytes)
    p_shards, g_shards, o_shards = shard_counts(stage, nd)
    return ModelStateBytes(
        params=psi * param_bytes / (p_shards * nm),
        grads=psi * grad_bytes / (g_shards * nm),
        optimizer_states=psi * k / (o_shards * nm),
    )


def comm_volume_elements(psi: float, stage: int | str | Stage, *, nm: int = 1) -> float:
    """Elements each rank moves per training step, counted the paper's way (Sec 7).

    The paper counts a reduce-scatter or an all-gather of Ψ elements as Ψ per rank (a ring
    really sends (Nd-1)/Nd·Ψ; the paper quotes the large-Nd limit). Baseline DP all-reduces
    gradients = reduce-scatter + all-gather = 2Ψ. Pos and Pos+g reduce-scatter gradients and
    all-gather updated parameters: also 2Ψ. Pos+g+p gathers parameters in forward and again in
    backward plus the gradient reduce-scatter: 3Ψ, 1.5x the baseline. With model parallelism
    each rank's data-parallel traffic is over its own Ψ/Nm parameters.
    """
    psi = _check_real("psi", psi)
    nm = _check_int("nm", nm, 1)
    factor = 3 if parse_stage(stage) == Stage.POS_G_P else 2
    return factor * psi / nm


def max_params_fitting(
    stage: int | str | Stage,
    nd: int,
    device_bytes: float,
    *,
    k: float = ADAM_K,
    nm: int = 1,
    reserved_bytes: float = 0,
    param_bytes: float = 2,
    grad_bytes: float = 2,
) -> int:
    """The largest Ψ whose model states fit in ``device_bytes - reserved_bytes`` (Table 2 theory).

    Per-device bytes are linear in Ψ (c·Ψ, with c from ``model_state_bytes``), so Ψ_max is the
    free memory divided by c, rounded down; it is computed in exact fractions so that e.g.
    stage 3 at 32 GB and Nd = 64 gives exactly 128e9. Table 2 (32 GB, Nd = 64) at MP 1 is
    2B / 7.642B / 14.423B / 128B, and scales linearly with Nm. The paper prints 7.6 and 14.4
    and then multiplies those rounded values by Nm (e.g. 121.6 where the formula gives 122.269),
    and prints 0.5T / 1T / 2T for the stage-3 values 512B / 1024B / 2048B.
    ``reserved_bytes`` leaves room for anything else (activations, buffers, fragmentation).
    """
    device_bytes = _check_real("device_bytes", device_bytes)
    reserved_bytes = _check_real("reserved_bytes", reserved_bytes)
    nm = _check_int("nm", nm, 1)
    k = _check_real("k", k)
    param_bytes = _check_real("param_bytes", param_bytes)
    grad_bytes = _check_real("grad_bytes", grad_bytes)
    shards = shard_counts(stage, nd)
    per_param = sum(
        Fraction(b) / (s * nm) for b, s in zip((param_bytes, grad_bytes, k), shards)
    )
    free = Fraction(device_bytes) - Fraction(reserved_bytes)
    if free <= 0:
        return 0
    if per_param == 0:
        raise ValueError("param_bytes, grad_bytes and k are all 0: every model fits")
    return math.floor(free / per_param)


# ----------------------------------------------------------------------------------------------
# residual states: activations and temporary buffers


def activation_values(
    hidden: int,
    batch: int,
    seq: int,
    layers: int,
    *,
    checkpointing: bool = False,
    nm: int = 1,
    pa: bool = False,
) -> int:
    """Activation values (elements) held per GPU for a GPT-2-like transformer (Sec 3.2, 6.1).

    * No checkpointing: the paper's footnote count, 12 × hidden × batch × seq × layers, for the
      whole model. The paper gives no split of these under model parallelism, so ``nm`` does not
      divide them (Megatron would split some of them: read this as a per-replica upper bound).
    * ``checkpointing=True``: one checkpoint per transformer layer, the layer's input of
      batch × seq × hidden values: batch·seq·hidden·layers. Megatron-style MP replicates every
      checkpoint on all Nm ranks of a model-parallel group.
    * ``pa=True`` (ZeRO-R Pa, needs checkpointing): each checkpoint is partitioned over the Nm
      model-parallel ranks, so a rank keeps ceil(batch·seq·hidden / Nm) values per layer
      (rounded up, as padded shards are).

    How this reproduces the paper's headline numbers (fp16, 2 bytes per value, GB = 1e9):

    * GPT-2 1.5B (48 × 1600), seq 1K, batch 32, no checkpointing: 60.4 GB vs "about 60 GB".
      Reproduced (+0.7%).
    * Same, with checkpointing: 5.03 GB vs "about 8 GB". **Not reproduced** (-37%). The
      paper does not show its accounting. Adding one layer's full activations during
      recomputation (1.26 GB) gives 6.3 GB; adding the fp16 logits (batch·seq·vocab, 3.3 GB)
      would give 8.3 GB. Both are guesses, so the model keeps the count the paper describes.
    * 100B (125 × 8192), batch 32, seq 1024, checkpointed: 67.1 GB vs Sec 3.2's "about 60 GB".
      Same order, 12% high: not reproduced to the paper's one-significant-figure rounding.
    * Same at MP 16, per GPU (Sec 6.1): 67.1 GB vs "about 33 GB", and with Pa 4.19 GB vs
      "about 2 GB". The ratio, exactly Nm = 16, reproduces. The absolute values are 2x the
      paper's: they match only at 1 byte per value (33.55 GB, which the paper would truncate
      to 33 as in Table 1, and 2.10 GB) or at half the batch. We do not fudge the formula.
    """
    hidden = _check_int("hidden", hidden, 1)
    batch = _check_int("batch", batch, 1)
    seq = _check_int("seq", seq, 1)
    layers = _check_int("layers", layers, 1)
    nm = _check_int("nm", nm, 1)
    if pa and not checkpointing:
        raise ValueError("pa=True partitions activation checkpoints: it needs checkpointing=True")
    if not checkpointing:
        return 12 * hidden * batch * seq * layers
    per_checkpoint = batch * seq * hidden
    if pa:
        per_checkpoint = -(-per_checkpoint // nm)  # ceil division: padded shards
    return per_checkpoint * layers


def activation_bytes(
    hidden: int,
    batch: int,
    seq: int,
    layers: int,
    *,
    bytes_per_value: float = 2,
    checkpointing: bool = False,
    nm: int = 1,
    pa: bool = False,
) -> float:
    """``activation_values`` × ``bytes_per_value`` (2 for fp16/bf16, the paper's setting)."""
    bytes_per_value = _check_real("bytes_per_value", bytes_per_value, positive=True)
    values = activation_values(
        hidden, batch, seq, layers, checkpointing=checkpointing, nm=nm, pa=pa
    )
    return values * bytes_per_value


def constant_buffer_bytes(bucket_numel: int, bytes_per_elem: float) -> float:
    """Bytes of one fused communication/norm buffer of ``bucket_numel`` elements (ZeRO-R CB).

    Fusing all gradients into one flat buffer makes its size proportional to Ψ: the paper's
    examples are a 1.5B model's fp32 flattened gradients, ``constant_buffer_bytes(1.5e9, 4)``
    = 6 GB, and a 3B model's 32-bit fused buffer, ``constant_buffer_bytes(3e9, 4)`` = 12 GB.
    CB caps the buffer at a fixed ``bucket_numel`` chosen for bandwidth, not for the model, so
    this number stays the same however large Ψ grows. (The paper gives no bucket size.)
    """
    bucket_numel = _check_count("bucket_numel", bucket_numel)
    bytes_per_elem = _check_real("bytes_per_elem", bytes_per_elem, positive=True)
    return bucket_numel * bytes_per_elem


def gpt2_like_params(
    layers: int,
    hidden: int,
    *,
    vocab: int = 50257,
    seq: int = 1024,
    include_embeddings: bool = True,
) -> int:
    """Parameters of a GPT-2-shaped transformer (output layer tied to the token embedding).

    Per layer: attention qkv (3h² + 3h) and output projection (h² + h), MLP h -> 4h -> h
    (8h² + 5h), two layernorms (4h): 12h² + 13h. Then token and position embeddings
    (vocab·h + seq·h) and the final layernorm (2h). The module docstring lists how close this
    comes to the sizes the paper names.
    """
    layers = _check_int("layers", layers, 1)
    hidden = _check_int("hidden", hidden, 1)
    vocab = _check_int("vocab", vocab, 0)
    seq = _check_int("seq", seq, 0)
    blocks = 12 * layers * hidden**2 + 13 * layers * hidden
    if not include_embeddings:
        return blocks
    return blocks + vocab * hidden + seq * hidden + 2 * hidden


# ----------------------------------------------------------------------------------------------
# the paper's tables, as rows for the experiments to write out

TABLE1_MODELS = (("7.5B", 7.5e9), ("128B", 128e9), ("1T", 1e12))
TABLE1_ND = (1, 4, 16, 64, 256, 1024)


def table1_rows() -> list[dict]:
    """Table 1: per-device model-state GB for 7.5B / 128B / 1T at Nd = 1..1024, stages 1-3.

    Keys: model, psi, nd, stage (0-3), scheme (paper name), gb (unrounded formula value).
    """
    return [
        {
            "model": model,
            "psi": psi,
            "nd": nd,
            "stage": int(stage),
            "scheme": stage.paper_name,
            "gb": model_state_bytes(psi, stage, nd).total / GB,
        }
        for model, psi in TABLE1_MODELS
        for nd in TABLE1_ND
        for stage in (Stage.POS, Stage.POS_G, Stage.POS_G_P)
    ]


def table2_theory_rows(
    device_gb: float = 32, nd: int = 64, mp_degrees: tuple[int, ...] = (1, 2, 4, 8, 16)
) -> list[dict]:
    """Table 2's theory columns: the largest model whose states fit, per MP degree and stage.

    Keys: nm, gpus (= Nd·Nm), nd, stage, scheme, gb (the device memory), psi (exact maximum,
    parameters), psi_b (the same in billions) and psi_b_paper (the paper's arithmetic: the
    MP-1 value rounded to 0.1B, then multiplied by Nm).
    """
    rows = []
    for nm in mp_degrees:
        for stage in Stage:
            psi = max_params_fitting(stage, nd, device_gb * GB, nm=nm)
            at_mp1 = max_params_fitting(stage, nd, device_gb * GB)
            rows.append(
                {
                    "nm": nm,
                    "gpus": nd * nm,
                    "nd": nd,
                    "stage": int(stage),
                    "scheme": stage.paper_name,
                    "gb": device_gb,
                    "psi": psi,
                    "psi_b": psi / 1e9,
                    "psi_b_paper": round(round(at_mp1 / 1e9, 1) * nm, 6),
                }
            )
    return rows
