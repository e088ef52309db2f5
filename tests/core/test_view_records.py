"""Every floating-point tensor a module returns has a forward record, views of one another included (key/value views
of one projection, a pooled token of a sequence, transposed logits), on eager, torch.compile and ORTModule; the
tensors beside them keep their gradient records; training is bit-identical with and without probes. Op records
read what a left-out call made (a view, a random draw) when a recorded operation reads it, and compare names that
call when it is what differs.

The views themselves get no gradient record on any backend (``probes.core.aliases``): the record set is the same
everywhere.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

from helpers import OrtWitness, Recorder
from probes import StatisticsSubscriber, SubscriberManager, load_dump
from probes.compare import compare_dumps, format_report
from probes.core.functions import can_probe
from probes.utils.tree import TensorLeaves

OLD_DYNAMO = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 6)
D, T = 8, 6
BACKENDS = ["eager", "compile", pytest.param("ort", marks=pytest.mark.ort)]


class KeyValue(torch.nn.Module):
    """A hidden state beside a key and a value, two views of one projection (GPT-2's legacy cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.kv = torch.nn.Linear(D, D), torch.nn.Linear(D, 2 * D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        key, value = self.kv(x).split(D, dim=-1)
        return self.fc(x) + key * value, (key, value)


class Pool(torch.nn.Module):
    """A sequence and its first token, a view of it (DINOv2's pooler output): every output in one group."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sequence = self.norm(h)
        return sequence, sequence[:, 0]


class Net(torch.nn.Module):
    """Returns its loss beside logits and their transpose (CLIP's logits_per_image/per_text)."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.pool, self.head = KeyValue(), Pool(), torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, (key, value) = self.block(x)
        sequence, pooled = self.pool(h + value)
        logits = self.head(pooled) @ sequence.mean(1).t()
        return (logits.square().mean() + key.abs().mean()), logits, logits.t()


def batch(step: int) -> torch.Tensor:
    return torch.randn(3, T, D, generator=torch.Generator().manual_seed(step))


def runner_for(model: torch.nn.Module, backend: str, fullgraph: bool = True) -> torch.nn.Module:
    if backend == "compile":
        torch._dynamo.reset()
        return torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    if backend == "ort":
        from onnxruntime.training.ortmodule import ORTModule

        return ORTModule(model)
    return model


def train(backend: str, out=None, steps: int = 2, **selection):
    """Losses and every parameter's gradient of each step (SGD on), with probes when ``out`` is given."""
    torch.manual_seed(0)
    model = Net()
    subscribers = [StatisticsSubscriber(out, override_output_dir=True, **selection), witness := OrtWitness()] \
        if out is not None else []
    manager = SubscriberManager()
    if subscribers:
        manager.subscribe(model, subscribers)
    runner = runner_for(model, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    try:
        for step in range(steps):
            loss = runner(batch(step))[0]
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
    finally:
        manager.unsubscribe()
    if backend == "ort" and subscribers:
        assert witness.by_ort > 0  # the probes ran inside ORT's graph
    return losses, grads


def floating_outputs(model: torch.nn.Module, call) -> dict[str, list[int]]:
    """From plain forward hooks, without probes: each module's output record indices that hold a floating-point
    tensor (the leaves a probe passes, in its order)."""
    found: dict[str, list[int]] = {}
    names = {module: name or "<root>" for name, module in model.named_modules()}

    def hook(module, args, output):
        tensors = TensorLeaves.of(output, select=lambda leaf: isinstance(leaf, torch.Tensor) and can_probe(leaf)).tensors
        floating = [i for i, tensor in enumerate(tensors) if tensor.is_floating_point()]
        if floating:
            found.setdefault(names[module], floating)

    handles = [module.register_forward_hook(hook) for module in model.modules()]
    try:
        call()
    finally:
        for handle in handles:
            handle.remove()
    return found


def assert_every_output_recorded(expected: dict[str, list[int]], out) -> None:
    forward = {r["name"] for r in load_dump(out) if r["phase"] == "forward" and r["step"] == 0}
    missing = [f"{name}.output.{i}" for name, places in expected.items() for i in places
               if f"{name}.output.{i}" not in forward]
    assert not missing, missing


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_of_one_another_and_the_tensors_beside_them_are_recorded_and_training_unchanged(backend, tmp_path):
    plain = train(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning about a missing record (nor any other)
        probed = train(backend, tmp_path / backend)
    for a, b in zip(plain[0] + sum(plain[1], []), probed[0] + sum(probed[1], [])):
        assert torch.equal(a, b)  # bit-identical on this backend, views and all
    torch.manual_seed(0)
    model = Net()
    expected = floating_outputs(model, lambda: model(batch(0)))
    assert expected["block"] == [0, 1, 2] and expected["pool"] == [0, 1] and expected["<root>"] == [0, 1, 2]
    assert_every_output_recorded(expected, tmp_path / backend)
    records = {(r["step"], r["phase"], r["name"]) for r in load_dump(tmp_path / backend)}
    # Beside the views: gradient records as usual. The views: none, on every backend.
    for step in range(2):
        assert {(step, "backward", name) for name in ("block.output.0", "block.fc.output.0", "<root>.output.0")} <= records
        assert not {(step, "backward", name) for name in ("block.output.1", "block.output.2", "pool.output.0",
                                                           "pool.output.1", "<root>.output.1", "<root>.output.2")} & records


@pytest.mark.parametrize("backend", ["compile", pytest.param("ort", marks=pytest.mark.ort)])
def test_the_records_equal_eagers_on_every_backend(backend, tmp_path):
    train("eager", tmp_path / "eager")
    train(backend, tmp_path / backend)
    report = compare_dumps(tmp_path / "eager", tmp_path / backend)
    assert report.agrees and not report.only_in_base and not report.only_in_other, format_report(report)
    names = {r["name"] for r in load_dump(tmp_path / "eager")}
    assert names == {r["name"] for r in load_dump(tmp_path / backend)}
    if backend == "compile":  # the same operations in float32: the views' records equal eager's exactly
        values = {(r["step"], r["phase"], r["name"]): r["norm"] for r in load_dump(tmp_path / "compile")}
        for r in load_dump(tmp_path / "eager"):
            if r["name"].startswith("pool.output"):
                assert values[(r["step"], r["phase"], r["name"])] == r["norm"]


def test_compiled_fullgraph_one_graph_no_break(tmp_path):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    counter = CompileCounterWithBackend("aot_eager")
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path, override_output_dir=True)]):
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        for step in range(2):
            compiled(batch(step))[0].backward()
    assert counter.frame_count == 1
    torch._dynamo.reset()


def gpt2(use_cache: bool = True) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=use_cache,
                                     attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config)


