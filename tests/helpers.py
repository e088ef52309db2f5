"""Test helpers: a recording subscriber and proof that ORT, not PyTorch, executed a probe."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from probes import SubscriberBase


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


class Recorder(SubscriberBase):
    """Records every per-step call; ``by_ort`` tells whether ORT's runtime made it."""

    def __init__(self, start_step=None, end_step=None, observe_inputs=False):
        super().__init__(start_step, end_step)
        self.observe_inputs = observe_inputs
        self.calls: list[Call] = []
        self.step_ends: list[int] = []
        self.closed = False

    def _record(self, event, tensors):
        shapes = tuple(None if t is None else tuple(t.shape) for t in tensors)
        self.calls.append(Call(event.step, event.phase, event.record_name(0), event.seq, shapes, called_by_ort_runtime()))

    def on_forward(self, event, tensors):
        self._record(event, tensors)

    def on_backward(self, event, grads):
        self._record(event, grads)

    def on_step_end(self, step):
        self.step_ends.append(step)

    def close(self):
        self.closed = True

    def names(self, step, phase):
        return [c.name for c in self.calls if c.step == step and c.phase == phase]


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
