"""Under ORTModule, a step no subscriber records runs a second graph, exported without probes: ORT runs it
(no PyTorch fallback: conftest disables it) and calls no PythonOp; recorded steps run the probed graph.
Training is the same with probes at any cadence as without them."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from helpers import Recorder, called_by_ort_runtime
from probes import SubscriberManager
from probes.core.functions import StepBoundary, TensorProbe
from probes.models import TinyTransformer, TransformerConfig, make_batch

pytestmark = [pytest.mark.ort, pytest.mark.slow]

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
STEPS = 6


@pytest.fixture
def pythonop_calls(monkeypatch):
    """The probe Functions' forward and backward calls ORT's runtime makes (its PythonOp calls), per step
    number the test sets in ``calls.step``."""
    calls = collections.Counter()
    for function in (TensorProbe, StepBoundary):
        for name in ("forward", "backward"):
            original = getattr(function, name)

            def counting(ctx, *args, _original=original):
                calls[calls.step] += called_by_ort_runtime()
                return _original(ctx, *args)

            monkeypatch.setattr(function, name, staticmethod(counting))
    calls.step = None
    return calls


def ortmodule(model):
    from onnxruntime.training.ortmodule import ORTModule

    return ORTModule(model)


def train(model, calls, eager_calls, steps=STEPS, around=None):
    """SGD steps; per step its loss, and how many times its first block's Python forward ran (``eager_calls``
    of ``counted_model``: in ORT's exports only, its graph runs no Python module)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, eager = [], []
    for step in range(steps):
        calls.step = step
        before = eager_calls[0]
        batch = make_batch(CONFIG, batch_size=4, seed=step)
        optimizer.zero_grad()
        with around(step) if around is not None else contextlib.nullcontext():
            loss = model(batch["tokens"], labels=batch["labels"])
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
        eager.append(eager_calls[0] - before)
    calls.step = None
    return losses, eager


def counted_model():
    torch.manual_seed(0)
    inner = TinyTransformer(CONFIG)
    eager_calls = [0]
    first_block = next(module for name, module in inner.named_modules() if name.count(".") == 1)
    first_block.register_forward_hook(lambda *args: eager_calls.__setitem__(0, eager_calls[0] + 1))
    return inner, eager_calls


def test_left_out_steps_run_an_unprobed_ort_graph_and_train_as_without_probes(pythonop_calls):
    runs = {}
    for case in ("without probes", "probes"):
        inner, eager_calls = counted_model()
        manager = SubscriberManager()
        every, chosen = Recorder(every_n_steps=3), Recorder(steps=[4])  # records steps 0, 3 and 4
        if case == "probes":
            manager.subscribe(inner, [every, chosen])
        pythonop_calls.clear()
        losses, eager = train(ortmodule(inner), pythonop_calls, eager_calls)
        grads = {name: p.grad.clone() for name, p in inner.named_parameters()}
        weights = {name: p.detach().clone() for name, p in inner.named_parameters()}
        runs[case] = losses, grads, weights, dict(pythonop_calls), eager
        if case == "probes":
            assert manager.step == STEPS
            manager.unsubscribe()
            assert every.step_ends == [0, 3] and chosen.step_ends == [4]
            assert {c.step for c in every.calls} == {0, 3} and {c.step for c in chosen.calls} == {4}
            assert every.calls and all(c.by_ort for c in every.calls + chosen.calls), "a record not made inside ORT"
    losses, grads, weights, calls, eager = runs["probes"]
    # Recorded steps call the probes from ORT's graph; left-out steps call no PythonOp at all.
    assert all(calls.get(step, 0) > 0 for step in (0, 3, 4)), calls
    assert all(calls.get(step, 0) == 0 for step in (1, 2, 5)), calls
    # Each graph is exported once (the probed one at step 0, the unprobed one at step 1, the first left out):
    # the model's Python runs in those exports only, never again when steps alternate, so ORT ran every step.
    assert eager[0] > 0 and eager[1] > 0 and eager[2:] == [0] * (STEPS - 2), eager
    assert runs["without probes"][4][1:] == [0] * (STEPS - 1)
    # Training with probes, recorded or left out, is training without them: bit for bit.
    plain_losses, plain_grads, plain_weights, _, _ = runs["without probes"]
    assert losses == plain_losses
    assert all(torch.equal(grads[name], plain_grads[name]) for name in plain_grads)
    assert all(torch.equal(weights[name], plain_weights[name]) for name in plain_weights)


def test_pause_resume_evaluation_and_unsubscribe_switch_between_the_ort_graphs(pythonop_calls):
    inner, eager_calls = counted_model()
    recorder, manager = Recorder(), SubscriberManager()
    model = ortmodule(inner)
    manager.subscribe(model, [recorder])  # subscribed after wrapping: the same routing
    tokens = make_batch(CONFIG, batch_size=2, seed=9)["tokens"]

    def evaluate():
        model.eval()
        with torch.no_grad():
            logits = model(tokens)
        model.train()
        return logits

    paused = {1, 2}
    losses, _ = train(model, pythonop_calls, eager_calls, steps=4,
                      around=lambda step: manager.paused() if step in paused else contextlib.nullcontext())
    assert manager.step == 2 and recorder.step_ends == [0, 1]  # paused steps are no steps
    assert pythonop_calls[1] == pythonop_calls[2] == 0 and pythonop_calls[0] > 0 and pythonop_calls[3] > 0
    assert {c.step for c in recorder.calls} == {0, 1} and all(c.by_ort for c in recorder.calls)

    # Evaluation: recorded on the probed inference graph, while paused on the unprobed one; same logits.
    pythonop_calls.step = "eval recorded"
    recorded = evaluate()
    manager.flush()
    pythonop_calls.step = "eval paused"
    with manager.paused():
        left_out = [evaluate(), evaluate()]
        before = eager_calls[0]
        again = evaluate()
        assert eager_calls[0] == before, "the unprobed inference graph was exported again"
    assert pythonop_calls["eval recorded"] > 0 and pythonop_calls["eval paused"] == 0
    assert all(torch.equal(logits, recorded) for logits in [*left_out, again])
    assert manager.step == 3 and recorder.step_ends == [0, 1, 2]

    # Unsubscribed: ORT runs the model's own graph again (exported anew), no probe, same training.
    manager.unsubscribe()
    pythonop_calls.clear()
    train(model, pythonop_calls, eager_calls, steps=2)
    assert not any(pythonop_calls.values()) and recorder.step_ends == [0, 1, 2]
    reference_inner, reference_calls = counted_model()
    reference = train(ortmodule(reference_inner), collections.Counter(), reference_calls, steps=4)[0]
    assert losses == reference


def test_a_subscriber_that_builds_the_graph_keeps_every_ort_step_on_the_probed_graph(pythonop_calls):
    from probes import SubscriberBase

    class Builder(SubscriberBase):
        def post_forward_module_apply(self, site, module, args, outputs):
            return outputs

    inner, eager_calls = counted_model()
    manager = SubscriberManager()
    manager.subscribe(inner, [Recorder(every_n_steps=2), Builder()])
    train(ortmodule(inner), pythonop_calls, eager_calls, steps=2)
    manager.unsubscribe()
    assert pythonop_calls[0] > 0 and pythonop_calls[1] > 0  # the builder's graph runs every step
