"""SubscriberManager under ORTModule: same calls as eager, made by ORT's runtime, steps counted right."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import Recorder, hook_count
from probes import SubscriberManager
from probes.models import TinyTransformer, TransformerConfig, make_batch

pytestmark = [pytest.mark.ort, pytest.mark.slow]

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)


def ortmodule(model):
    from onnxruntime.training.ortmodule import ORTModule

    return ORTModule(model)


def train(model, steps):
    losses = []
    for step in range(steps):
        batch = make_batch(CONFIG, batch_size=4, seed=step)
        loss = model(batch["tokens"], labels=batch["labels"])
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("subscribe_after_wrapping", [False, True])
def test_ort_runs_the_same_probes_as_eager(subscribe_after_wrapping):
    torch.manual_seed(0)
    eager_model = TinyTransformer(CONFIG)
    ort_inner = copy.deepcopy(eager_model)
    eager_rec, ort_rec = Recorder(), Recorder()
    eager_manager, ort_manager = SubscriberManager(), SubscriberManager()
    eager_manager.subscribe(eager_model, [eager_rec])
    if subscribe_after_wrapping:
        ort_model = ortmodule(ort_inner)
        ort_manager.subscribe(ort_model, [ort_rec])
    else:
        ort_manager.subscribe(ort_inner, [ort_rec])
        ort_model = ortmodule(ort_inner)

    eager_losses = train(eager_model, 3)
    ort_losses = train(ort_model, 3)

    assert ort_losses == pytest.approx(eager_losses, rel=1e-5)
    # Export runs (schema run, deep copy, trace) are not steps.
    assert eager_manager.step == ort_manager.step == 3
    assert ort_rec.calls and all(call.by_ort for call in ort_rec.calls), "a probe call did not come from ORT"
    assert not any(call.by_ort for call in eager_rec.calls)
    for step in range(3):
        for phase in ("forward", "backward"):
            assert sorted(ort_rec.names(step, phase)) == sorted(eager_rec.names(step, phase)), (step, phase)
        assert ort_rec.names(step, "forward") == eager_rec.names(step, "forward")
    assert ort_rec.step_ends == eager_rec.step_ends == [0, 1, 2]  # each closed when its backward returned
    ort_manager.unsubscribe()
    eager_manager.unsubscribe()
    assert hook_count(ort_inner) == 0
    assert ort_rec.step_ends == [0, 1, 2]


def test_unsubscribing_an_ortmodule_reexports_without_probes():
    torch.manual_seed(0)
    inner = TinyTransformer(CONFIG)
    model = ortmodule(inner)
    recorder = Recorder()
    manager = SubscriberManager()
    manager.subscribe(model, [recorder])
    train(model, 1)
    calls = len(recorder.calls)
    assert calls > 0
    manager.unsubscribe()
    train(model, 1)
    assert len(recorder.calls) == calls, "probes still ran after unsubscribe"
