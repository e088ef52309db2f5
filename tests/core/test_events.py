"""One event signature: ``on_event(event)`` gets every kind; a class written with the seed's named methods is a
clear error where it is defined, never a method silently not called."""

from __future__ import annotations

import warnings

import pytest
import torch

from probes import ProbeEvent, ProbeFailureWarning, StatisticsSubscriber, SubscriberBase, SubscriberManager, load_dump
from probes.models import TinyTransformer, TransformerConfig, make_batch

CONFIG = TransformerConfig(vocab_size=32, d_model=8, n_heads=2, n_layers=1, d_ff=16, seq_len=4)
BROKEN = "blocks.0.attn.qkv"  # the site whose forward call raises, once, in every subscriber below


def train(model: torch.nn.Module, steps: int) -> None:
    for step in range(steps):
        batch = make_batch(CONFIG, batch_size=2, seed=step)
        model(batch["tokens"], labels=batch["labels"]).backward()


class NewStyle(SubscriberBase):
    """The one entry point: logs every event, from the event alone."""

    def __init__(self, **selection) -> None:
        super().__init__(**selection)
        self.log: list[tuple] = []
        self.tensors: dict[tuple[int, str, str], tuple] = {}

    def on_event(self, event):
        kind = event.kind
        if kind == "subscribe":
            self.log.append((kind, type(event.model).__name__))
        elif kind in ("step_start", "forward_end", "step_end"):
            assert event.site is None and event.tensors == ()
            self.log.append((kind, event.step))
        elif kind == "site_failed":
            self.log.append((kind, event.step, event.site.name, event.reason))
        else:
            if kind == "forward" and event.site.name == BROKEN:
                raise RuntimeError("broken on purpose")
            self.tensors[(event.step, kind, event.record_name(0))] = tuple(event.tensors)
            self.log.append((kind, event.step, event.phase, event.seq, event.record_name(0),
                             tuple(None if t is None else tuple(t.shape) for t in event.tensors)))


def run(subscribers: list[SubscriberBase], steps: int = 2) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    with warnings.catch_warnings(record=True) as caught, SubscriberManager().subscribe(model, subscribers):
        warnings.simplefilter("always")
        train(model, steps)
    assert sum(issubclass(w.category, ProbeFailureWarning) for w in caught) == len(subscribers)


def test_a_subscriber_gets_every_kind_through_on_event_in_order():
    new = NewStyle()
    run([new])
    log = new.log
    assert log[0] == ("subscribe", "TinyTransformer") and log[1] == ("step_start", 0)
    assert [entry for entry in log if entry[0] in ("step_start", "forward_end", "step_end")] == [
        ("step_start", 0), ("forward_end", 0), ("step_end", 0), ("step_start", 1), ("forward_end", 1), ("step_end", 1)]
    assert [entry[:3] for entry in log if entry[0] == "site_failed"] == [("site_failed", 0, BROKEN)]
    assert "RuntimeError: broken on purpose" in [entry for entry in log if entry[0] == "site_failed"][0][3]
    forwards = [entry for entry in log if entry[0] == "forward" and entry[1] == 0]
    backwards = [entry for entry in log if entry[0] == "backward" and entry[1] == 0]
    assert forwards[-1][4] == "<root>.output.0" and backwards[0][4] == "<root>.output.0"
    assert BROKEN + ".output.0" not in {entry[4] for entry in log if entry[0] in ("forward", "backward")}
    assert {kind for kind, *_ in log} == {"subscribe", "step_start", "forward", "backward", "forward_end",
                                          "step_end", "site_failed"}


@pytest.mark.parametrize("method, kind", [("on_forward", "forward"), ("on_backward", "backward"),
                                          ("on_forward_end", "forward_end"), ("on_step_end", "step_end"),
                                          ("on_site_failed", "site_failed"), ("on_subscribe", "subscribe"),
                                          ("on_step_start", "step_start")])
def test_a_named_method_of_the_seed_is_a_clear_error_where_the_class_is_defined(method, kind):
    with pytest.raises(TypeError, match=rf"Seed\.{method}: subscribers take every event through on_event\(event\); "
                                        rf"write `def on_event\(self, event\)` handling event\.kind == '{kind}'"):
        type("Seed", (StatisticsSubscriber,), {method: lambda self, *args: None})


