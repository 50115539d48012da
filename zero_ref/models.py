"""Small models and synthetic data for the CLI, tests and experiments.

Models are plain `nn.Module`s built from configs (nothing is downloaded) and know nothing about
sharding. Data is a deterministic stream of learnable token sequences (arithmetic progressions
modulo the vocabulary, each with a random start and stride): every rank draws the same global
batch from the same seed and keeps its own slice, so a run at any world size sees the same samples.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F


def tiny_gpt2(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab_size: int = 1000,
              n_positions: int = 128, seed: int = 0) -> nn.Module:
    """A GPT-2 language model from Hugging Face transformers (lm_head tied to wte), built offline."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                        n_positions=n_positions, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def token_batches(vocab_size: int, global_batch: int, seq_len: int, rank: int, world_size: int,
                  seed: int = 1234):
    """Endless (global step, this rank's tokens) pairs: each global batch is drawn from one seeded
    generator and split evenly across ranks. Sequence i is (start_i + stride_i * t) mod vocab, with
    stride_i in 1..7, so a model can learn to continue it."""
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} must be divisible by world_size={world_size}")
    generator = torch.Generator().manual_seed(seed)
    local = global_batch // world_size
    step = 0
    while True:
        start = torch.randint(0, vocab_size, (global_batch, 1), generator=generator)
        stride = torch.randint(1, 8, (global_batch, 1), generator=generator)
        tokens = (start + stride * torch.arange(seq_len)) % vocab_size
        yield step, tokens[rank * local:(rank + 1) * local]
        step += 1


class ParallelGPTBlock(nn.Module):
    """A pre-norm GPT-2 block whose attention and MLP are split across a model-parallel group
    (tensor_parallel.py): each rank runs n_head / Nm heads and 4h / Nm MLP features."""

    def __init__(self, n_embd: int, n_head: int, group, seeds):
        from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, group_size

        super().__init__()
        if n_head % group_size(group):
            raise ValueError(f"n_head = {n_head} is not divisible by the model-parallel size {group_size(group)}")
        self.local_heads = n_head // group_size(group)
        self.head_dim = n_embd // n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        # no q/k/v bias (as in Llama): the key bias has a zero gradient in exact arithmetic (softmax
        # ignores a shift), so AdamW would turn rounding noise into full-size updates
        self.qkv = ColumnParallelLinear(n_embd, 3 * n_embd, group, next(seeds), parts=3, bias=False)
        self.proj = RowParallelLinear(n_embd, n_embd, group, next(seeds))
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = ColumnParallelLinear(n_embd, 4 * n_embd, group, next(seeds))
        self.fc_out = RowParallelLinear(4 * n_embd, n_embd, group, next(seeds))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.local_heads, self.head_dim).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class ParallelGPT(nn.Module):
    """A GPT-2-style language model split Megatron-style over `group` (None: not split): vocabulary-
    parallel embedding tied to the output layer, `n_layer` ParallelGPTBlocks in `self.blocks` (where
    activation checkpointing wraps them, see activations.py), no dropout. Built from `seed` so that
    every split of it starts from the same weights; built under torch.device("meta") it draws
    nothing, and zero_ref.initialize gives it values layer by layer (sharded construction).
    forward(tokens) returns the mean next-token loss."""

    def __init__(self, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab_size: int = 512,
                 n_positions: int = 128, group=None, seed: int = 0):
        from .tensor_parallel import VocabParallelEmbedding

        super().__init__()
        self.group = group
        seeds = itertools.count(seed * 1_000_003)        # one seed per layer: its values on any device and Nm
        self.wte = VocabParallelEmbedding(vocab_size, n_embd, group, next(seeds))
        self.wpe_seed = next(seeds)
        self.wpe = nn.Parameter(torch.empty(n_positions, n_embd))
        self.blocks = nn.ModuleList(ParallelGPTBlock(n_embd, n_head, group, seeds) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        if not self.wpe.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the model's own parameter (the position embeddings; each layer has its own)."""
        from .tensor_parallel import seeded_normal

        self.wpe.copy_(seeded_normal(self.wpe.shape, 0.01, self.wpe_seed))

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """batch x seq x V/Nm: this MP rank's vocabulary slice of the logits (all of them unsplit)."""
        from .tensor_parallel import copy_to_model_parallel

        x = self.wte(tokens) + self.wpe[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return F.linear(copy_to_model_parallel(self.ln_f(x), self.group), self.wte.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from .tensor_parallel import vocab_parallel_cross_entropy

        losses = vocab_parallel_cross_entropy(self.logits(tokens)[:, :-1], tokens[:, 1:], self.wte.first, self.group)
        return losses.mean()
