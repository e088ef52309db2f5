"""Probes inside torch.compile (probes.core.compiled): one graph, no break, no recompile, same records as eager.

Proof that the compiled graph ran the probes: dynamo's compile counter counts the frames it compiled,
and the graph-building calls (``post_forward_module_apply``) run only while dynamo traces, whereas
``"forward"``/``"backward"`` events keep arriving on every step. Runs on both lanes (torch 2.4.1 and 2.13.0).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import Recorder, gpt2_batch, same_values, tiny_gpt2, train_run
from probes import StatisticsSubscriber, SubscriberManager, inspect_activation, load_dump
from probes.compare import compare_dumps
from probes.models import TinyTransformer, TransformerConfig, make_batch
from probes.testing import assert_parity, parity  # noqa: F401  (the parity fixture)

OLD_DYNAMO = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 5)  # torch 2.4.1, the ort lane
CONFIG = TransformerConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64, vocab_size=64, seq_len=16)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


BUILDING_CALLS: list[str] = []


@torch.compiler.assume_constant_result  # (tests import torch._dynamo anyway)
def count_building_call(name: str) -> bool:
    # Run by dynamo while it traces and folded to a constant; state read from traced code would be a
    # guard (a counter attribute incremented in the hook would recompile every step).
    BUILDING_CALLS.append(name)
    return True


class Building(Recorder):
    """A Recorder that also counts its graph-building calls (module hooks: eager every step, compiled at trace)."""

    def post_forward_module_apply(self, site, module, args, outputs):
        count_building_call(site.name)
        return outputs


def step(model, seed, batch_size=4):
    batch = make_batch(CONFIG, batch_size=batch_size, seed=seed)
    loss = model(batch["tokens"], labels=batch["labels"])
    loss.backward()
    return loss


def test_the_slot_allocator_is_marked_as_torch_marks_a_constant_function():
    from exporters.adapters import torch_internals

    def ours():
        return 1

    def torchs():
        return 1

    torch.compiler.assume_constant_result(torchs)
    torch_internals.constant_while_tracing(ours)
    assert {k: v for k, v in vars(torchs).items()} == {k: v for k, v in vars(ours).items()} != {}


def test_a_subscribed_model_is_one_graph_without_breaks():
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    batch = make_batch(CONFIG, batch_size=2)
    plain = torch._dynamo.explain(model)(batch["tokens"], labels=batch["labels"])
    torch._dynamo.reset()
    with SubscriberManager().subscribe(model, [Recorder()]):
        probed = torch._dynamo.explain(model)(batch["tokens"], labels=batch["labels"])
    assert (plain.graph_count, plain.graph_break_count) == (1, 0)
    assert (probed.graph_count, probed.graph_break_count) == (1, 0), probed.break_reasons
    assert probed.op_count > plain.op_count  # the probes are in the graph


@pytest.mark.parametrize("order", ["subscribe-then-compile", "compile-then-subscribe", "module.compile()"])
def test_fullgraph_training_fires_every_probe_from_the_compiled_graph(order):
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    counter = CompileCounterWithBackend("inductor")
    recorder = Building()
    BUILDING_CALLS.clear()
    manager = SubscriberManager()
    if order == "subscribe-then-compile":
        manager.subscribe(model, [recorder])
        compiled = torch.compile(model, backend=counter, fullgraph=True)
    elif order == "compile-then-subscribe":
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        manager.subscribe(compiled, [recorder])  # the OptimizedModule: names as without it
    else:
        model.compile(backend=counter, fullgraph=True)  # in place: torch compiles the module's hooks too
        manager.subscribe(model, [recorder])
        compiled = model
    for index in range(4):
        step(compiled, index)
        assert recorder.step_ends == list(range(index + 1))  # closed when backward() returned
        if index == 0:
            traced_calls = len(BUILDING_CALLS)
    assert counter.frame_count == 1 and len(BUILDING_CALLS) == traced_calls
    called = [name or "<root>" for name, module in model.named_modules()
              if not isinstance(module, torch.nn.ModuleList)]  # a ModuleList is never called
    # The hooks ran while dynamo traced (torch 2.4's dynamo may restart a trace: some run twice), never after.
    assert set(BUILDING_CALLS) == set(called)
    for index in range(4):
        forward = recorder.names(index, "forward")
        assert sorted(forward) == sorted(f"{name}.output.0" for name in called) and forward[-1] == "<root>.output.0"
        assert sorted(recorder.names(index, "backward")) == sorted(forward)
    assert "blocks.0.attn.qkv.output.0" in recorder.names(3, "forward")
    manager.unsubscribe()


def test_probes_cause_no_recompile():
    def frames(subscribed: bool) -> list[int]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyTransformer(CONFIG)
        manager = SubscriberManager()
        if subscribed:
            manager.subscribe(model, [Recorder()])
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        counts = []
        for index in range(20):
            step(compiled, index, batch_size=4 if index < 10 else 6)  # a new batch size from step 10
            counts.append(counter.frame_count)
        manager.unsubscribe()
        return counts

    plain, probed = frames(False), frames(True)
    assert probed == plain and probed[9] == 1


def test_dynamic_shapes_compile_as_often_as_without_probes():
    def frames(subscribed: bool) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyTransformer(CONFIG)
        recorder = Recorder()
        if subscribed:
            SubscriberManager().subscribe(model, [recorder])
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
        for index, batch_size in enumerate((2, 3, 5, 7)):
            step(compiled, index, batch_size=batch_size)
        if subscribed:
            assert [c.shapes[0][0] for c in recorder.calls if c.name == "head.output.0"] == [2, 2, 3, 3, 5, 5, 7, 7]
        return counter.frame_count

    assert frames(True) == frames(False)


def test_subscribing_and_unsubscribing_cost_one_recompile_each():
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    step(compiled, 0)
    assert counter.frame_count == 1
    recorder = Recorder()
    manager = SubscriberManager()
    manager.subscribe(compiled, [recorder])
    for index in range(3):
        step(compiled, index)
    assert counter.frame_count == 2 and [c.step for c in recorder.calls][-1] == 2
    manager.unsubscribe()
    calls = len(recorder.calls)
    for index in range(3):
        step(compiled, index)
    assert counter.frame_count <= 3 and len(recorder.calls) == calls  # the probes are gone from the graph


def test_probes_do_not_change_compiled_training():
    def losses_and_grads(subscribed: bool, out):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyTransformer(CONFIG)
        manager = SubscriberManager()
        if subscribed:
            manager.subscribe(model, [StatisticsSubscriber(out)])
        compiled = torch.compile(model, fullgraph=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for index in range(3):
            optimizer.zero_grad()
            losses.append(step(compiled, index).item())
            optimizer.step()
        manager.unsubscribe()
        return losses, [p.grad.clone() for p in model.parameters()]

    plain_losses, plain_grads = losses_and_grads(False, None)
    probed_losses, probed_grads = losses_and_grads(True, pytest.importorskip("tempfile").mkdtemp())
    # The probes read their tensors and write nothing; the only freedom the compiler keeps is how it
    # fuses around a tensor a probe reads (materialised), which may move the last float bits.
    assert probed_losses == pytest.approx(plain_losses, rel=1e-6, abs=0)
    for plain, probed in zip(plain_grads, probed_grads):
        torch.testing.assert_close(probed, plain, rtol=1e-5, atol=1e-7)


def compiled_fullgraph(model):
    return torch.compile(model, fullgraph=True)


def test_eager_and_compiled_runs_compare_clean(tmp_path, parity):
    train_run(tmp_path / "eager", config=CONFIG, steps=3)
    train_run(tmp_path / "compiled", config=CONFIG, steps=3, wrap=compiled_fullgraph)
    report = parity(tmp_path / "eager", tmp_path / "compiled")
    assert report.matched > 0 and not report.only_in_base and not report.only_in_other
    assert {r["step"] for r in load_dump(tmp_path / "compiled")} == {0, 1, 2}


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_bug_only_in_the_compiled_run_is_its_first_divergence(tmp_path, phase):
    train_run(tmp_path / "eager", config=CONFIG, steps=4)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    train_run(tmp_path / "compiled", config=CONFIG, steps=4, bug=("blocks.1.mlp.0", 2, phase),
              wrap=lambda model: torch.compile(model, backend=counter, fullgraph=True))
    assert counter.frame_count == 1  # the bug's step is a tensor, not a guard: no recompile when it starts
    report = compare_dumps(tmp_path / "eager", tmp_path / "compiled")
    first = report.first_divergence
    assert first is not None and (first.step, first.phase) == (2, phase)
    assert first.name.startswith("blocks.1.mlp.0.output")
    with pytest.raises(AssertionError, match="first divergence"):
        assert_parity(tmp_path / "eager", tmp_path / "compiled")


class Inspected(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x):
        hidden = inspect_activation("hidden", torch.tanh(self.a(x)))
        return self.b(hidden)


def test_inspect_activation_inside_compiled_code(tmp_path):
    def run(out, compile_):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Inspected()
        counter = CompileCounterWithBackend("inductor")
        runner = torch.compile(model, backend=counter, fullgraph=True) if compile_ else model
        with SubscriberManager().subscribe(model, [StatisticsSubscriber(out)]):
            for index in range(3):
                runner(torch.randn(4, 8, generator=torch.Generator().manual_seed(index))).square().mean().backward()
        return counter.frame_count

    run(tmp_path / "eager", False)
    assert run(tmp_path / "compiled", True) == 1
    names = {(r["step"], r["phase"], r["name"]) for r in load_dump(tmp_path / "compiled")}
    assert {(s, p, "hidden") for s in range(3) for p in ("forward", "backward")} <= names
    assert_parity(tmp_path / "eager", tmp_path / "compiled")


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        self.second = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.second(torch.utils.checkpoint.checkpoint(self.first, x, use_reentrant=False))


@pytest.mark.skipif(OLD_DYNAMO, reason="torch 2.4's dynamo cannot compile torch.utils.checkpoint(..., "
                    "use_reentrant=False) (ArgsMismatchError: unexpected keyword argument 'use_reentrant', with or "
                    "without probes)")
def test_activation_checkpointing_inside_the_compiled_graph_records_like_eager():
    def calls(compile_):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Checkpointed()
        recorder = Recorder()
        counter = CompileCounterWithBackend("inductor")
        runner = torch.compile(model, backend=counter, fullgraph=True) if compile_ else model
        with SubscriberManager().subscribe(model, [recorder]):
            for index in range(3):
                runner(torch.randn(4, 8, generator=torch.Generator().manual_seed(index))).sum().backward()
        assert counter.frame_count == int(compile_) and recorder.step_ends == [0, 1, 2]
        return [(c.step, c.phase, c.name, c.shapes) for c in recorder.calls]

    eager = calls(False)
    assert calls(True) == eager and not [c for c in eager if c[1] == "recompute"]


def test_reduce_overhead_mode_on_the_cpu_records_like_eager(tmp_path):
    def run(out, mode):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Inspected()
        runner = torch.compile(model, mode=mode, fullgraph=True) if mode else model
        with SubscriberManager().subscribe(model, [StatisticsSubscriber(out)]):
            for index in range(3):
                runner(torch.randn(4, 8, generator=torch.Generator().manual_seed(index))).square().mean().backward()

    run(tmp_path / "eager", None)
    run(tmp_path / "compiled", "reduce-overhead")
    assert_parity(tmp_path / "eager", tmp_path / "compiled")


def test_evaluation_under_no_grad_and_gradient_accumulation():
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    recorder = Recorder()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with SubscriberManager().subscribe(model, [recorder]):
        step(compiled, 0)
        step(compiled, 1)  # accumulation: two forward/backward pairs, two steps
        with torch.no_grad():
            batch = make_batch(CONFIG, batch_size=4, seed=2)
            compiled(batch["tokens"], labels=batch["labels"])
        step(compiled, 3)
    assert recorder.step_ends == [0, 1, 2, 3]
    assert not recorder.names(2, "backward") and recorder.names(2, "forward") == recorder.names(3, "forward")
    assert sorted(recorder.names(3, "backward")) == sorted(recorder.names(3, "forward"))


class Halting(torch.nn.Module):
    """Breaks the graph inside its forward: dynamo compiles what comes before and after as graphs of their own
    and runs this module's call (its hooks too) eagerly, as with a Hugging Face model on torch 2.4."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        torch._dynamo.graph_break()
        return torch.tanh(y)


