"""Tensors of one probe call that share memory: a module returns a tensor and a view of it (or one tensor twice),
or gets them as inputs, and one of them is changed in place before the other is used. With probes the losses and
gradients equal those without, on every backend, and the records say what the model computed (numpy float64).

A probe hands back a detached alias of each tensor; two such aliases of one memory are independent for autograd,
so an in-place change made through one would reach the other's values but not its gradient (the hole this file
closes, ``probes.core.aliases``). One tensor at several places is probed once and comes back as one tensor at each
(its gradient recorded at its first place); tensors that are views of one another are read: each gets a forward
record, everything goes on as the module made it, and none gets a gradient record (on any backend), with no warning.

The model's forward is an elementwise product, exact in float32 on every backend, so that ORT's forward records
match numpy float64 of the eager tensors too; ORT computes the gradients with other kernels and fusions than
eager PyTorch, so there they agree to float32 rounding (as in the model zoo, docs/support.md).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from probes import StatisticsSubscriber, SubscriberManager, load_dump
from stats.test_parameters import assert_matches, reference as numpy_statistics  # numpy float64, rel 1e-12

LANE = os.environ.get("PROBES_LANE", "unknown")
VIEWS = {"same": lambda y: y, "select": lambda y: y[:, 0], "view": lambda y: y.view(-1)}


class Pair(torch.nn.Module):
    """Returns a tensor and ``view`` of it (the tensor itself for "same")."""

    def __init__(self, view: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4))
        self.view = view

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * self.weight
        return y, VIEWS[self.view](y)


def _change_and_use(base: torch.Tensor, alias: torch.Tensor, change: str) -> torch.Tensor:
    (base if change == "base" else alias).mul_(3.0)  # in place through one, then both used
    return (base * base).sum() + (alias * alias * alias).sum()


class Changes(torch.nn.Module):
    """Gets the pair as its inputs and changes one of them in place."""

    def __init__(self, change: str) -> None:
        super().__init__()
        self.change = change

    def forward(self, base: torch.Tensor, alias: torch.Tensor) -> torch.Tensor:
        return _change_and_use(base, alias, self.change)


class Model(torch.nn.Module):
    def __init__(self, view: str, change: str, where: str) -> None:
        super().__init__()
        self.pair, self.changes = Pair(view), Changes(change)
        self.change, self.where = change, where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, alias = self.pair(x)
        if self.where == "outputs":  # after the probe of pair's outputs
            return _change_and_use(base, alias, self.change)
        return self.changes(base, alias)  # after the probe of changes' inputs


def batch(step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(step))


def run(view: str, change: str, where: str, backend: str, out=None):
    """Two steps; the losses, the weight gradients of each, and the pair's tensors as an unprobed copy computes
    them (their values when returned, and their gradients) for the records."""
    torch.manual_seed(0)
    model = Model(view, change, where)
    manager = SubscriberManager()
    if out is not None:
        selection = {"modules": "pair"} if where == "outputs" else {"modules": "changes", "observe_inputs": True}
        manager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True, **selection)])
    runner = model
    if backend == "compile":
        torch._dynamo.reset()
        runner = torch.compile(model, backend="aot_eager", fullgraph=True)
    elif backend == "ort":
        from onnxruntime.training.ortmodule import ORTModule

        runner = ORTModule(model)
    losses, grads = [], []
    try:
        for step in range(2):
            loss = runner(batch(step))
            loss.backward()
            losses.append(loss.item())
            grads.append(model.pair.weight.grad.clone())
            model.zero_grad()
    finally:
        manager.unsubscribe()
    return losses, grads, model


def reference(model: Model, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pair's two tensors as returned, and the gradient of the first as returned (before the in-place change),
    from the unprobed model: its value as a leaf, then a copy that the model changes in place."""
    returned = model.pair(batch(step))[0].detach().requires_grad_(True)
    y = returned.clone()
    alias = VIEWS[model.pair.view](y)
    values = (returned.detach().clone(), alias.detach().clone())
    _change_and_use(y, alias, model.change).backward()
    return values[0], values[1], returned.grad


# Every case in eager mode; on the other backends "view" (read, as "select" is) is left out, to keep the suite short.
CASES = [pytest.param(view, change, where, backend, marks=[pytest.mark.ort] if backend == "ort" else [])
         for backend in ("eager", "compile", "ort") for where in ("outputs", "inputs") for view in VIEWS
         for change in ("base", "alias") if backend == "eager" or view != "view"]


@pytest.mark.parametrize("view,change,where,backend", CASES)
def test_a_change_through_one_alias_reaches_the_other_as_without_probes(view, change, where, backend, tmp_path):
    plain = run(view, change, where, backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probed_losses, probed_grads, model = run(view, change, where, backend, tmp_path / "out")
    if backend == "ort":
        torch.testing.assert_close(torch.tensor(probed_losses), torch.tensor(plain[0]), rtol=1e-6, atol=1e-7)
        for grad, probed in zip(plain[1], probed_grads):
            torch.testing.assert_close(probed, grad, rtol=1e-5, atol=1e-7)
    else:
        assert probed_losses == plain[0]
        for grad, probed in zip(plain[1], probed_grads):
            assert torch.equal(probed, grad)

    site = "pair.output" if where == "outputs" else "changes.input"
    refused = [str(w.message) for w in caught if "share memory" in str(w.message)]
    records = {(r["step"], r["phase"], r["name"]): r for r in load_dump(tmp_path / "out")}
    assert not refused
    for step in range(2):  # (no optimizer: the weights are those the model started with)
        base, alias, base_grad = reference(model, step)
        assert_matches(records[(step, "forward", f"{site}.0")], base)
        assert_matches(records[(step, "forward", f"{site}.1")], alias)
        if view != "same":  # views of one another: read (a forward record each), no gradient record on any backend
            assert not [key for key in records if key[1] == "backward" and key[2].startswith(site)], sorted(records)
            continue
        # One tensor, probed once: its gradient (all its uses) is recorded at its first place.
        record = records[(step, "backward", f"{site}.0")]
        if backend == "ort":
            expected = numpy_statistics(base_grad)
            assert {key: record[key] for key in expected} == pytest.approx(expected, rel=1e-6)
        else:
            assert_matches(record, base_grad)
        assert (step, "backward", f"{site}.1") not in records


def test_tensors_that_share_no_memory_are_probed_as_before(tmp_path):
    class Halves(torch.nn.Module):
        def forward(self, x):
            return x[:, :2].clone(), x[:, 2:] * 2  # no two outputs share memory

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Halves())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path, override_output_dir=True)]):
            first, second = model(batch(0))
            (first.sum() + second.square().sum()).backward()
    names = {(r["phase"], r["name"]) for r in load_dump(tmp_path)}
    assert {(phase, f"1.output.{i}") for phase in ("forward", "backward") for i in (0, 1)} <= names
