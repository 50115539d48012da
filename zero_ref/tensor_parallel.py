"""Megatron-style model parallelism (MP): the layers a transformer is split with, on one MP group.

Model parallelism splits each layer's weights across the Nm ranks of a model-parallel group, so
each rank computes part of every layer (Shoeybi et al., Megatron-LM; the ZeRO paper's "MP"). ZeRO
then shards what is left over the data-parallel group only (`zero_ref.initialize(..., mesh=...)`).

Two operators carry all the communication (Megatron's f and g):

    copy_to_model_parallel (f)       forward: identity;    backward: all-reduce the gradient
    reduce_from_model_parallel (g)   forward: all-reduce;  backward: identity

A column-parallel linear holds a slice of the output features and starts with f; a row-parallel
linear holds a slice of the input features and ends with g. An attention block or an MLP is one
column-parallel linear followed by one row-parallel one, so it costs one all-reduce of
batch x seq x hidden in forward and one in backward. The vocabulary is split the same way: the
embedding looks up only its rows (g sums the pieces) and the loss is computed on split logits
without ever gathering them (`vocab_parallel_cross_entropy`).

Parameters split across the group carry their `Split` (`split_of`, `is_model_parallel`): the
dimension they are cut along and in how many blocks. It is the one description of a layer's split,
used both ways: `Split.cut` gives an MP rank its slice of the full tensor (initialisation, and
engine.load_state_dict of an unsplit state dict), `Split.join` puts every MP rank's slice back
together (engine.full_state_dict, and `zero-ref consolidate`, which reads the splits from the
checkpoint's manifest). The other parameters (layer norms, the row-parallel biases, position
embeddings) are replicated, get identical gradients on every MP rank, and the engine counts them
once in the global gradient norm.

Each layer has a `seed`; `reset_parameters()` draws its weight full size on the CPU from that seed
and keeps this rank's slice (its Split's cut), so a model split over any Nm starts from exactly the
weights of the unsplit model (Nm = 1) and trains to the same result. Built under `torch.device("meta")` a layer
draws nothing; sharded construction (materialize.py) calls `reset_parameters()` one module at a
time, so no more than one layer's full weight ever exists.
torch's own tensor parallelism (`torch.distributed.tensor.parallel`) makes parameters DTensors,
which cannot become views of the engine's flat buffers; these layers keep plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

_MODEL_PARALLEL = "_zero_ref_model_parallel"


@dataclass(frozen=True)
class Split:
    """How a tensor is split across the Nm ranks of the MP group: along `dim`, whose extent is
    `parts` equal blocks (a fused q/k/v weight: 3), each cut in Nm equal slices; MP rank r holds
    slice r of every block, concatenated in block order. With parts=1, rank r holds the r-th
    contiguous 1/Nm of `dim`."""
    dim: int
    parts: int = 1

    def cut(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        """MP rank `rank`'s slice of `full` (a new contiguous tensor)."""
        blocks = full.chunk(self.parts, dim=self.dim)
        return torch.cat([b.chunk(size, dim=self.dim)[rank] for b in blocks], dim=self.dim).contiguous()

    def join(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every MP rank's slice, in MP rank order: the inverse of `cut`."""
        per_rank = [s.chunk(self.parts, dim=self.dim) for s in slices]
        return torch.cat([torch.cat([blocks[b] for blocks in per_rank], dim=self.dim) for b in range(self.parts)],
                         dim=self.dim)

    def full_shape(self, shape, size: int) -> tuple[int, ...]:
        """The full tensor's shape, from the shape of one of `size` slices."""
        return tuple(n * size if d == self.dim else n for d, n in enumerate(shape))


def split_of(param: torch.Tensor) -> Split | None:
    """How `param` is split across the model-parallel group (None: replicated, the same full
    tensor on every MP rank)."""
    return getattr(param, _MODEL_PARALLEL, None)


def is_model_parallel(param: torch.Tensor) -> bool:
    """True when `param` holds this rank's slice of a tensor split across the model-parallel group."""
    return split_of(param) is not None


def _mark(param: nn.Parameter, split: Split) -> nn.Parameter:
    setattr(param, _MODEL_PARALLEL, split)
    return param


def group_size(group) -> int:
    """Ranks in the model-parallel group (None: no model parallelism, 1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# --- the two operators -------------------------------------------------------------------------------
class _CopyToModelParallel(torch.autograd.Function):
    """f: identity forward; backward sums the partial input gradients of the MP ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromModelParallel(torch.autograd.Function):
    """g: forward sums the MP ranks' partial outputs; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_model_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's f (see the module docstring); a no-op without model parallelism."""
    return x if group_size(group) == 1 else _CopyToModelParallel.apply(x, group)


def reduce_from_model_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's g (see the module docstring); a no-op without model parallelism."""
    return x if group_size(group) == 1 else _ReduceFromModelParallel.apply(x, group)


# --- layers ------------------------------------------------------------------------------------------
def _check_divisible(what: str, value: int, size: int) -> None:
    if value % size:
        raise ValueError(f"{what} = {value} is not divisible by the model-parallel size {size}")


def seeded_normal(shape: tuple[int, int], std: float, seed: int) -> torch.Tensor:
    """A full-size weight drawn on the CPU from `seed` (the same values on every device and Nm)."""
    return torch.empty(shape).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))


