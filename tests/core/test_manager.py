"""SubscriberManager in eager PyTorch: hooks, names, the step counter, structures, removal, errors."""

from __future__ import annotations

import inspect
import collections
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from exporters.handles import Handle
from helpers import Recorder, Square, hook_count
from probes import GlobalSubscriberManager, ProbeFailureWarning, ProbeSite, SubscriberBase, SubscriberManager, inspect_activation
from probes.core.steps import StepTracker
from probes.models import TinyTransformer, TransformerConfig, make_batch

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)


def train_steps(model, count, seed=0):
    losses = []
    for step in range(count):
        batch = make_batch(CONFIG, batch_size=4, seed=seed + step)
        loss = model(batch["tokens"], labels=batch["labels"])
        loss.backward()
        losses.append(loss.detach())
    return losses


def test_recorder_sees_every_module_output_in_execution_order():
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    recorder = Recorder()
    manager = SubscriberManager()
    with manager.subscribe(model, [recorder]):
        train_steps(model, 1)
    forward = recorder.names(0, "forward")
    # Every module that runs reports its output once, children before parents (post-forward order).
    expected_modules = {name or "<root>" for name, _ in model.named_modules()} - {"blocks"}  # ModuleList never runs
    assert {n.rsplit(".output.", 1)[0] for n in forward} == expected_modules
    assert forward.index("blocks.0.attn.qkv.output.0") < forward.index("blocks.0.attn.output.0")
    assert forward[-1] == "<root>.output.0"
    # Backward visits the same records in reverse dependency order; the root's gradient comes first.
    backward = recorder.names(0, "backward")
    assert backward[0] == "<root>.output.0"
    assert sorted(backward) == sorted(forward)
    seqs = [c.seq for c in recorder.calls if c.step == 0]
    assert seqs == list(range(len(seqs)))


def test_step_counter_counts_training_steps_and_closes_steps():
    model = TinyTransformer(CONFIG)
    recorder = Recorder()
    manager = SubscriberManager()
    manager.subscribe(model, [recorder])
    train_steps(model, 3)
    assert manager.step == 3
    assert recorder.step_ends == [0, 1, 2]  # each step closed when its backward returned
    manager.unsubscribe()
    assert recorder.step_ends == [0, 1, 2] and recorder.closed
    assert {c.step for c in recorder.calls} == {0, 1, 2}


def test_start_and_end_step_limit_per_step_calls():
    model = TinyTransformer(CONFIG)
    recorder = Recorder(start_step=1, end_step=3)
    with SubscriberManager().subscribe(model, [recorder]):
        train_steps(model, 4)
    assert {c.step for c in recorder.calls} == {1, 2}
    assert recorder.step_ends == [1, 2]


def test_tracing_does_not_count_as_a_step():
    model = TinyTransformer(CONFIG)
    recorder = Recorder()
    manager = SubscriberManager()
    with manager.subscribe(model, [recorder]):
        batch = make_batch(CONFIG, batch_size=2)
        torch.jit.trace(model, (batch["tokens"],), check_trace=False)
        assert manager.step == 0 and recorder.calls == []
        train_steps(model, 1)
        assert manager.step == 1


def test_probes_do_not_change_loss_or_gradients_bit_for_bit():
    torch.manual_seed(0)
    probed = TinyTransformer(CONFIG)
    plain = copy.deepcopy(probed)
    observer = Recorder(observe_inputs=True)
    with SubscriberManager().subscribe(probed, [observer]):
        for step in range(3):
            batch = make_batch(CONFIG, batch_size=4, seed=step)
            for model in (probed, plain):
                model.zero_grad()
                loss = model(batch["tokens"], labels=batch["labels"])
                loss.backward()
            assert torch.equal(probed(batch["tokens"], labels=batch["labels"]),
                               plain(batch["tokens"], labels=batch["labels"]))
            for (name, a), (_, b) in zip(probed.named_parameters(), plain.named_parameters()):
                assert torch.equal(a.grad, b.grad), name
    assert observer.calls


