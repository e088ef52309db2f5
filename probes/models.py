"""Built-in models for the demo, the tests and the benchmarks (no downloads).

    model = TinyTransformer(TransformerConfig(d_model=64, n_layers=2))
    logits = model(tokens)                       # tokens: int64 (batch, seq)
    batch = make_batch(model.config, batch_size=8, seed=0)
    loss = model(batch["tokens"], labels=batch["labels"])   # scalar cross-entropy

Written with plain matmul/softmax ops (no fused attention kernels) so that it exports to ONNX and
trains in ORTModule on torch 2.4 as well as eagerly on newer torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 512
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    seq_len: int = 32
    dropout: float = 0.0


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        head = width // self.n_heads
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.n_heads, head).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head)
        weights = self.dropout(torch.softmax(scores, dim=-1))
        mixed = torch.matmul(weights, v).transpose(1, 2).reshape(batch, seq, width)
        return self.proj(mixed)


class Block(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attn = SelfAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff),
            nn.GELU(),
            nn.Linear(config.d_ff, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A small pre-norm transformer language model."""

    def __init__(self, config: TransformerConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or TransformerConfig()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Parameter(torch.zeros(config.seq_len, config.d_model))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def make_batch(config: TransformerConfig, batch_size: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic batch of random tokens and next-token labels."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.seq_len + 1), generator=generator)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