class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.mid, self.b = torch.nn.Linear(8, 8), Halting(), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(self.mid(self.a(x))).square().mean()


def _broken_steps(runner, case):
    def x(seed):
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))

    losses = []
    for index in range(2):
        if case == "graph breaks":
            loss = runner(x(index))
            loss.backward()
        elif case == "two forwards, one backward":  # both compiled calls wait for their backward at once
            loss = runner(x(index)) + runner(x(index + 10))
            loss.backward()
        else:  # "retained graph": the same compiled calls differentiated twice
            loss = runner(x(index))
            loss.backward(retain_graph=True)
            loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("case,backend", [("graph breaks", "aot_eager"), ("two forwards, one backward", "aot_eager"),
                                          ("retained graph", "aot_eager"), ("two forwards, one backward", "inductor"),
                                          ("retained graph", "inductor")])
def test_compiled_calls_waiting_for_their_backward_together_train_as_without_probes(case, backend):
    # Each compiled call's backward changes the probes' backward token, which AOT autograd saved; torch 2.4
    # checks the version of what it saved, so a token shared by calls waiting for their backward together
    # raised "modified by an inplace operation" (the torch 2.4 + Hugging Face failure).
    def run(compile_, probed):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Broken()
        recorder = Recorder()
        counter = CompileCounterWithBackend(backend)
        runner = torch.compile(model, backend=counter) if compile_ else model
        manager = SubscriberManager()
        if probed:
            manager.subscribe(model, [recorder])
        try:
            losses = _broken_steps(runner, case)
        finally:
            manager.unsubscribe()
        calls = sorted((c.step, c.phase, c.name, c.shapes) for c in recorder.calls)
        return losses, [p.grad.clone() for p in model.parameters()], counter.frame_count, calls

    try:
        plain = run(True, False)
    except Exception as error:  # the compiler cannot do this without probes either: not ours to prove
        pytest.skip(f"{backend} fails on {case!r} without probes: {type(error).__name__}: {str(error)[:150]}")
    probed = run(True, True)
    if backend == "aot_eager":  # the same program but for the probe ops
        assert probed[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(probed[1], plain[1]))
    else:  # inductor may fuse around the opaque probe ops otherwise
        assert probed[0] == pytest.approx(plain[0], rel=1e-6)
        for a, b in zip(probed[1], plain[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # The module that breaks the graph runs eagerly, its hooks too: no graph of their own. One more graph at
    # most, holding the root's probes after the break (docs/compile.md).
    assert probed[2] <= plain[2] + 1, (probed[2], plain[2])
    assert probed[3] == run(False, True)[3]  # the records of eager PyTorch


def gpt2_loss(model, seed):
    # The loss outside the model: transformers' own loss path logs a warning dynamo cannot trace
    # (a graph break that is transformers', with or without probes).
    tokens = gpt2_batch(seed)["input_ids"]
    logits = model(input_ids=tokens).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.slow
def test_hugging_face_gpt2_eager_and_compiled_compare_clean(tmp_path, parity):
    # On torch 2.4 too: dynamo can type the None fields of the ModelOutputs the probes flatten (no graph break),
    # and each compiled call has its own backward token.
    def run(out, compile_):
        torch._dynamo.reset()
        model = tiny_gpt2()
        counter = CompileCounterWithBackend("inductor")
        runner = torch.compile(model, backend=counter, fullgraph=True) if compile_ else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with SubscriberManager().subscribe(runner, [StatisticsSubscriber(out)]):
            for index in range(3):
                optimizer.zero_grad()
                gpt2_loss(runner, index).backward()
                optimizer.step()
        return counter.frame_count

    run(tmp_path / "eager", False)
    assert run(tmp_path / "compiled", True) == 1
    report = parity(tmp_path / "eager", tmp_path / "compiled")
    assert report.matched > 100


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _loss(runner, seed):
    # A loss whose gradients depend on the input: a backward paired with the wrong forward reports other values.
    return runner(torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))).square().mean()


