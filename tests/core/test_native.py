"""The C++ probe of eager calls (probes.core.native) against the Python TensorProbe: the same events with the same
tensors, the same gradients, and it does run where it should (its node is no Python Function's).

Each case trains the same model twice, ``PROBES_PROBE_BACKEND=cpp`` and ``=python``, and compares every event a
subscriber got (kind, step, phase, site, call, seq, the tensors' values) and every gradient, exactly; gradients also
against the model trained without probes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from probes import ProbeFailureWarning, SubscriberBase, SubscriberManager
from probes.core import native
from probes.core.functions import TensorProbe


class Everything(SubscriberBase):
    """Keeps every forward/backward event with copies of its tensors (None stays None)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []

    def on_event(self, event) -> None:
        if event.kind in ("forward", "backward"):
            values = tuple(None if t is None else (t.to_dense() if t.is_sparse else t).clone() for t in event.tensors)
            self.events.append((event.kind, event.step, event.phase, event.site.name, event.site.kind, event.call,
                                event.seq, event.forward_step, values))


class Pair(nn.Module):
    """Three outputs: one used downstream, one never used (its gradient is None), one that needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.other = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x)
        return y, self.other(x), y.detach() * 2


class Sparse(nn.Module):
    def forward(self, x):
        return x.to_sparse()


class Model(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.a, self.pair, self.b, self.c = nn.Linear(6, 6), Pair(), nn.Linear(6, 6), nn.Linear(6, 1)
        self.sparse = Sparse()

    def forward(self, x):
        h = self.a(x)
        h += 1  # in place on a probe's output
        y, _unused, frozen = self.pair(h)
        y = checkpoint(self.b, y, use_reentrant=self.reentrant)  # recomputed in backward
        y = self.sparse(y).to_dense()
        return self.c(torch.tanh(y) + frozen).sum()


def train(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    """A few steps with the cases probes must survive: a retained graph differentiated twice, a second-order
    gradient (create_graph), a step under no_grad."""
    torch.manual_seed(1)
    grads = []
    for step in range(steps):
        x = torch.randn(4, 6, requires_grad=step == 1)
        loss = model(x)
        if step == 0:
            loss.backward(retain_graph=True)
            loss.backward()
        elif step == 1 and not model.reentrant:  # (a reentrant checkpoint refuses autograd.grad)
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            (gx ** 2).sum().backward()
        else:
            loss.backward()
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad()
    with torch.no_grad():
        grads.append(model(torch.ones(2, 6)))
    return grads


def probed_run(monkeypatch, backend: str, reentrant: bool) -> tuple[list, list, list]:
    monkeypatch.setenv("PROBES_PROBE_BACKEND", backend)
    model, seen = Model(reentrant), Everything()
    node_names = []
    with SubscriberManager().subscribe(model, [seen]):  # a hook registered after the probes' sees what they return
        model.a.register_forward_hook(lambda module, args, output: node_names.append(
            (output.grad_fn.name(), isinstance(output.grad_fn, torch.autograd.function.BackwardCFunction)))
            if output.grad_fn is not None else None)
        grads = train(model)
    return seen.events, grads, node_names


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_cpp_probe_reports_and_trains_exactly_as_the_python_function(monkeypatch, reentrant):
    if native.probe_backend() != "cpp":
        pytest.skip("the C++ probe could not be built here (a RuntimeWarning said why)")
    events, grads, nodes = probed_run(monkeypatch, "cpp", reentrant)
    python_events, python_grads, python_nodes = probed_run(monkeypatch, "python", reentrant)
    # Each ran the Function it should: a C++ node against the Python Function's, both named as the Function.
    assert nodes and all(node == ("TensorProbeBackward", False) for node in nodes)
    assert python_nodes and all(node == ("TensorProbeBackward", True) for node in python_nodes)
    assert len(events) == len(python_events) > 0
    for ours, theirs in zip(events, python_events):
        assert same(ours, theirs), (ours[:8], theirs[:8])
    assert same(grads, python_grads)
    assert same(grads, train(Model(reentrant)))  # and as without probes
    kinds = {(e[0], e[3]) for e in events}
    assert ("backward", "b") in kinds and ("backward", "sparse") in kinds  # checkpointed and sparse sites reported
    pair_backward = [e for e in events if e[0] == "backward" and e[3] == "pair"]
    assert pair_backward and all(e[-1][1] is None and e[-1][2] is None for e in pair_backward)  # unused, frozen
    # The retained graph of step 0 differentiated twice: the second backward is its own call, of step 0's forward.
    assert len([e for e in events if e[0] == "backward" and e[3] == "c" and 0 in (e[1], e[7])]) == 2


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_a_functorch_transform_runs_as_without_probes(monkeypatch, backend):
    """torch runs no probe Function under a torch.func transform (neither has ``setup_context``): the call runs as
    without probes, with one warning, and stops nothing. No site is switched off: the eager steps around it are
    recorded in full, and the transformed call still counts as a step."""
    monkeypatch.setenv("PROBES_PROBE_BACKEND", backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(2, 3)
    expected = torch.func.grad(lambda x: model(x).sum())(x)
    subscriber = Everything()
    manager = SubscriberManager()
    with manager.subscribe(model, [subscriber]):
        model(x).sum().backward()
        recorded = len(subscriber.events)
        with pytest.warns(UserWarning, match="torch.func transform"):
            got = torch.func.grad(lambda x: model(x).sum())(x)
        assert len(subscriber.events) == recorded  # nothing observed inside the transform
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once; no ProbeFailureWarning either
            torch.func.vmap(lambda row: model(row))(x)
            model(x).sum().backward()
        assert manager.step == 4
    assert torch.equal(got, expected)
    assert len(subscriber.events) == 2 * recorded  # the eager step after it: every site, as the first


def test_a_tensor_subclass_passes_through_the_python_function(monkeypatch):
    """A subclass's ``detach`` may be its own (``__torch_function__``): the Python Function keeps it."""
    class Tagged(torch.Tensor):
        pass

    monkeypatch.setenv("PROBES_PROBE_BACKEND", "cpp")
    model, seen = nn.Sequential(nn.Identity()), Everything()
    outputs = []
    with SubscriberManager().subscribe(model, [seen]):
        model[0].register_forward_hook(lambda module, args, output: outputs.append(output))
        model(torch.randn(2, requires_grad=True).as_subclass(Tagged)).sum().backward()
    (out,) = outputs
    assert type(out) is Tagged and out.grad_fn._forward_cls is TensorProbe
    assert [(e[0], e[3]) for e in seen.events if e[3] == "0"] == [("forward", "0"), ("backward", "0")]