class SiteRecorder(Recorder):
    """A Recorder that also keeps the site of every forward call."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[ProbeSite] = []

    def on_event(self, event):
        if event.kind == "forward":
            self.sites.append(event.site)
        super().on_event(event)


def test_a_deep_copy_of_a_probed_model_reports_to_the_same_subscription():
    # ORTModule deep-copies the model, hooks included, before it exports: the copy's probes must reach
    # the live subscription, whose manager, tracker and sites the copy shares instead of copying them.
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    recorder = SiteRecorder()
    manager = SubscriberManager()
    with manager.subscribe(model, [recorder]):
        memo: dict = {}
        twin = copy.deepcopy(model, memo)
        copied = [value for key, value in memo.items() if key != id(memo)]
        assert not [value for value in copied if isinstance(value, (SubscriberManager, StepTracker, ProbeSite))]
        assert hook_count(twin) == hook_count(model)
        original_losses = train_steps(model, 1)
        twin_losses = train_steps(twin, 1)
        assert manager.step == 2 and recorder.step_ends == [0, 1]
        assert recorder.names(1, "forward") == recorder.names(0, "forward")
        assert recorder.names(1, "backward") == recorder.names(0, "backward")
        half = len(recorder.sites) // 2
        assert all(a is b for a, b in zip(recorder.sites[:half], recorder.sites[half:]))
        assert set(map(id, recorder.sites)) <= set(map(id, manager.sites))
        assert torch.equal(original_losses[0], twin_losses[0])


def probed_hooks(model: torch.nn.Module) -> int:
    """The hooks a subscription probing module outputs adds: the root's two calls, one forward hook on every other
    module (no pre-hook: nothing to do before an output-only module runs)."""
    return 2 + len(list(model.modules())) - 1


def test_unsubscribe_removes_every_hook_and_restores_outputs():
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    before = hook_count(model)
    batch = make_batch(CONFIG, batch_size=2)
    expected = model(batch["tokens"])
    manager = SubscriberManager()
    handle = manager.subscribe(model, [Recorder()])
    assert hook_count(model) == before + probed_hooks(model)
    handle.remove()
    assert hook_count(model) == before and "forward" not in vars(model)
    output = model(batch["tokens"])
    assert torch.equal(output, expected) and output.grad_fn.name() == expected.grad_fn.name()
    handle.remove()  # idempotent


def test_subscribing_again_replaces_the_earlier_subscription():
    model = TinyTransformer(CONFIG)
    first, second = Recorder(), Recorder()
    manager = SubscriberManager()
    manager.subscribe(model, [first])
    other = SubscriberManager()
    other.subscribe(model, [second])  # another manager takes the model over
    assert first.closed
    assert hook_count(model) == probed_hooks(model)
    train_steps(model, 1)
    assert not first.calls and second.calls
    other.subscribe(model, [Recorder()])
    assert second.closed and hook_count(model) == probed_hooks(model)
    other.unsubscribe()
    assert hook_count(model) == 0


def test_a_subscription_is_a_handle_and_a_replaced_one_leaves_its_successor_alone():
    model = TinyTransformer(CONFIG)
    first, second = Recorder(), Recorder()
    manager = SubscriberManager()
    old = manager.subscribe(model, [first])
    new = manager.subscribe(model, [second])
    assert isinstance(old, Handle) and isinstance(new, Handle)
    assert first.closed and not old.active and new.active
    old.remove()
    with old:
        pass
    assert new.active and manager.subscribers == (second,) and not second.closed
    with new:
        train_steps(model, 1)
    assert not new.active and second.closed and second.step_ends == [0] and hook_count(model) == 0


class _PublicCallsOnly:
    """Stands in for a manager's StepTracker and notes every attribute the others reach for."""

    def __init__(self, tracker: StepTracker) -> None:
        self._tracker = tracker
        self.used: set[str] = set()

    def __getattr__(self, name: str):
        self.used.add(name)
        return getattr(self._tracker, name)


def test_hooks_and_probe_functions_use_only_the_step_trackers_public_calls():
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    manager = SubscriberManager()
    spy = _PublicCallsOnly(manager.tracker)
    manager.tracker = spy
    recorder = Recorder()
    with manager.subscribe(model, [recorder]):
        train_steps(model, 2)
        with torch.no_grad():
            model(make_batch(CONFIG, batch_size=1)["tokens"])
        manager.flush()
        assert manager.step == 3
    assert recorder.step_ends == [0, 1, 2]
    assert {"probe_forward", "probe_backward", "forward_returned", "backward_reached_root", "reset", "stop",
            "close_open_step"} <= spy.used
    assert not [name for name in spy.used if name.startswith("_")], spy.used