def _two_forwards_one_backward(runner, seed):
    (_loss(runner, seed) + _loss(runner, seed + 100)).backward()  # autograd runs the second call's backward first


def _two_forwards_two_backwards(runner, seed):
    first, second = _loss(runner, seed), _loss(runner, seed + 100)
    first.backward()
    second.backward()


def _step(runner, seed):
    _loss(runner, seed).backward()


def _accumulated(runner, seed):
    for micro in range(2):
        _loss(runner, seed + 100 * micro).backward()


def _retained(runner, seed):
    loss = _loss(runner, seed)
    loss.backward(retain_graph=True)
    loss.backward()


PAIRINGS = {"two forwards, one backward": _two_forwards_one_backward,
            "two forwards, two backwards": _two_forwards_two_backwards, "steps": _step,
            "gradient accumulation": _accumulated, "retained graph": _retained}


@pytest.mark.parametrize("model_class,case,every_n_steps,backend", [
    *((Small, case, n, "aot_eager") for case in PAIRINGS for n in (1, 2, 3)),
    # Graph breaks: each forward is several compiled calls, each with its own backward.
    *((Broken, case, 1, "aot_eager") for case in ("two forwards, one backward", "gradient accumulation",
                                                  "retained graph")),
    # Inductor hands the backward op the token AOT autograd saved, not a copy of it.
    (Small, "two forwards, one backward", 1, "inductor")])
