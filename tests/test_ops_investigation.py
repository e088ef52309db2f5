"""docs/ops.md's worked investigation, as a test: a bug in one operation inside an attention module, only on one
backend, found by drilling down: module records name the attention, op records the operation (local, not carried
in), and replaying the module alone on its captured call shows it is the module's own.

Eager against torch.compile (torch >= 2.6) and eager against ORTModule (the ort lane), with three bugs: a softmax
in lower precision, a mask filled with another value, a transposed einsum. ORT's CPU kernels have no bfloat16
softmax gradient, so ORTModule gets the other two.
"""

from __future__ import annotations

import math

import pytest
import torch

from probes import SubscriberManager, StatisticsSubscriber
from probes.compare import compare_dumps, format_report
from probes.replay import ModuleCapture, replay_module

OLD_DYNAMO = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 6)
D, T = 16, 8
FIRST_OP = {"softmax": "softmax:0", "mask": "masked_fill:0", "einsum": "einsum:0"}


class Attention(torch.nn.Module):
    def __init__(self, bug: str | None = None, backend: str = "compile") -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(D, D) for _ in range(3))
        self.bug = bug
        # Where the bug runs: the compiled graph (dynamo traces), or ORT's graph (ORTModule's export traces).
        self.buggy = torch.compiler.is_compiling if backend == "compile" else torch.jit.is_tracing

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bug = self.bug if self.buggy() else None
        pattern = "btd,bsd->bst" if bug == "einsum" else "btd,bsd->bts"
        scores = torch.einsum(pattern, self.q(x), self.k(x)) / math.sqrt(D)
        scores = scores.masked_fill(mask, -1.0 if bug == "mask" else -1e4)
        if bug == "softmax":
            weights = torch.softmax(scores, -1, dtype=torch.bfloat16).float()
        else:
            weights = torch.softmax(scores, -1)
        return weights @ self.v(x)


class Net(torch.nn.Module):
    def __init__(self, bug: str | None = None, backend: str = "compile") -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, D)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"attn": Attention(bug if i == 0 else None, backend),
                                                               "mlp": torch.nn.Linear(D, D)}) for i in range(2))
        self.head = torch.nn.Linear(D, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        for layer in self.layers:
            h = h + layer["attn"](h, mask)
            h = h + torch.relu(layer["mlp"](h))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


def train(out, *, backend: str | None = None, bug: str | None = None, capture=None, **options) -> None:
    torch.manual_seed(0)
    model = Net(bug, backend or "compile")
    runner = model
    if backend == "compile":
        runner = torch.compile(model, backend="aot_eager")
    elif backend == "ort":
        from onnxruntime.training.ortmodule import ORTModule
        runner = ORTModule(model)
    subscribers = [StatisticsSubscriber(out, override_output_dir=True, **options)] + ([capture] if capture else [])
    with SubscriberManager().subscribe(model, subscribers):
        for step in range(2):
            tokens = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(step))
            runner(tokens).backward()


def walk(tmp_path, backend: str, bug: str) -> None:
    # 1. Module records: the first divergence is the first attention.
    train(tmp_path / "eager")
    train(tmp_path / "other", backend=backend, bug=bug)
    report = compare_dumps(tmp_path / "eager", tmp_path / "other")
    assert report.first_divergence.name.startswith("layers.0.attn"), format_report(report)
    # The same runs without the bug agree (both sides of the test).
    train(tmp_path / "clean", backend=backend)
    assert compare_dumps(tmp_path / "eager", tmp_path / "clean").agrees
    # 2. Op records: the operation, and that the error is made there.
    capture = ModuleCapture(tmp_path / "capture", module="layers.0.attn", step=0)
    train(tmp_path / "eager_ops", ops="layers.0.attn", steps=[0], capture=capture)
    train(tmp_path / "other_ops", backend=backend, bug=bug, ops="layers.0.attn", steps=[0])
    report = compare_dumps(tmp_path / "eager_ops", tmp_path / "other_ops")
    first = report.first_operation
    assert first is not None and first.name == f"layers.0.attn/{FIRST_OP[bug]}.output.0", format_report(report)
    assert first.cause == "local", format_report(report)
    # 3. Replay: the module alone on its captured call, eagerly and on the backend.
    assert capture.captured
    replayed = replay_module(tmp_path / "capture", Attention(bug, backend), backend=backend)
    assert replayed.first_divergence.name == f"module/{FIRST_OP[bug]}.output.0", format_report(replayed)
    assert replay_module(tmp_path / "capture", Attention(None, backend), backend=backend).agrees


@pytest.mark.skipif(OLD_DYNAMO, reason="op records under torch.compile need torch >= 2.6 (the ort lane has 2.4)")
@pytest.mark.parametrize("bug", ["softmax", "mask", "einsum"])
def test_a_bug_only_in_the_compiled_graph_is_named_at_its_operation(tmp_path, bug):
    torch._dynamo.reset()
    walk(tmp_path, "compile", bug)
    torch._dynamo.reset()


@pytest.mark.ort
@pytest.mark.parametrize("bug", ["mask", "einsum"])
def test_a_bug_only_in_ortmodules_graph_is_named_at_its_operation(tmp_path, bug, monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    walk(tmp_path, "ort", bug)
