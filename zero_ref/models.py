"""Small models and synthetic data for the CLI, tests and experiments.

Models are plain `nn.Module`s built from configs (nothing is downloaded) and know nothing about
sharding. Data is a deterministic stream of learnable token sequences (arithmetic progressions
modulo the vocabulary, each with a random start and stride): every rank draws the same global
batch from the same seed and keeps its own slice, so a run at any world size sees the same samples.
"""

from __future__ import annotations

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