def test_a_compiled_backward_reports_to_the_forward_it_differentiates(tmp_path, model_class, case, every_n_steps,
                                                                     backend):
    """Each backward's records are those eager makes (names and call numbers, phases, statistics): when one backward
    covers two compiled calls, autograd runs the later call's backward first, and a backward paired with its forward
    by probe alone took the other call's event (the gradient of call #1 recorded as call #0's, and the reverse)."""
    def run(out, compile_):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = model_class()
        counter = CompileCounterWithBackend(backend)
        runner = torch.compile(model, backend=counter, fullgraph=model_class is Small) if compile_ else model
        with SubscriberManager().subscribe(model, [StatisticsSubscriber(out, every_n_steps=every_n_steps)]):
            for seed in range(3):
                PAIRINGS[case](runner, seed)
        # The compiled graphs ran the probes: one graph, or several around the break (their number is dynamo's).
        assert (counter.frame_count == 1 if model_class is Small else counter.frame_count >= 2) if compile_ \
            else counter.frame_count == 0
        return load_dump(out)

    eager, compiled = run(tmp_path / "eager", False), run(tmp_path / "compiled", True)
    assert [(r["step"], r["phase"], r["name"]) for r in compiled] == [(r["step"], r["phase"], r["name"]) for r in eager]
    if every_n_steps == 1:
        assert {r["phase"] for r in eager} == {"forward", "backward"}
        if case.startswith("two forwards"):  # the first call's backward is a new call of each module: #1
            assert any("#1." in r["name"] and r["phase"] == "backward" for r in eager)
    else:  # left-out steps between the recorded ones
        assert eager and {r["step"] % every_n_steps for r in eager} == {0}
    assert_parity(tmp_path / "eager", tmp_path / "compiled")
    if backend == "inductor":  # it may fuse around the opaque probe ops: the last float bits may move
        return
    assert all(same_values(a, b) for a, b in zip(compiled, eager)), [
        (a["step"], a["name"], k) for a, b in zip(compiled, eager) for k in a if not same_values(a[k], b[k])][:5]


