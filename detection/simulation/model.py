"""The built-in model of ``sdcguard train`` and its deterministic synthetic data.

A small transformer-like language model that has every feature a replay must get right:
dropout (RNG), a BatchNorm layer (running statistics: a side effect), LayerNorm, causal
self-attention, an MLP and a final ``nn.Linear`` head (the default ``act-flip`` target).

The data are seeded per (seed, step, rank) through a private generator, never the global RNG,
so ``microbatch(step, rank)`` is a pure function: a partner recomputes it, a resumed run gets
exactly the batches the interrupted run would have seen. Task: ``y[t] = (x[t] + x[t-1]) mod
vocab`` — learnable, and only through attention to the previous token.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TinyTransformer", "batch_seed", "loss_fn", "make_batch"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model and of one micro-batch (``batch * seq_len`` tokens per rank)."""

    vocab: int = 64
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 1
    seq_len: int = 16
    batch: int = 4
    dropout: float = 0.1
    mlp_norm: Literal["batch", "layer"] = "batch"


class _TokenBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the feature dimension of ``(batch, time, features)`` activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class _SelfAttention(nn.Module):
    causal_mask: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.full((cfg.seq_len, cfg.seq_len), float("-inf")).triu(1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // h) + self.causal_mask[:t, :t]
        attn = self.drop(scores.softmax(dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = _SelfAttention(cfg)
        self.norm2: nn.Module = (
            _TokenBatchNorm(cfg.d_model) if cfg.mlp_norm == "batch" else nn.LayerNorm(cfg.d_model)
        )
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, a final LayerNorm and the head."""

    def __init__(self, cfg: ModelConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or ModelConfig()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.embed(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch_seed(seed: int, step: int, rank: int) -> int:
    """Data seed of ``rank``'s micro-batch at ``step`` (independent of the dropout seed)."""
    digest = hashlib.blake2b(f"data:{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def make_batch(
    cfg: ModelConfig, seed: int, step: int, rank: int, device: torch.device | None = None
) -> Batch:
    """The (tokens, targets) micro-batch of ``rank`` at ``step``: a pure function."""
    generator = torch.Generator().manual_seed(batch_seed(seed, step, rank))
    x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), generator=generator)
    previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
    y = (x + previous) % cfg.vocab
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy; ``model`` may be the DDP wrapper or the bare module."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