def test_the_backend_setting(monkeypatch):
    monkeypatch.setenv("PROBES_PROBE_BACKEND", " Python ")
    assert native.probe_backend() == "python"
    manager = SubscriberManager()
    model, outputs = nn.Sequential(nn.Linear(2, 2)), []
    with manager.subscribe(model, [Everything()]):
        model[0].register_forward_hook(lambda module, args, output: outputs.append(output))
        model(torch.randn(1, 2))
    assert outputs[0].grad_fn._forward_cls is TensorProbe  # the Python Function, as asked
    monkeypatch.setenv("PROBES_PROBE_BACKEND", "fortran")
    with pytest.raises(ValueError, match=r"PROBES_PROBE_BACKEND='fortran' is not one of \('auto', 'cpp', 'python'\)"):
        SubscriberManager().subscribe(nn.Linear(2, 2), [Everything()])


def test_a_failed_build_is_said_once_and_the_python_function_runs():
    def fails():
        raise RuntimeError("Error building extension 'probes_probe'\nmain.cpp:1: error: no compiler here")

    probe = native._native_probe(fails)
    with pytest.warns(RuntimeWarning, match=r"(?s)building the C\+\+ probe failed; eager probes use the Python "
                                            r"autograd Function.*main.cpp:1: error: no compiler here"):
        assert probe.load(required=False) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe.load(required=False) is None  # said once
    with pytest.raises(RuntimeError, match=r"(?s)PROBES_PROBE_BACKEND=cpp, but the C\+\+ probe could not be built.*"
                                           r"no compiler here"):
        probe.load(required=True)