def test_a_new_style_subscriber_gets_the_live_tensors_and_gradients():
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    new = NewStyle()
    outputs, grads = {}, {}

    def keep(module, args, output):  # registered first: runs before the probe's hook, on the module's own output
        outputs["head"] = output.detach().clone()
        output.register_hook(lambda grad: grads.setdefault("head", grad.clone()))

    model.head.register_forward_hook(keep)
    with warnings.catch_warnings(), SubscriberManager().subscribe(model, [new]):
        warnings.simplefilter("ignore", ProbeFailureWarning)
        train(model, 1)
    (forward,) = new.tensors[(0, "forward", "head.output.0")]
    (backward,) = new.tensors[(0, "backward", "head.output.0")]
    assert torch.equal(forward, outputs["head"]) and torch.equal(backward, grads["head"])


class Ends(SubscriberBase):
    event_kinds = {"step_end"}

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []

    def on_event(self, event):
        self.kinds.append(event.kind)


@pytest.mark.filterwarnings("ignore::probes.core.failures.ProbeFailureWarning")
def test_declared_events_decide_the_probes_and_the_calls():
    ends, manager, model = Ends(), SubscriberManager(), TinyTransformer(CONFIG)
    with manager.subscribe(model, [ends]):
        assert manager.tracker.observers == ()  # nothing takes tensors: no probe is inserted
        train(model, 2)
    assert ends.kinds == ["step_end", "step_end"]

    forward_only = NewStyle()
    forward_only.event_kinds = {"forward"}  # per instance
    with manager.subscribe(model, [forward_only]):
        assert manager.tracker.observers == (forward_only,)
        train(model, 1)
    assert {entry[0] for entry in forward_only.log} == {"forward"}


def test_an_event_kind_that_does_not_exist_is_a_clear_error():
    subscriber = NewStyle()
    subscriber.event_kinds = {"forward", "step_begin"}
    with pytest.raises(ValueError, match=r"subscribers\[0\]: NewStyle.event_kinds names no event kind: 'step_begin'; "
                                         r"the kinds are 'subscribe', 'step_start'"):
        SubscriberManager().subscribe(TinyTransformer(CONFIG), [subscriber])


def test_a_subclass_extends_its_parent_through_super():
    calls: list[str] = []

    class Parent(SubscriberBase):
        def on_event(self, event):
            calls.append(f"parent {event.kind} {event.step}")

    class Child(Parent):
        def on_event(self, event):
            if event.kind == "step_end":
                calls.append(f"child step_end {event.step}")
            super().on_event(event)

    Child().on_event(ProbeEvent(None, 3, kind="step_end"))
    assert calls == ["child step_end 3", "parent step_end 3"]
    calls.clear()
    Child().on_event(ProbeEvent(None, 4, kind="forward_end"))
    assert calls == ["parent forward_end 4"]


def test_a_subscriber_that_takes_no_event_gets_no_probe():
    class GraphOnly(SubscriberBase):  # overrides no on_event and declares no kinds: it only builds the graph
        def post_forward_module_apply(self, site, module, args, outputs):
            return outputs

    manager, model = SubscriberManager(), TinyTransformer(CONFIG)
    with manager.subscribe(model, [GraphOnly()]):
        assert manager.tracker.observers == ()
        train(model, 1)


def test_a_subclass_of_statistics_subscriber_extending_on_event_keeps_its_dump(tmp_path):
    class Counting(StatisticsSubscriber):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.forwards = 0
            self.ends: list[int] = []

        def on_event(self, event):
            if event.kind == "forward":
                self.forwards += 1
            super().on_event(event)
            if event.kind == "step_end":
                self.ends.append(event.step)

    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    counting, plain = Counting(tmp_path / "counting"), StatisticsSubscriber(tmp_path / "plain")
    with SubscriberManager().subscribe(model, [counting, plain]):
        train(model, 2)
    assert counting.ends == [0, 1] and counting.forwards > 0
    records, expected = load_dump(tmp_path / "counting"), load_dump(tmp_path / "plain")
    assert len(records) == len(expected) and counting.forwards == sum(r["phase"] == "forward" for r in records)
    assert [(r["name"], r["phase"], r["norm"]) for r in records] == [(r["name"], r["phase"], r["norm"])
                                                                     for r in expected]