class _SeededLayer(nn.Module):
    """A layer whose weight is drawn full from its own seed and cut by the weight's Split."""

    def _start(self, weight_shape: tuple[int, int], seed: int, std: float) -> None:
        self.full_shape, self.seed, self.std = weight_shape, seed, std

    @torch.no_grad()
    def reset_parameters(self) -> None:
        full = seeded_normal(self.full_shape, self.std, self.seed)
        self.weight.copy_(split_of(self.weight).cut(full, group_size(self.group), group_rank(self.group)))
        if getattr(self, "bias", None) is not None:
            self.bias.zero_()

    def _initialise(self) -> None:
        if not self.weight.is_meta:
            self.reset_parameters()


class ColumnParallelLinear(_SeededLayer):
    """y = x W^T + b with W's output features split across the MP group: rank r holds rows
    r/Nm of each of `parts` blocks (parts=3 keeps q, k and v heads together), and the same rows
    of b: Split(dim=0, parts) for both. Returns its slice of y. Communicates in backward only (f:
    all-reduce of the input gradient)."""

    def __init__(self, in_features: int, out_features: int, group, seed: int, parts: int = 1,
                 std: float = 0.02, bias: bool = True):
        super().__init__()
        self.group, self.parts, size = group, parts, group_size(group)
        _check_divisible("out_features / parts", out_features // parts, size)
        self._start((out_features, in_features), seed, std)
        rows = Split(dim=0, parts=parts)
        self.weight = _mark(nn.Parameter(torch.empty(out_features // size, in_features)), rows)
        self.bias = _mark(nn.Parameter(torch.empty(out_features // size)), rows) if bias else None
        self._initialise()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_model_parallel(x, self.group), self.weight, self.bias)


class RowParallelLinear(_SeededLayer):
    """y = x W^T + b with W's input features split across the MP group: rank r holds columns r/Nm
    (Split(dim=1)) and takes its slice of x (a column-parallel layer's output); the partial products
    are summed (g: one all-reduce in forward), then the replicated bias is added."""

    def __init__(self, in_features: int, out_features: int, group, seed: int, std: float = 0.02):
        super().__init__()
        self.group, size = group, group_size(group)
        _check_divisible("in_features", in_features, size)
        self._start((out_features, in_features), seed, std)
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // size)), Split(dim=1))
        self.bias = nn.Parameter(torch.empty(out_features))
        self._initialise()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_model_parallel(F.linear(x, self.weight), self.group) + self.bias


class VocabParallelEmbedding(_SeededLayer):
    """An embedding whose vocabulary rows are split across the MP group (Split(dim=0): rank r holds
    rows [r V/Nm, (r+1) V/Nm)): each rank looks up the tokens in its range (zeros elsewhere) and g
    sums the pieces (one all-reduce in forward)."""

    def __init__(self, vocab_size: int, dim: int, group, seed: int, std: float = 0.02):
        super().__init__()
        self.group, size = group, group_size(group)
        _check_divisible("vocab_size", vocab_size, size)
        self.rows = vocab_size // size
        self.first = group_rank(group) * self.rows
        self._start((vocab_size, dim), seed, std)
        self.weight = _mark(nn.Parameter(torch.empty(self.rows, dim)), Split(dim=0))
        self._initialise()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.first
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_model_parallel(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy per token from logits split over the vocabulary (rank r: columns
    [first, first + V/Nm)): two all-reduces of a few values per token (the max; then the sum of
    exponentials and the target logit together) instead of gathering batch x seq x V logits."""

    @staticmethod
    def forward(ctx, logits, targets, first, group):
        logits = logits.float()
        top = logits.max(dim=-1).values
        if group_size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        local = targets - first
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group_size(group) > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), (outside.float() - 1.0).unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, first: int, group) -> torch.Tensor:
    """Per-token cross-entropy (fp32) of `targets` under logits whose last dimension is this rank's
    vocabulary slice starting at token `first`."""
    return _VocabParallelCrossEntropy.apply(logits, targets, first, group)
