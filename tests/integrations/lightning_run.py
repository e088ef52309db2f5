"""A Lightning fit with the probes callback, as a user's script: ``python lightning_run.py OUT [STRATEGY DEVICES]``.

Imported by the tests for its module and data; run as a script for DDP, whose launcher starts the other
ranks by running this same command again.
"""

from __future__ import annotations

import sys

import lightning.pytorch as L
import torch
from torch import nn
from torch.nn import functional as F

from probes.integrations.lightning import ProbesCallback


class Regressor(L.LightningModule):
    def __init__(self, *, lr: float = 1e-2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr
        self.validated = 0  # validation batches seen

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.validated += 1
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def dataset(count: int, *, seed: int = 0) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 8, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def loader(count: int, *, seed: int = 0, batch_size: int = 4) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(count, seed=seed), batch_size=batch_size, shuffle=False)


def trainer(callback, **overrides) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, max_epochs=1)
    options.update(overrides)
    return L.Trainer(callbacks=[callback], **options)


if __name__ == "__main__":
    out, strategy, devices = sys.argv[1], sys.argv[2], int(sys.argv[3])
    module = Regressor()
    fit = trainer(ProbesCallback(out), strategy=strategy, devices=devices, max_steps=3, accumulate_grad_batches=2,
                  num_sanity_val_steps=1, limit_val_batches=1, val_check_interval=2)
    fit.fit(module, loader(48), loader(8, seed=1))
    weights = torch.cat([p.detach().flatten() for p in module.parameters()])
    print(f"rank {fit.global_rank} weights {weights.double().sum().item():.12e}", flush=True)
