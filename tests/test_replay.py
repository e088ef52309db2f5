"""Replaying one module on its captured call (probes.replay): eager against compiled and ORTModule, op by op."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from probes import StatisticsSubscriber, SubscriberManager, load_dump
from probes.replay import ModuleCapture, ReplayError, replay_module

OLD_DYNAMO = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 6)
D = 8


class Attention(torch.nn.Module):
    """An attention with a bug where ``buggy_when()`` says so (a bug of one backend only): its softmax in bfloat16
    (``bug="softmax"``), or its mask filled with -1 instead of -1e4 (``bug="mask"``)."""

    def __init__(self, buggy_when=lambda: False, bug: str = "softmax") -> None:
        super().__init__()
        self.q = torch.nn.Linear(D, D)
        self.k = torch.nn.Linear(D, D)
        self.buggy_when, self.bug = buggy_when, bug

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float = 1.0) -> torch.Tensor:
        scores = torch.einsum("bd,cd->bc", self.q(x), self.k(x)) * (scale / math.sqrt(D))
        if mask is not None:
            scores = scores.masked_fill(mask, -1.0 if self.bug == "mask" and self.buggy_when() else -1e4)
        if self.bug == "softmax" and self.buggy_when():
            weights = torch.softmax(scores, -1, dtype=torch.bfloat16).float()
        else:
            weights = torch.softmax(scores, -1)
        return weights @ x + x


class Model(torch.nn.Module):
    def __init__(self, buggy_when=lambda: False, bug: str = "softmax") -> None:
        super().__init__()
        self.embed = torch.nn.Linear(D, D)
        self.attn = Attention(buggy_when, bug)
        self.head = torch.nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.attn(h, h[:, :4] > 1.0, scale=2.0))


def captured(tmp_path, step=1, buggy_when=lambda: False, bug="softmax"):
    torch.manual_seed(0)
    model, x = Model(buggy_when, bug), torch.randn(4, D)
    plain = copy.deepcopy(model)
    capture = ModuleCapture(tmp_path / "capture", module="attn", step=step)
    losses = []
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / "eager"), capture]):
        for _ in range(3):
            loss = model(x).pow(2).sum()
            loss.backward()
            losses.append(loss.detach())
    for loss in losses:  # training is the same with the capture on
        expected = plain(x).pow(2).sum()
        expected.backward()
        assert torch.equal(loss, expected.detach())
    return model


def test_the_capture_holds_the_call_parameters_outputs_and_gradients_without_pickle(tmp_path):
    model = captured(tmp_path)
    where = tmp_path / "capture" / "step_000001" / "attn"
    meta = json.loads((where / "capture.json").read_text())
    assert meta["structure"]["args"] == {"list": [{"tensor": "leaf/0"}, {"tensor": "leaf/1"}]}
    assert meta["structure"]["kwargs"] == {"dict": {"scale": 2.0}}
    with np.load(where / "tensors.npz", allow_pickle=False) as archive:
        assert archive["leaf/1"].dtype == np.bool_ and archive["grads/0"].shape == (4, D)
        assert {"state/q.weight", "state/k.bias", "outputs/0"} <= set(archive.files)
    # A module replayed eagerly against eager: identical records.
    report = replay_module(tmp_path / "capture", model.attn, backend="eager")
    assert report.agrees and report.first_divergence is None
    names = {r["name"] for r in load_dump(report.base)}
    assert {"module/einsum:0.output.0", "module/softmax:0.output.0", "module.q.output.0"} <= names


@pytest.mark.skipif(OLD_DYNAMO, reason="op records under torch.compile need torch >= 2.6 (the ort lane has 2.4)")
def test_a_bug_of_the_compiled_module_alone_is_named_at_its_operation(tmp_path):
    model = captured(tmp_path, buggy_when=torch.compiler.is_compiling)
    clean = replay_module(tmp_path / "capture", Attention(), backend="compile")
    assert clean.agrees, clean.first_divergence
    report = replay_module(tmp_path / "capture", model.attn, backend="compile")
    assert not report.agrees
    assert report.first_divergence.name == "module/softmax:0.output.0"
    assert report.first_divergence.phase == "forward"


@pytest.mark.ort
def test_a_bug_of_the_module_under_ortmodule_alone_is_named_at_its_operation(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    # ORTModule's export traces the module: the bug is in its graph only (ORT has no bfloat16 SoftmaxGrad on CPU).
    model = captured(tmp_path, buggy_when=torch.jit.is_tracing, bug="mask")
    clean = replay_module(tmp_path / "capture", Attention(), backend="ort")
    assert clean.agrees, clean.first_divergence
    report = replay_module(tmp_path / "capture", model.attn, backend="ort")
    assert report.first_divergence is not None
    assert report.first_divergence.name == "module/masked_fill:0.output.0"


def test_bfloat16_tensors_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    with SubscriberManager().subscribe(model, [ModuleCapture(tmp_path / "capture", module="attn", step=0)]):
        model(torch.randn(4, D, dtype=torch.bfloat16)).float().sum().backward()
    report = replay_module(tmp_path / "capture", model.attn, backend="eager")
    assert report.agrees and any(r["dtype"] == "bfloat16" for r in load_dump(report.base))


class Cache:
    pass


class Child(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        return self.inner(x)


class Parent(torch.nn.Module):
    def __init__(self, child_name: str = "child", cache: bool = True) -> None:
        super().__init__()
        self.child_name, self.cache = child_name, cache
        self.add_module(child_name, Child())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.child_name)(x, Cache() if self.cache else None)


def test_a_call_the_capture_cannot_store_warns_and_training_goes_on(tmp_path):
    model = Parent()
    with SubscriberManager().subscribe(model, [ModuleCapture(tmp_path / "capture", module="child", step=0)]):
        with pytest.warns(UserWarning, match=r"cannot store the call of 'child' in step 0: args\[1\] is a Cache"):
            model(torch.randn(2, D)).sum().backward()
    assert not (tmp_path / "capture").exists()


def test_replay_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(ReplayError, match="no capture found"):
        replay_module(tmp_path, torch.nn.Linear(2, 2))
    model = captured(tmp_path)
    with pytest.raises(ReplayError, match="not the captured module's kind"):
        replay_module(tmp_path / "capture", torch.nn.Linear(D, D), backend="eager")
    with pytest.raises(ValueError, match="backend must be one of eager, compile, ort"):
        replay_module(tmp_path / "capture", model.attn, backend="jax")
    (tmp_path / "capture" / "step_000001" / "attn" / "capture.json").write_text("{")
    with pytest.raises(ReplayError, match="unreadable"):
        replay_module(tmp_path / "capture", model.attn)


def test_module_names_never_escape_the_capture_directory(tmp_path):
    model = Parent("/etc/escape", cache=False)  # torch forbids only "." in a module name
    with SubscriberManager().subscribe(model, [ModuleCapture(tmp_path / "capture", module="/etc/escape", step=0)]):
        model(torch.randn(2, D)).sum().backward()
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert files and all(tmp_path / "capture" in path.parents for path in files)