def test_the_step_tracker_alone_numbers_and_closes_steps():
    recorder = Recorder()
    tracker = StepTracker(forward_running=lambda: False)
    tracker.reset([recorder])
    site = ProbeSite("layer", "output", 1, 1, "Linear")
    x = torch.ones(2)
    event = tracker.probe_forward(site, [x])
    tracker.forward_returned()
    tracker.probe_backward(event, [x])
    assert (event.step, event.phase, tracker.step, recorder.step_ends) == (0, "forward", 1, [])
    tracker.probe_forward(site, [x])  # the next forward: step 0 is complete
    assert recorder.step_ends == [0] and tracker.step == 2
    assert [(c.step, c.phase, c.name) for c in recorder.calls] == [
        (0, "forward", "layer.output.0"), (0, "backward", "layer.output.0"), (1, "forward", "layer.output.0")]
    tracker.stop()
    assert recorder.step_ends == [0, 1] and tracker.subscribers == tracker.observers == () and tracker.step == 2
    tracker.probe_forward(site, [x])
    assert len(recorder.calls) == 3 and recorder.step_ends == [0, 1]


EXIT_SCRIPT = textwrap.dedent("""
    import torch
    from probes import SubscriberBase, SubscriberManager
    from probes.utils.exit import at_exit

    class Ends(SubscriberBase):
        event_kinds = {"step_end"}

        def on_event(self, event):
            print("step_end", event.step, flush=True)

        def close(self):
            print("close", flush=True)

    at_exit("writers", lambda: print("writers", flush=True))  # where the dump writers close
    model = torch.nn.Linear(2, 2)
    SubscriberManager.subscribe(model, [Ends()])
    model(torch.randn(1, 2)).sum().backward()
    with torch.no_grad():
        model(torch.randn(1, 2))  # evaluation: its step stays open until exit
    print("script ends", flush=True)
""")


def test_at_exit_the_open_step_finishes_before_the_writers_close():
    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout.splitlines() == ["step_end 0", "script ends", "step_end 1", "close", "writers"]


def test_original_usage_on_the_class_uses_the_global_manager():
    model = TinyTransformer(CONFIG)
    recorder = Recorder()
    SubscriberManager.subscribe(model, [recorder])
    try:
        train_steps(model, 2)
        assert GlobalSubscriberManager.step == 2
        assert GlobalSubscriberManager.subscribers == (recorder,)
    finally:
        SubscriberManager.unsubscribe()
    assert hook_count(model) == 0 and recorder.closed


class Nested(nn.Module):
    Pair = collections.namedtuple("Pair", "a b")

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, *, scale=1.0, extra=None):
        y = self.linear(x) * scale
        return {
            "pair": Nested.Pair(y, y.sum()),
            "list": [y.detach(), None, "text", 3],
            "ids": torch.arange(3),
            "extra": extra,
        }


def test_nested_outputs_and_keyword_only_inputs_pass_through_unchanged():
    torch.manual_seed(0)
    model = Nested()
    plain = copy.deepcopy(model)
    recorder = Recorder(observe_inputs=True)
    x = torch.randn(2, 4)
    with SubscriberManager().subscribe(model, [recorder]):
        out = model(x, scale=2.0, extra=(1, "b"))
        out["pair"].b.backward()
    ref = plain(x, scale=2.0, extra=(1, "b"))
    assert isinstance(out["pair"], Nested.Pair)
    assert torch.equal(out["pair"].a, ref["pair"].a) and torch.equal(out["ids"], ref["ids"])
    assert out["list"][1:] == [None, "text", 3] and out["extra"] == (1, "b")
    assert not out["list"][0].requires_grad and out["ids"].dtype == torch.int64
    assert torch.equal(model.linear.weight.grad, torch.autograd.grad(ref["pair"].b, plain.linear.weight)[0])
    forward = recorder.names(0, "forward")
    assert forward == ["<root>.input.0", "linear.input.0", "linear.output.0", "<root>.output.0"]
    root_outputs = [c.shapes for c in recorder.calls if c.name == "<root>.output.0" and c.phase == "forward"]
    assert root_outputs == [((2, 4), (), (2, 4), (3,))]  # y, y.sum(), detached y, ids
    grads = {c.name: c.shapes for c in recorder.calls if c.phase == "backward"}
    assert grads["<root>.output.0"] == (None, (), None, None)  # only y.sum() is on the loss path


