"""A probed training step on CUDA makes no host sync with the sentinel off (skipped where no CUDA device exists).

    ./dev run --lane ort python -m pytest -q tests/stats/test_cuda_sync.py

Each model trains 3 steps with and without a StatisticsSubscriber; step 3 (after the warm-up steps that
cache sample positions on the device) runs its forward and backward under
``torch.cuda.set_sync_debug_mode("error")``: the probes' statistics rows stay on the device and the step
end hands them to the host in one non-blocking copy inside backward()'s end callback, so nothing may raise.
A sync inside a probe would be caught by the probe (a probe never stops training), so the step's warnings
are checked too: no ProbeFailureWarning, no UnsupportedTensorWarning, and every record has statistics.
With ``on_anomaly="warn"`` the sentinel reads once per phase (syncs expected): only the training is checked.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from probes import ProbeFailureWarning, StatisticsSubscriber, SubscriberManager, load_dump
from probes.models import TinyTransformer, TransformerConfig, make_batch
from probes.stats.recorder import UnsupportedTensorWarning

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

STEPS = 3


def _mlp() -> tuple[nn.Module, Callable[[nn.Module, int], torch.Tensor]]:
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)))

    def loss(model: nn.Module, step: int) -> torch.Tensor:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).cuda()
        return model(x).pow(2).mean()
    return model, loss


def _transformer() -> tuple[nn.Module, Callable[[nn.Module, int], torch.Tensor]]:
    model = TinyTransformer(TransformerConfig())

    def loss(model: nn.Module, step: int) -> torch.Tensor:
        batch = make_batch(model.config, seed=step)
        return model(batch["tokens"].cuda(), labels=batch["labels"].cuda())
    return model, loss


MODELS = {"mlp": _mlp, "transformer": _transformer}


def _train(name: str, out: Path | None, strict: bool, **options: object) -> torch.Tensor:
    """The losses of STEPS steps; with ``strict`` the last step's forward+backward runs in sync-error mode."""
    torch.manual_seed(0)
    model, loss_of = MODELS[name]()
    model.cuda()
    manager = SubscriberManager()
    if out is not None:
        manager.subscribe(model, [StatisticsSubscriber(out, **options)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    try:
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            if strict and step == STEPS - 1:
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        loss = loss_of(model, step)
                        loss.backward()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                bad = [w for w in caught if issubclass(w.category, (ProbeFailureWarning, UnsupportedTensorWarning))]
                assert not bad, [str(w.message) for w in bad]
            else:
                loss = loss_of(model, step)
                loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    finally:
        manager.unsubscribe()
    return torch.stack(losses).cpu()


@pytest.mark.parametrize("name", MODELS)
def test_probed_step_makes_no_host_sync(name, tmp_path):
    try:
        plain = _train(name, None, strict=True)
    except RuntimeError as error:
        pytest.skip(f"the {name} model syncs by itself in this torch version: {error}")
    probed = _train(name, tmp_path, strict=True)
    assert torch.equal(plain, probed), (plain, probed)
    last = [record for record in load_dump(tmp_path) if record["step"] == STEPS - 1]
    assert last, "no records of the step run in sync-error mode"
    assert not [record["name"] for record in last if record.get("unsupported")]
    assert {record["phase"] for record in last} >= {"forward", "backward"}


@pytest.mark.parametrize("name", MODELS)
def test_sentinel_trains_identically_on_cuda(name, tmp_path):
    plain = _train(name, None, strict=False)
    probed = _train(name, tmp_path, strict=False, on_anomaly="warn")
    assert torch.equal(plain, probed), (plain, probed)
    records = load_dump(tmp_path)
    assert {record["step"] for record in records} == set(range(STEPS))
    assert not [record["name"] for record in records if record.get("unsupported")]