def gpt2_tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt2_with_its_cache_has_every_output_recorded_and_trains_unchanged(backend, tmp_path):
    """GPT-2 with ``use_cache=True``: on transformers 4.x each block and attention returns its key and value, views
    of one projection, beside the residual stream."""
    model = gpt2()
    expected = floating_outputs(model, lambda: model(gpt2_tokens(0), labels=gpt2_tokens(0)))
    assert {"<root>", "transformer", "transformer.h.0", "transformer.h.0.attn", "lm_head"} <= set(expected)

    def run(out=None):
        model = gpt2()
        manager = SubscriberManager()
        if out is not None:
            manager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True), witness := OrtWitness()])
        runner = runner_for(model, backend, fullgraph=False)
        losses = []
        try:
            for step in range(2):
                loss = runner(gpt2_tokens(step), labels=gpt2_tokens(step)).loss
                loss.backward()
                losses.append(loss.detach().clone())
                losses.extend(p.grad.clone() for p in model.parameters())
                model.zero_grad()
        finally:
            manager.unsubscribe()
        if out is not None and backend == "ort":
            assert witness.by_ort > 0
        return losses

    plain = run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probed = run(tmp_path / "out")
    assert not [str(w.message) for w in caught if "no record" in str(w.message) or "share memory" in str(w.message)]
    assert all(torch.equal(a, b) for a, b in zip(plain, probed))
    assert_every_output_recorded(expected, tmp_path / "out")
    backward = {r["name"] for r in load_dump(tmp_path / "out") if r["phase"] == "backward"}
    assert {"transformer.h.0.output.0", "transformer.h.1.attn.output.0", "transformer.output.0"} <= backward


# Op records: what a left-out call made, read where a recorded operation reads it ------------------------------


class Attention(torch.nn.Module):
    """Keys read through a window (a view) and scores jittered by a random draw. ``bug``: on the backend only (while
    it traces), the window starts one token later (an off-by-one view), as a mis-lowered strided view would."""

    def __init__(self, backend: str = "eager", bug: bool = False, draw: bool = True) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.buggy = (torch.compiler.is_compiling if backend == "compile" else torch.jit.is_tracing) if bug else None
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = 1 if self.buggy is not None and self.buggy() else 0
        keys = self.k(x)[:, start:start + T - 1]  # getitem:0 (a view)
        scores = torch.einsum("btd,bsd->bts", self.q(x), keys)  # einsum:0 reads getitem:0
        if self.draw:
            scores = scores * torch.rand(scores.shape)  # rand:0, then mul:0 reads it
        return scores.softmax(-1) @ keys


def op_model(backend: str = "eager", bug: bool = False, draw: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Attention(backend, bug, draw), torch.nn.Linear(D, D))


