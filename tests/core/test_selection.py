"""Recording only what is selected: steps (every_n_steps, steps), sites (modules, exclude_modules), phases.

The expected records are computed here from ``model.named_modules()`` and plain string tests, not with
probes' own matching, and checked against real dumps of real models (TinyTransformer, nn.Sequential).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import Recorder, hook_count
from probes import (AnomalyError, AnomalySentinel, StatisticsSubscriber, SubscriberBase, SubscriberManager,
                    inspect_activation, load_dump)
from probes.core.selection import Selection
from probes.core.steps import StepTracker
from probes.models import TinyTransformer, TransformerConfig, make_batch

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)


def called_modules(model: nn.Module) -> dict[str, str]:
    """Qualified name -> class name of every module that runs in a forward (a ModuleList never does)."""
    return {name or "<root>": type(module).__name__ for name, module in model.named_modules()
            if not isinstance(module, nn.ModuleList)}


def train(model: nn.Module, steps: int) -> list[torch.Tensor]:
    losses = []
    for step in range(steps):
        if isinstance(model, TinyTransformer) or isinstance(getattr(model, "_orig_mod", None), TinyTransformer):
            batch = make_batch(CONFIG, batch_size=4, seed=step)
            loss = model(batch["tokens"], labels=batch["labels"])
        else:
            torch.manual_seed(100 + step)
            loss = model(torch.randn(3, 6)).square().mean()
        loss.backward()
        losses.append(loss.detach())
    return losses


def transformer() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CONFIG)


def sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def dumped(tmp_path, make_model, train_steps: int, **selection) -> set[tuple[int, str, str]]:
    """(step, phase, name) of every record a StatisticsSubscriber with ``selection`` dumps."""
    model = make_model()
    out = tmp_path / "dump"
    manager = SubscriberManager()
    with manager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True, **selection)]):
        train(model, train_steps)
        assert manager.step == train_steps  # left-out steps still count
    return {(r["step"], r["phase"], r["name"]) for r in load_dump(out)}


def expected(model: nn.Module, steps, wanted_module, phases=("forward", "backward")) -> set[tuple[int, str, str]]:
    names = [f"{name}.output.0" for name, cls in called_modules(model).items() if wanted_module(name, cls)]
    return {(step, phase, name) for step in steps for phase in phases for name in names}


# Steps ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("selection, steps", [
    ({"every_n_steps": 3}, [0, 3, 6]),
    ({"every_n_steps": 3, "start_step": 1}, [1, 4]),
    ({"every_n_steps": 2, "start_step": 1, "end_step": 5}, [1, 3]),
    ({"steps": [5, 1, 1]}, [1, 5]),
    ({"steps": range(0, 100, 4), "end_step": 6}, [0, 4]),
    ({"steps": {2, 6}, "start_step": 3}, [6]),
])
def test_step_selection_records_exactly_the_chosen_steps(tmp_path, selection, steps):
    records = dumped(tmp_path, transformer, 7, **selection)
    assert records == expected(transformer(), steps, lambda name, cls: True)


def test_left_out_steps_get_no_call_and_keep_their_numbers():
    model = transformer()
    recorder = Recorder(every_n_steps=3, start_step=1)
    manager = SubscriberManager()
    with manager.subscribe(model, [recorder]):
        train(model, 7)
        assert manager.step == 7
    assert {c.step for c in recorder.calls} == {1, 4}
    assert recorder.step_ends == [1, 4]  # no "step_end" for a left-out step either


def test_a_left_out_step_runs_its_modules_without_probes():
    """Eager: a step no observer records gets no probe Function at all (its cost is the hooks' check), while
    the step boundary still numbers it; losses and gradients equal those without probes."""
    model, plain = sequential(), sequential()
    recorder = Recorder(every_n_steps=2)
    manager = SubscriberManager()
    seen: list[str] = []
    with manager.subscribe(model, [recorder]):  # a hook registered after the probes' sees what they return
        model[2].register_forward_hook(lambda module, args, output: seen.append(output.grad_fn.name()))
        losses = train(model, 5)
        assert manager.step == 5
    assert seen == ["TensorProbeBackward", "AddmmBackward0"] * 2 + ["TensorProbeBackward"]
    assert {c.step for c in recorder.calls} == {0, 2, 4} and recorder.step_ends == [0, 2, 4]
    assert all(torch.equal(a, b) for a, b in zip(losses, train(plain, 5)))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


def test_positional_start_and_end_still_work(tmp_path):
    model = transformer()
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / "d", 1, 3, True)]):
        train(model, 4)
    assert {r["step"] for r in load_dump(tmp_path / "d")} == {1, 2}


# Sites ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("selection, wanted", [
    ({"modules": "blocks.0.*"}, lambda n, c: n.startswith("blocks.0.")),
    ({"modules": "blocks.0"}, lambda n, c: n == "blocks.0"),  # a pattern does not select the children
    ({"modules": ["blocks.*.attn", "head"]}, lambda n, c: n in ("blocks.0.attn", "blocks.1.attn", "head")),
    ({"modules": r"re:blocks\.\d+\.attn\.(qkv|proj)"}, lambda n, c: re.fullmatch(r"blocks\.\d\.attn\.(qkv|proj)", n)),
    ({"modules": "Linear"}, lambda n, c: c == "Linear"),
    ({"modules": ["LayerNorm", "<root>"]}, lambda n, c: c == "LayerNorm" or n == "<root>"),
    ({"exclude_modules": "Dropout"}, lambda n, c: c != "Dropout"),
    ({"exclude_modules": ["re:.*norm.*", "<root>"]}, lambda n, c: "norm" not in n and n != "<root>"),
    ({"modules": "blocks.*", "exclude_modules": ["Linear", "*.mlp.*"]},
     lambda n, c: n.startswith("blocks.") and c != "Linear" and ".mlp." not in n),
])
def test_module_selection_on_a_transformer(tmp_path, selection, wanted):
    records = dumped(tmp_path, transformer, 2, **selection)
    want = expected(transformer(), [0, 1], wanted)
    assert records == want and records


@pytest.mark.parametrize("selection, wanted", [
    ({"modules": "Linear"}, {"0", "2", "4"}),
    ({"modules": "re:[0-9]", "exclude_modules": "Tanh"}, {"0", "1", "2", "4"}),
    ({"exclude_modules": ["re:ReLU|Tanh"]}, {"<root>", "0", "2", "4"}),
])
def test_module_selection_on_a_sequential(tmp_path, selection, wanted):
    records = dumped(tmp_path, sequential, 2, **selection)
    assert records == expected(sequential(), [0, 1], lambda n, c: n in wanted)


@pytest.mark.parametrize("phases", ["forward", "backward", ["backward", "forward"]])
def test_phase_selection(tmp_path, phases):
    chosen = (phases,) if isinstance(phases, str) else tuple(phases)
    records = dumped(tmp_path, transformer, 2, phases=phases, modules="blocks.1.*")
    assert records == expected(transformer(), [0, 1], lambda n, c: n.startswith("blocks.1."), chosen)


def test_everything_combined(tmp_path):
    records = dumped(tmp_path, transformer, 7, every_n_steps=2, start_step=1, modules="Linear",
                     exclude_modules="head", phases="backward")
    assert records == expected(transformer(), [1, 3, 5], lambda n, c: c == "Linear" and n != "head", ("backward",))


def test_left_out_sites_get_no_probe_and_no_hook():
    model = sequential()
    before = hook_count(model)
    recorder = Recorder(modules=["0", "4"])
    with SubscriberManager().subscribe(model, [recorder]):
        # the root (its two calls and the step boundary) and a forward hook on each selected module: output probes need
        # no pre-hook
        assert hook_count(model) - before == 2 + 2
        train(model, 1)
        assert {c.name for c in recorder.calls} == {"0.output.0", "4.output.0"}
        out = model[1](model[0](torch.randn(2, 6)))
        assert type(out.grad_fn).__name__ == "ReluBackward0"  # ReLU's output went through no probe
    assert hook_count(model) == before


def test_a_subscriber_that_builds_the_graph_keeps_every_hook():
    class Builder(SubscriberBase):
        def post_forward_module_apply(self, site, module, args, outputs):
            self.seen.add(site.name)
            return outputs

    model = sequential()
    builder = Builder()
    builder.seen = set()
    recorder = Recorder(modules="0")
    with SubscriberManager().subscribe(model, [builder, recorder]):
        train(model, 1)
    assert builder.seen == set(called_modules(model))
    assert {c.name for c in recorder.calls} == {"0.output.0"}


class Inspecting(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        hidden = inspect_activation("hidden", self.linear(x))
        return inspect_activation("scores.relu", hidden.relu())


def test_inspect_sites_match_by_their_name():
    torch.manual_seed(0)
    model = Inspecting()
    recorder = Recorder(modules="scores.*", exclude_modules="Linear")
    with SubscriberManager().subscribe(model, [recorder]):
        model(torch.randn(2, 6)).sum().backward()
    assert sorted({c.name for c in recorder.calls}) == ["scores.relu"]


def test_two_subscribers_with_different_selections(tmp_path):
    model = transformer()
    first, second = Recorder(modules="head", phases="forward"), Recorder(every_n_steps=2, modules="embed")
    with SubscriberManager().subscribe(model, [first, second]):
        train(model, 3)
    assert {(c.step, c.phase, c.name) for c in first.calls} == {(s, "forward", "head.output.0") for s in range(3)}
    assert {(c.step, c.phase, c.name) for c in second.calls} == {
        (s, p, "embed.output.0") for s in (0, 2) for p in ("forward", "backward")}


# Probes never change training -----------------------------------------------------------------------


@pytest.mark.parametrize("make_model", [transformer, sequential])
def test_loss_and_gradients_are_bit_identical_with_and_without_selection(tmp_path, make_model):
    def run(subscribers):
        model = make_model()
        manager = SubscriberManager()
        if subscribers:
            manager.subscribe(model, subscribers)
        losses = train(model, 4)
        manager.unsubscribe()
        return losses, [p.grad.clone() for p in model.parameters()]

    plain = run([])
    selections = [dict(every_n_steps=2, modules="Linear"), dict(exclude_modules="re:.*", phases="forward"),
                  dict(steps=[3], phases="backward", modules="<root>")]
    for index, selection in enumerate(selections):
        losses, grads = run([StatisticsSubscriber(tmp_path / str(index), **selection)])
        assert all(torch.equal(a, b) for a, b in zip(losses, plain[0]))
        assert all(torch.equal(a, b) for a, b in zip(grads, plain[1]))


# The sentinel checks what is recorded ---------------------------------------------------------------


class NanAt(nn.Module):
    """Sequential-like: the output of module ``1`` (ReLU) is nan from step ``step`` on."""

    def __init__(self, step: int):
        super().__init__()
        self.net = sequential()
        self.calls, self.step = 0, step
        self.net[1].register_forward_hook(self._poison)

    def _poison(self, module, args, output):
        return output * float("nan") if self.calls >= self.step else output

    def forward(self, x):
        out = self.net(x)
        self.calls += 1
        return out


@pytest.mark.parametrize("make", [
    lambda path, **kw: StatisticsSubscriber(path, on_anomaly="raise", **kw),
    lambda path, **kw: AnomalySentinel(action="raise", **kw),
])
def test_the_sentinel_checks_only_selected_records(tmp_path, make):
    # The nan of net.1's output reaches the gradients of net.0..net.3 (not of net.4, whose gradient is the loss's).
    cases = [({"modules": "net.0", "phases": "forward"}, False), ({"phases": "backward", "modules": "net.4"}, False),
             ({"modules": "net.1", "every_n_steps": 3}, True), ({"modules": "ReLU"}, True)]
    for index, (selection, raises) in enumerate(cases):
        model = NanAt(step=1)
        with SubscriberManager().subscribe(model, [make(tmp_path / str(index), **selection)]):
            try:
                for _ in range(4):
                    model(torch.randn(3, 6)).sum().backward()
                raised = None
            except AnomalyError as error:
                raised = error
        assert (raised is not None) == raises, selection
        if raised is not None:
            assert raised.anomaly.module == "net.1"
            assert raised.anomaly.step == (3 if "every_n_steps" in selection else 1)


# Bad arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"every_n_steps": 2, "steps": [1]}, r"either every_n_steps .* or steps .*, not both"),
    ({"every_n_steps": 0}, r"every_n_steps .* must be a positive int, got 0"),
    ({"every_n_steps": 1.5}, r"every_n_steps .* must be a positive int, got 1.5"),
    ({"steps": [1, -2]}, r"every entry of steps .* must be a non-negative int, got -2"),
    ({"steps": []}, r"steps is empty.*pass None to record every step"),
    ({"steps": "12"}, r"steps must be an iterable of step numbers .* or None"),
    ({"modules": "re:blocks.(["}, r"modules pattern 're:blocks.\(\[' is not a valid regular expression.*fix the regex"),
    ({"exclude_modules": ["ok", "re:*x"]}, r"exclude_modules pattern 're:\*x' is not a valid regular expression"),
    ({"modules": []}, r"modules is empty; pass None to select every module"),
    ({"modules": ["a", 3]}, r"modules patterns must be non-empty strings .* got 3"),
    ({"modules": 3}, r"modules must be a pattern string, a list of them or None"),
    ({"phases": "recompute"}, r"phases must be one of 'forward', 'backward', 'grad', 'param', 'optim', a list of them, or None \(all\), got 'recompute'"),
    ({"phases": []}, r"phases must be one of 'forward', 'backward'"),
    ({"start_step": 4, "end_step": 2}, r"start_step \(4\) must not be greater than end_step \(2\)"),
])
def test_bad_arguments_say_what_is_wrong(tmp_path, kwargs, message):
    for make in (lambda: StatisticsSubscriber(tmp_path / "x", override_output_dir=True, **kwargs),
                 lambda: AnomalySentinel(**kwargs), lambda: SubscriberBase(**kwargs)):
        with pytest.raises(ValueError, match=message):
            make()


def test_the_selection_object():
    selection = Selection.of(2, 20, every_n_steps=5, modules=["blocks.*", "re:head|embed"], phases="forward")
    assert [s for s in range(30) if selection.wants_step(s)] == [2, 7, 12, 17]
    assert selection.wants_phase("forward") and selection.wants_phase("recompute")
    assert not selection.wants_phase("backward")
    assert selection.wants_names("head", "Linear") and not selection.wants_names("heads", "Linear")
    assert selection.wants_names("blocks.0", "Block") and not selection.wants_names("blocks", "ModuleList")
    assert Selection() == Selection.of() and all(Selection().wants_step(s) for s in (0, 10**9))


# torch.compile: a step cadence is decided per call, never by a recompile -------------------------------


def test_every_n_steps_under_torch_compile_without_recompiles():
    torch._dynamo.reset()
    try:
        eager_model, compiled_inner = transformer(), transformer()
        selection = dict(every_n_steps=2, modules="blocks.*.attn*", phases="forward")
        eager, compiled_rec = Recorder(**selection), Recorder(**selection)
        counter = CompileCounterWithBackend("aot_eager")
        with SubscriberManager().subscribe(eager_model, [eager]), \
                SubscriberManager().subscribe(compiled_inner, [compiled_rec]):
            compiled = torch.compile(compiled_inner, backend=counter, fullgraph=True)
            train(eager_model, 5)
            counts = []
            for step in range(5):
                batch = make_batch(CONFIG, batch_size=4, seed=step)
                compiled(batch["tokens"], labels=batch["labels"]).backward()
                counts.append(counter.frame_count)
        assert counts == [1] * 5  # one compile, no recompile when a step is skipped or recorded
        keys = lambda rec: sorted((c.step, c.phase, c.name) for c in rec.calls)  # noqa: E731
        assert keys(compiled_rec) == keys(eager)
        assert {c.step for c in compiled_rec.calls} == {0, 2, 4}
        assert {c.name for c in compiled_rec.calls} == {
            f"blocks.{i}.attn{part}.output.0" for i in range(2) for part in ("", ".qkv", ".proj", ".dropout")}
    finally:
        torch._dynamo.reset()


def test_a_left_out_compiled_step_makes_no_event_and_its_probes_still_run(monkeypatch):
    """In a step no subscriber records, the compiled graph's probe ops run (they decide per step, no recompile) but
    stop at the step check: no site, no event for a backward to report to; recorded steps as before."""
    torch._dynamo.reset()
    try:
        model, eager_model = transformer(), transformer()
        recorder, eager = Recorder(steps=[1]), Recorder(steps=[1])
        calls = {"left out": [], "forward": []}
        left_out, forward = StepTracker.compiled_left_out, StepTracker.compiled_forward

        def counting_left_out(self):
            calls["left out"].append(left_out(self))
            return calls["left out"][-1]

        def counting_forward(self, *args, **kwargs):
            event = forward(self, *args, **kwargs)
            calls["forward"].append(self.state.open_step)
            return event

        monkeypatch.setattr(StepTracker, "compiled_left_out", counting_left_out)
        monkeypatch.setattr(StepTracker, "compiled_forward", counting_forward)
        counter = CompileCounterWithBackend("aot_eager")
        with SubscriberManager().subscribe(model, [recorder]), SubscriberManager().subscribe(eager_model, [eager]):
            train(torch.compile(model, backend=counter, fullgraph=True), 3)
            train(eager_model, 3)
        assert counter.frame_count == 1
        probes = len(calls["forward"])  # the forward probes of the recorded step, made by the graph's ops
        assert probes and set(calls["forward"]) == {1}
        # Steps 0 and 2: every forward probe op asked once and stopped; step 1: asked once each, went on.
        assert calls["left out"] == [True] * probes + [False] * probes + [True] * probes
        keys = lambda rec: sorted((c.step, c.phase, c.name) for c in rec.calls)  # noqa: E731
        assert keys(recorder) == keys(eager) and {c.step for c in recorder.calls} == {1}
        assert recorder.step_ends == eager.step_ends == [1]
    finally:
        torch._dynamo.reset()


def test_a_left_out_compiled_forward_differentiated_in_a_recorded_step_is_not_recorded_as_in_eager():
    """The forward of a left-out step makes no event: differentiated later, in a recorded step, it records nothing
    (eager inserted no probe in it), and the recorded forward after it keeps its own backward."""
    torch._dynamo.reset()

    def run(compile_):
        model = transformer()
        recorder = Recorder(steps=[1])
        runner = torch.compile(model, backend="aot_eager", fullgraph=True) if compile_ else model
        with SubscriberManager().subscribe(model, [recorder]):
            losses = []
            for step in range(2):  # step 0 (left out), then step 1 (recorded) before any backward
                batch = make_batch(CONFIG, batch_size=4, seed=step)
                losses.append(runner(batch["tokens"], labels=batch["labels"]))
            losses[0].backward()  # inside recorded step 1: step 0's forward had no probe in eager
            losses[1].backward()  # a backward-only step 2, left out
        return recorder, [p.grad.clone() for p in model.parameters()]

    try:
        (eager, eager_grads), (compiled, compiled_grads) = run(False), run(True)
        keys = lambda rec: sorted((c.step, c.phase, c.name) for c in rec.calls)  # noqa: E731
        assert keys(compiled) == keys(eager)
        assert {(c.step, c.phase) for c in compiled.calls} == {(1, "forward")}
        assert compiled.step_ends == eager.step_ends == [1]
        assert all(torch.equal(a, b) for a, b in zip(compiled_grads, eager_grads))
    finally:
        torch._dynamo.reset()


def test_a_compiled_submodule_in_an_eager_model_is_not_recompiled_by_left_out_steps():
    """Eager left-out steps skip the hooks of their modules with a flag that dynamo must never guard on: a
    submodule compiled on its own, inside an eager model, keeps one compiled graph across recorded and left-out
    steps, and records what the same eager model records."""
    torch._dynamo.reset()
    try:
        eager_model, mixed = transformer(), transformer()
        counter = CompileCounterWithBackend("aot_eager")
        mixed.blocks[1] = torch.compile(mixed.blocks[1], backend=counter, fullgraph=True)
        eager, recorder = Recorder(every_n_steps=2), Recorder(every_n_steps=2)
        with SubscriberManager().subscribe(eager_model, [eager]), SubscriberManager().subscribe(mixed, [recorder]):
            train(eager_model, 4)
            train(mixed, 4)
        assert counter.frame_count == 1
        keys = lambda rec: sorted((c.step, c.phase, c.name) for c in rec.calls)  # noqa: E731
        assert keys(recorder) == keys(eager) and {c.step for c in recorder.calls} == {0, 2}
    finally:
        torch._dynamo.reset()


# ORTModule: the probes stay in the graph, the Python call decides; one export -------------------------


class ExportCounter(SubscriberBase):
    """Counts graph-building calls: under ORTModule the module hooks run only while ORT exports."""

    def __init__(self):
        super().__init__()
        self.building_calls = 0

    def post_forward_module_apply(self, site, module, args, outputs):
        self.building_calls += 1
        return outputs


@pytest.mark.ort
@pytest.mark.slow
def test_ortmodule_records_the_same_selection_as_eager_with_one_export(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    from onnxruntime.training.ortmodule import ORTModule

    selection = dict(every_n_steps=2, modules=["blocks.1.*", "head"], exclude_modules="Dropout", phases="backward")
    eager_model = transformer()
    ort_inner = copy.deepcopy(eager_model)
    with SubscriberManager().subscribe(eager_model, [StatisticsSubscriber(tmp_path / "eager", **selection)]):
        eager_losses = train(eager_model, 5)
    counter = ExportCounter()
    recorder = Recorder(**selection)
    with SubscriberManager().subscribe(ort_inner, [StatisticsSubscriber(tmp_path / "ort", **selection), counter,
                                                   recorder]):
        ort_model = ORTModule(ort_inner)
        ort_losses = []
        for step in range(5):
            batch = make_batch(CONFIG, batch_size=4, seed=step)
            loss = ort_model(batch["tokens"], labels=batch["labels"])
            loss.backward()
            ort_losses.append(loss.detach())
            if step == 0:
                exported = counter.building_calls
    assert exported > 0 and counter.building_calls == exported, "ORTModule exported the model again"
    assert recorder.calls and all(call.by_ort for call in recorder.calls), "a probe call did not come from ORT"
    assert torch.allclose(torch.stack(ort_losses), torch.stack(eager_losses), rtol=1e-5)
    keys = {label: {(r["step"], r["phase"], r["name"]) for r in load_dump(tmp_path / label)} for label in ("eager", "ort")}
    want = expected(eager_model, [0, 2, 4], lambda n, c: (n.startswith("blocks.1.") or n == "head") and c != "Dropout",
                    ("backward",))
    assert keys["ort"] == keys["eager"] == want