class HiddenAndScalars(nn.Module):
    """Returns its hidden state in a plain tuple with scalars, as Hugging Face's blocks return (hidden, None)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu(), None, 3


class TwoTensors(nn.Module):
    def forward(self, x):
        return x * 2, x + 1


class TupleBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = HiddenAndScalars()
        self.pair = TwoTensors()

    def forward(self, x):
        hidden, nothing, three = self.block(x)
        assert nothing is None and three == 3
        doubled, shifted = self.pair(hidden)
        return (doubled * shifted).sum()


class ValueRecorder(SubscriberBase):
    def __init__(self):
        super().__init__()
        self.values = {}

    event_kinds = {"forward", "backward"}

    def on_event(self, event):
        copies = [None if t is None else t.detach().clone() for t in event.tensors]
        self.values[event.record_name(0), event.kind] = copies


def test_a_tuple_of_one_tensor_and_scalars_goes_straight_to_the_probe_with_the_same_records():
    torch.manual_seed(0)
    model = TupleBlocks()
    plain = copy.deepcopy(model)
    recorder = ValueRecorder()
    manager = SubscriberManager()
    general = []
    general_path = manager._post_forward_hook
    x = torch.randn(3, 4)
    with manager.subscribe(model, [recorder]):
        manager._post_forward_hook = lambda site, *rest: general.append(site.name) or general_path(site, *rest)
        loss = model(x)
        loss.backward()
    # The tuple of one tensor skips the general path; two tensors (which may share memory) and the root take it.
    assert general == ["pair", "<root>"]
    hidden = plain.block.linear(x).relu()
    doubled, shifted = plain.pair(hidden)
    expected = (doubled * shifted).sum()
    gradient, = torch.autograd.grad(expected, hidden, retain_graph=True)
    expected.backward()
    assert torch.equal(loss, expected)
    assert torch.equal(model.block.linear.weight.grad, plain.block.linear.weight.grad)
    assert torch.equal(recorder.values["block.output.0", "forward"][0], hidden)
    assert torch.equal(recorder.values["block.output.0", "backward"][0], gradient)
    assert len(recorder.values["block.output.0", "forward"]) == 1
    assert torch.equal(recorder.values["pair.output.0", "forward"][1], hidden + 1)


class WithOwnFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        return Square.apply(self.linear(x)).sum()


def test_model_with_its_own_autograd_function():
    torch.manual_seed(0)
    model = WithOwnFunction()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 3)
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder]):
        model(x).backward()
    plain(x).backward()
    assert torch.equal(model.linear.weight.grad, plain.linear.weight.grad)
    assert recorder.names(0, "forward") == ["linear.output.0", "<root>.output.0"]


class Inspecting(nn.Module):
    def __init__(self, repeat=1):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.repeat = repeat

    def forward(self, x):
        y = self.linear(x)
        for _ in range(self.repeat):
            y = inspect_activation("hidden", y) * 2
        return y.sum()


def test_inspect_activation_records_and_rejects_duplicate_names():
    model = Inspecting()
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder]):
        model(torch.randn(2, 3)).backward()
        model(torch.randn(2, 3)).backward()
    assert recorder.names(1, "forward") == ["linear.output.0", "hidden", "<root>.output.0"]
    assert "hidden" in recorder.names(1, "backward")
    x = torch.randn(2, 3)
    assert inspect_activation("hidden", x) is x  # nothing subscribed: a no-op
    twice = Inspecting(repeat=2)
    recorder = Recorder()
    with SubscriberManager().subscribe(twice, [recorder]):
        # A probe never stops training: the duplicate name switches that inspect site off, with one warning.
        with pytest.warns(ProbeFailureWarning, match="'hidden' was used twice in step 0.*switched off"):
            twice(torch.randn(2, 3)).backward()
        twice(torch.randn(2, 3)).backward()
    assert recorder.names(0, "forward") == ["linear.output.0", "hidden", "<root>.output.0"]
    assert recorder.names(1, "forward") == ["linear.output.0", "<root>.output.0"]


def test_module_called_twice_gets_distinct_record_names():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder]):
        model(torch.randn(2, 3)).sum().backward()
    assert recorder.names(0, "forward") == ["0.output.0", "1.output.0", "0#1.output.0", "<root>.output.0"]


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: m.subscribe("model", [Recorder()]), TypeError, "needs a torch.nn.Module.*got str"),
        (lambda m: m.subscribe(nn.Linear(2, 2), [object()]), TypeError, r"subscribers\[0\] is a object"),
        (lambda m: m.subscribe(nn.Linear(2, 2), Recorder()), TypeError, "wrap a single subscriber in a list"),
        (lambda m: m.subscribe(nn.Linear(2, 2), []), ValueError, "empty list"),
        (lambda m: Recorder(start_step=5, end_step=2), ValueError, r"start_step \(5\) must not be greater"),
        (lambda m: Recorder(start_step=-1), ValueError, "non-negative"),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call(SubscriberManager())


def test_subscriber_base_defaults_are_pass_through():
    class Quiet(SubscriberBase):
        pass

    model = TinyTransformer(CONFIG)
    manager = SubscriberManager()
    with manager.subscribe(model, [Quiet()]):
        train_steps(model, 2)
        assert manager.step == 2
        # No observing subscriber: only the root's step boundary is inserted.
        out = model(make_batch(CONFIG, batch_size=1)["tokens"])
        assert out.grad_fn.name() == "StepBoundaryBackward"


def test_the_roots_probes_wrap_an_instance_forward_someone_set_and_give_it_back():
    model = TinyTransformer(CONFIG)
    seen = []

    def their_forward(tokens, labels=None):  # e.g. Accelerate's mixed-precision wrapper
        seen.append(tokens.shape)
        return TinyTransformer.forward(model, tokens, labels)

    model.forward = their_forward
    recorder = Recorder()
    batch = make_batch(CONFIG, batch_size=2)
    with SubscriberManager().subscribe(model, [recorder]):
        assert model.forward is not their_forward
        assert list(inspect.signature(model.forward).parameters) == ["tokens", "labels"]
        model(batch["tokens"], labels=batch["labels"]).backward()
    assert model.forward is their_forward and len(seen) == 1
    assert recorder.names(0, "forward")[-1] == "<root>.output.0" and recorder.names(0, "backward")
    assert list(inspect.signature(model.forward).parameters) == ["tokens", "labels"]


# SubscriberManager under ORTModule: same calls as eager, made by ORT's runtime, steps counted right.

def ortmodule(model):
    from onnxruntime.training.ortmodule import ORTModule

    return ORTModule(model)


def train_ort(model, steps):
    losses = []
    for step in range(steps):
        batch = make_batch(CONFIG, batch_size=4, seed=step)
        loss = model(batch["tokens"], labels=batch["labels"])
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.ort
@pytest.mark.slow
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

    eager_losses = train_ort(eager_model, 3)
    ort_losses = train_ort(ort_model, 3)

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


@pytest.mark.ort
@pytest.mark.slow
def test_subscribing_an_ortmodule_that_already_trained_exports_it_again_with_probes():
    torch.manual_seed(0)
    model = ortmodule(TinyTransformer(CONFIG))
    train_ort(model, 1)  # exported without probes; ORT then skips its checks on later steps
    recorder, manager = Recorder(), SubscriberManager()
    manager.subscribe(model, [recorder])
    train_ort(model, 1)
    manager.unsubscribe()
    assert recorder.names(0, "forward") and recorder.names(0, "backward")
    assert all(call.by_ort for call in recorder.calls), "a probe call did not come from ORT"


@pytest.mark.ort
@pytest.mark.slow
def test_unsubscribing_an_ortmodule_reexports_without_probes():
    torch.manual_seed(0)
    inner = TinyTransformer(CONFIG)
    model = ortmodule(inner)
    recorder = Recorder()
    manager = SubscriberManager()
    manager.subscribe(model, [recorder])
    train_ort(model, 1)
    calls = len(recorder.calls)
    assert calls > 0
    manager.unsubscribe()
    train_ort(model, 1)
    assert len(recorder.calls) == calls, "probes still ran after unsubscribe"


class Branches(nn.Module):
    """One activation called three times per forward: on a trainable branch, on a frozen one, and on a constant
    another module returns beside its hidden state. Eager differentiates only the first; ORT's graph takes
    every parameter for trainable and every output of a probe for differentiable when one is, so it
    differentiates all three."""

    def __init__(self):
        super().__init__()
        self.trainable = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.pair = HiddenAndConstant()
        self.act = nn.Tanh()

    def forward(self, x):
        hidden, constant = self.pair(x)
        return (self.act(self.trainable(hidden)) * self.act(self.frozen(x)) + self.act(constant)).sum()


class HiddenAndConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 4))

    def forward(self, x):
        return self.linear(x), self.offset * 2.0


def train_branches(model, runner, steps, unfrozen_at):
    """SGD steps of ``Branches``; its frozen branch is trainable at step ``unfrozen_at`` only."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        model.frozen.requires_grad_(step == unfrozen_at)
        optimizer.zero_grad()
        loss = runner(torch.randn(2, 4, generator=torch.Generator().manual_seed(step)))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.ort