def test_the_events_of_a_compiled_call_whose_graph_is_freed_are_forgotten():
    """A forward whose backward never comes (a loss evaluated with gradients on, then dropped) leaves no event
    behind once its graph is freed; a call whose graph lives keeps its events for its backward."""
    from probes.core.compiled import OPS

    torch.manual_seed(0)
    model = Small()
    recorder = Recorder()
    runner = torch.compile(model, backend="aot_eager", fullgraph=True)
    with SubscriberManager().subscribe(model, [recorder]):
        kept = _loss(runner, 0)
        before = set(OPS._waiting)  # the kept call's, and those of earlier tests' graphs still alive
        for seed in range(1, 20):
            _loss(runner, seed)  # dropped at once: its graph, and the call's token with it, are freed
        assert len(set(OPS._waiting) - before) == 1  # the last call's: its token is held until the next call
        kept.backward()
    # Step 0's forward, differentiated in step 19: a second call of each module there, as in eager.
    assert recorder.names(19, "backward") == ["<root>#1.output.0", "b#1.output.0", "a#1.output.0"]
    assert recorder.step_ends == list(range(20))


class _Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        # A float tensor that needs no gradient, returned beside one that does (drawn from x, not from a random
        # generator, which inductor has of its own: the values are compared with eager's).
        noise = torch.sigmoid(x * 3)
        return torch.tanh(self.lin(x)) * noise, noise


