"""Test helpers: a recording subscriber and proof that ORT, not PyTorch, executed a probe."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from probes import StatisticsSubscriber, SubscriberBase, SubscriberManager
from probes.models import TinyTransformer, TransformerConfig, make_batch
from probes.testing import BugInjection, inject_bug


def called_from(file_suffix: str) -> bool:
    """True when a Python frame of a file ending in ``file_suffix`` is on the current call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith(file_suffix):
            return True
        frame = frame.f_back
    return False


def called_by_ort_runtime() -> bool:
    """True when the current Python call comes from ORTModule's graph run.

    ORT's execution agent is the only Python frame through which ORTModule's C++ graph run calls a
    PythonOp; an eager (or export-time) forward never passes through it.
    """
    return called_from("ortmodule/_execution_agent.py")


class OrtWitness(SubscriberBase):
    """Counts the probe calls ORT's runtime made (proof that the probes ran inside ORT's graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_ort = 0

    event_kinds = {"forward", "backward"}

    def on_event(self, event) -> None:
        self.by_ort += called_by_ort_runtime()


def counting_backend(run, backend: str):
    """torch.compile backend ``backend`` that counts the graphs it compiles in ``run.graphs``."""
    from torch._dynamo.backends.registry import lookup_backend

    compiler = lookup_backend(backend)

    def count(gm, example_inputs):
        run.graphs += 1
        return compiler(gm, example_inputs)

    return count


class Square(torch.autograd.Function):
    """A user's own custom autograd Function, unrelated to probes (and without a symbolic)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


@dataclass
class Call:
    step: int
    phase: str
    name: str
    seq: int
    shapes: tuple
    by_ort: bool
    records: tuple[str, ...] = ()  # the record name of each tensor (of each gradient that is not None)


class Recorder(SubscriberBase):
    """Records every per-step call; ``by_ort`` tells whether ORT's runtime made it."""

    def __init__(self, start_step=None, end_step=None, observe_inputs=False, **selection):
        super().__init__(start_step, end_step, **selection)
        self.observe_inputs = observe_inputs
        self.calls: list[Call] = []
        self.step_ends: list[int] = []
        self.closed = False

    def _record(self, event, tensors):
        shapes = tuple(None if t is None else tuple(t.shape) for t in tensors)
        records = tuple(event.record_name(i) for i, t in enumerate(tensors) if t is not None)
        self.calls.append(Call(event.step, event.phase, event.record_name(0), event.seq, shapes, called_by_ort_runtime(),
                               records))

    event_kinds = {"forward", "backward", "step_end"}

    def on_event(self, event):
        if event.kind == "step_end":
            self.step_ends.append(event.step)
        else:
            self._record(event, event.tensors)

    def close(self):
        self.closed = True

    def names(self, step, phase):
        return [c.name for c in self.calls if c.step == step and c.phase == phase]

    def records(self, step, phase):
        """The record names of every tensor (every gradient that is not None) of ``step``'s ``phase``, sorted."""
        return sorted(name for c in self.calls if c.step == step and c.phase == phase for name in c.records)


def same_values(a, b) -> bool:
    """Equal, of the same type, nan equal to nan, lists element by element (Arrow's own equality says nan != nan)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def assert_moments(record: dict, expected: dict, label: object, keys: tuple[str, ...] = ("mean", "std", "norm"), *,
                   rel: float = 1e-12) -> None:
    """The record's moments equal the reference's to ``rel`` relative (None where the reference has None); the
    mean relative to the spread too: float64 rounds int64 extremes, and a mean near 0 has no precision of its own."""
    for key in keys:
        if expected[key] is None:
            assert record[key] is None, (label, key)
        elif key == "mean":
            assert abs(record[key] - expected[key]) <= rel * (abs(expected[key]) + (expected["std"] or 0.0)), \
                (label, key, record[key], expected[key])
        else:
            assert record[key] == pytest.approx(expected[key], rel=rel, abs=1e-300), (label, key, record[key], expected[key])


def hook_count(model: torch.nn.Module) -> int:
    """Forward hooks and pre-hooks of every module; a wrapped instance ``forward`` (the root's probes,
    probes.core.rootcall) counts as the two hooks it stands for."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + 2 * ("forward" in vars(m)) for m in model.modules())


def train_run(out: Path, *, config: TransformerConfig, steps: int, bug: tuple[str, int, str] | None = None,
              wrap=None, model: torch.nn.Module | None = None) -> None:
    """Trains TinyTransformer (seed 0) for ``steps`` SGD steps, dumping statistics to ``out``.

    ``bug``: (layer, step, phase) to perturb by 1%; ``wrap``: e.g. ORTModule.
    """
    if model is None:
        torch.manual_seed(0)
        model = TinyTransformer(config)
    injection: BugInjection | None = None
    if bug is not None and bug[2] == "forward":
        injection = inject_bug(model, bug[0], step=bug[1], phase="forward")
    manager = SubscriberManager()
    manager.subscribe(model, [StatisticsSubscriber(out)])
    if bug is not None and bug[2] == "backward":  # after subscribing: the probe must see the scaled gradient
        injection = inject_bug(model, bug[0], step=bug[1], phase="backward")
    runner = wrap(model) if wrap is not None else model
    optimizer = torch.optim.SGD(runner.parameters(), lr=0.1)
    for step in range(steps):
        if injection is not None:
            injection.step = step
        batch = make_batch(config, batch_size=4, seed=step)
        optimizer.zero_grad()
        runner(batch["tokens"], labels=batch["labels"]).backward()
        optimizer.step()
    manager.unsubscribe()


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """Hugging Face GPT-2 (causal LM) from a tiny config built in code: no download, no dropout."""
    transformers = __import__("pytest").importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def gpt2_batch(seed: int, batch_size: int = 2, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Inputs for ``tiny_gpt2``: ``model(**gpt2_batch(step)).loss``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (batch_size, seq_len), generator=generator)
    return {"input_ids": tokens, "labels": tokens}