@pytest.mark.slow
def test_ort_records_the_gradients_eager_computes_call_by_call():
    runs = {}
    for backend in ("eager", "ort", "ort without probes"):
        torch.manual_seed(0)
        model, recorder, manager = Branches(), Recorder(), SubscriberManager()
        if backend != "ort without probes":
            manager.subscribe(model, [recorder])
        runs[backend] = (recorder, *train_branches(model, model if backend == "eager" else ortmodule(model), 4, 2))
        manager.unsubscribe()
    (eager, _, _), (ort, ort_losses, ort_grads) = runs["eager"], runs["ort"]
    assert ort.calls and all(call.by_ort for call in ort.calls), "a probe call did not come from ORT"
    frozen = {"frozen.output.0", "act#1.output.0"}  # the frozen branch, and the activation's call on it
    for step in range(4):
        assert ort.records(step, "forward") == eager.records(step, "forward"), step
        assert ort.records(step, "backward") == eager.records(step, "backward"), step
        # Step 2 makes the frozen branch trainable: ORT exports again and records its gradients, as eager does.
        assert frozen <= set(eager.records(step, "backward")) if step == 2 else \
            not frozen & set(eager.records(step, "backward")), step
        assert {"pair.output.0", "act.output.0"} <= set(eager.records(step, "backward"))
        assert not {"pair.output.1", "act#2.output.0"} & set(eager.records(step, "backward"))
    # Training with probes is training without them.
    assert ort_losses == runs["ort without probes"][1]
    assert ort_grads.keys() == runs["ort without probes"][2].keys()
    assert all(torch.equal(grad, runs["ort without probes"][2][name]) for name, grad in ort_grads.items())