def train_ops(model, runner, out=None, steps: int = 2):
    """Losses and gradients, and the RNG state after the run (a probe must not move the random stream)."""
    manager = SubscriberManager()
    if out is not None:
        manager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True, ops="0")])
    torch.manual_seed(1)
    results = []
    try:
        for step in range(steps):
            loss = runner(batch(step)).square().mean()
            loss.backward()
            results += [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
    finally:
        manager.unsubscribe()
    return results, torch.get_rng_state()


def test_an_operation_reading_a_view_or_a_draw_names_its_record_and_training_and_the_draws_are_unchanged(tmp_path):
    model = op_model()
    plain, plain_rng = train_ops(model, model)
    model = op_model()
    probed, probed_rng = train_ops(model, model, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(plain, probed)) and torch.equal(plain_rng, probed_rng)
    records = {r["name"]: r for r in load_dump(tmp_path) if r["phase"] == "forward" and r["step"] == 0}
    ops = [name for name in records if name.startswith("0/")]
    assert ops == ["0/linear:0.output.0", "0/getitem:0.output.0", "0/linear:1.output.0", "0/einsum:0.output.0",
                   "0/rand:0.output.0", "0/mul:0.output.0", "0/softmax:0.output.0", "0/matmul:0.output.0"]
    assert records["0/getitem:0.output.0"]["inputs"] == ["0.k.output.0"]
    assert records["0/einsum:0.output.0"]["inputs"] == ["0.q.output.0", "0/getitem:0.output.0"]
    assert records["0/rand:0.output.0"]["inputs"] == []
    assert records["0/mul:0.output.0"]["inputs"] == ["0/einsum:0.output.0", "0/rand:0.output.0"]
    assert records["0/matmul:0.output.0"]["inputs"] == ["0/softmax:0.output.0", "0/getitem:0.output.0"]
    # Read records: forward only (the tensors they read are the model's, untouched); the operations keep theirs.
    backward = {r["name"] for r in load_dump(tmp_path) if r["phase"] == "backward"}
    assert "0/einsum:0.output.0" in backward and not {"0/getitem:0.output.0", "0/rand:0.output.0"} & backward
    # The values: the window of the keys and the draw, as the model made them (uniform on [0, 1)).
    x = batch(0)
    keys = op_model().get_submodule("0").k(x)[:, :T - 1].detach()
    assert records["0/getitem:0.output.0"]["norm"] == pytest.approx(keys.double().norm().item(), rel=1e-6)
    assert 0.0 <= records["0/rand:0.output.0"]["min"] and records["0/rand:0.output.0"]["max"] < 1.0


def compiled_ops_skip(backend: str):
    return pytest.mark.skipif(backend == "compile" and OLD_DYNAMO,
                              reason="op records under torch.compile need torch >= 2.6 (the ort lane has 2.4)")


@pytest.mark.parametrize("backend", [pytest.param("compile", marks=compiled_ops_skip("compile")),
                                     pytest.param("ort", marks=pytest.mark.ort)])
def test_a_view_that_differs_on_the_backend_is_the_first_diverging_operation_local(backend, tmp_path):
    model = op_model(draw=False)
    train_ops(model, model, tmp_path / "eager")
    model = op_model(backend, bug=False, draw=False)
    clean = train_ops(model, runner_for(model, backend, fullgraph=True), tmp_path / "clean")[0]
    report = compare_dumps(tmp_path / "eager", tmp_path / "clean")
    assert report.agrees and not report.only_in_base and not report.only_in_other, format_report(report)
    assert {r["name"] for r in load_dump(tmp_path / "clean")} == {r["name"] for r in load_dump(tmp_path / "eager")}
    model = op_model(backend, bug=True, draw=False)
    train_ops(model, runner_for(model, backend, fullgraph=True), tmp_path / "bug")
    report = compare_dumps(tmp_path / "eager", tmp_path / "bug")
    first = report.first_operation
    assert first is not None and first.name == "0/getitem:0.output.0", format_report(report)
    assert first.cause == "local", format_report(report)
    assert clean is not None


def ort_draw(tmp_path):
    """Eager against ORTModule, which draws from its own generator: the report."""
    model = op_model()
    train_ops(model, model, tmp_path / "eager")
    model = op_model("ort")
    train_ops(model, runner_for(model, "ort"), tmp_path / "ort")
    assert {r["name"] for r in load_dump(tmp_path / "ort")} == {r["name"] for r in load_dump(tmp_path / "eager")}
    return compare_dumps(tmp_path / "eager", tmp_path / "ort")


@pytest.mark.ort
def test_ortmodules_own_random_draw_is_the_first_diverging_operation(tmp_path):
    report = ort_draw(tmp_path)
    first = report.first_operation
    assert first is not None and first.name == "0/rand:0.output.0", format_report(report)


@pytest.mark.ort
def test_ortmodules_own_random_draw_is_local(tmp_path):
    first = ort_draw(tmp_path).first_operation
    assert first is not None and first.cause == "local", first
    assert "reads no tensor" in first.explained()
