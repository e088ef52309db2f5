"""What the trainer integration tests share: a tiny model, its data, and the plain loop they compare with."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch

from probes import StatisticsSubscriber, SubscriberManager


def batches(count: int, *, batch_size: int = 2, seq_len: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": (tokens := torch.randint(0, 64, (batch_size, seq_len), generator=generator)),
             "labels": tokens.clone()} for _ in range(count)]


def examples(count: int, **kwargs) -> list[dict[str, torch.Tensor]]:
    """``count`` single examples (a Trainer dataset): the rows of ``batches(count, batch_size=1)``."""
    return [{key: value[0] for key, value in batch.items()} for batch in batches(count, batch_size=1, **kwargs)]


def plain_loop(model: torch.nn.Module, out: Path, micro_batches: Iterable[dict[str, torch.Tensor]], *,
               loss_of: Callable[[torch.nn.Module, dict], torch.Tensor], accumulate: int = 1,
               lr: float = 1e-3, **options) -> None:
    """What a trainer does, by hand: AdamW (no weight decay), constant lr, no clipping, the loss divided
    by the accumulation; a ``SubscriberManager`` subscription (``options``: the StatisticsSubscriber's)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(out, **options)]):
        for index, batch in enumerate(micro_batches):
            (loss_of(model, batch) / accumulate).backward()
            if (index + 1) % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()