def test_forwards_while_paused_are_not_steps_and_leave_no_record():
    model = TinyTransformer(CONFIG)
    recorder = Recorder()
    manager = SubscriberManager()
    with manager.subscribe(model, [recorder]):
        train_steps(model, 1)
        model(make_batch(CONFIG, batch_size=1)["tokens"])  # forward only: left open ...
        with manager.paused():  # ... until pause() finishes it
            assert recorder.step_ends == [0, 1]
            with torch.no_grad():
                model(make_batch(CONFIG, batch_size=1)["tokens"])
            train_steps(model, 1)  # a training step while paused is not recorded either
        assert manager.step == 2 and recorder.step_ends == [0, 1]
        calls = len(recorder.calls)
        train_steps(model, 1)
        assert manager.step == 3 and recorder.step_ends == [0, 1, 2]
        assert {c.step for c in recorder.calls[calls:]} == {2}
        assert {c.phase for c in recorder.calls[calls:]} == {"forward", "backward"}


def test_pause_on_the_class_pauses_the_global_manager():
    model = TinyTransformer(CONFIG)
    recorder = Recorder()
    SubscriberManager.subscribe(model, [recorder])
    try:
        SubscriberManager.pause()
        train_steps(model, 1)
        assert GlobalSubscriberManager.step == 0 and not recorder.calls
        SubscriberManager.resume()
        train_steps(model, 1)
        assert GlobalSubscriberManager.step == 1 and recorder.step_ends == [0]
    finally:
        SubscriberManager.unsubscribe()