class _Aux(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh(h), h.square()  # the second needs a gradient and never gets one (nothing uses it)


class Ungraded(torch.nn.Module):
    """Outputs that get no gradient, at the root and below it: ``noise`` needs none, ``aux`` is never used, the
    root returns (loss, logits, noise), logits used by the loss in some steps only."""

    def __init__(self):
        super().__init__()
        self.noisy, self.aux, self.head = _Noisy(), _Aux(), torch.nn.Linear(8, 4)

    def forward(self, x):
        h, noise = self.noisy(x)
        h, _ = self.aux(h)
        logits = self.head(h)
        return logits.square().mean(), logits, noise


def _ungraded_run(out, backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Ungraded()
    counter = CompileCounterWithBackend(backend) if backend else None
    runner = torch.compile(model, backend=counter, fullgraph=True) if backend else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = SubscriberManager()
    if out is not None:
        manager.subscribe(model, [StatisticsSubscriber(out)])
    losses = []
    for index in range(3):
        optimizer.zero_grad()
        loss, logits, _ = runner(torch.randn(6, 8, generator=torch.Generator().manual_seed(index)))
        (loss + logits.sum() * 0.01 if index == 1 else loss).backward()  # logits get a gradient in step 1 only
        losses.append(loss.item())
        optimizer.step()
    manager.unsubscribe()
    assert counter is None or counter.frame_count == 1  # one graph, no break
    return losses, [p.grad.clone() for p in model.parameters()], (load_dump(out) if out is not None else None)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_outputs_that_get_no_gradient_train_and_record_as_in_eager_mode(tmp_path, backend):
    """A module output that needs no gradient (as a drawn noise) or gets none (unused; the root's logits in some
    steps): torch 2.4 + inductor failed the compiled backward with probes ("incorrect subclass metadata") where
    the root returned a tensor that needs no gradient. Training is the same as without probes; the records are
    eager's, and, where a tensor that needs a gradient gets none in a step, one zero gradient record more
    (a traced autograd Function materialises the gradients that never arrive: docs/compile.md)."""
    plain_losses, plain_grads, _ = _ungraded_run(None, backend)
    losses, grads, compiled = _ungraded_run(tmp_path / "compiled", backend)
    if backend == "aot_eager":
        assert losses == plain_losses
        assert all(torch.equal(probed, plain) for probed, plain in zip(grads, plain_grads))
    else:  # as test_probes_do_not_change_compiled_training: inductor may fuse around what a probe reads
        assert losses == pytest.approx(plain_losses, rel=1e-6, abs=0)
        for probed, plain in zip(grads, plain_grads):
            torch.testing.assert_close(probed, plain, rtol=1e-5, atol=1e-7)
    *_, eager = _ungraded_run(tmp_path / "eager", None)
    keys = {(r["step"], r["phase"], r["name"]) for r in eager}
    assert {(step, "forward", name) for step in range(3)
            for name in ("noisy.output.1", "<root>.output.1", "<root>.output.2")} <= keys
    assert not any(phase == "backward" and name.endswith(("noisy.output.1", "<root>.output.2", "aux.output.1"))
                   for _, phase, name in keys)  # noise needs no gradient, aux gets none
    assert {step for step, phase, name in keys if (phase, name) == ("backward", "<root>.output.1")} == {1}
    ungraded = {(step, "backward", "aux.output.1") for step in range(3)} | {
        (step, "backward", "<root>.output.1") for step in (0, 2)}
    by_key = {(r["step"], r["phase"], r["name"]): r for r in compiled}
    assert set(by_key) == keys | ungraded
    assert all(by_key[key]["norm"] == 0 for key in ungraded)
    for record in eager:
        other = by_key[(record["step"], record["phase"], record["name"])]
        if backend == "aot_eager":
            assert same_values(other["norm"], record["norm"]), record["name"]
        else:
            assert other["norm"] == pytest.approx(record["norm"], rel=1e-5, abs=1e-7), record["name"]
