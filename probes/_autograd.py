"""The one place probes touches the autograd engine's private API: which backward runs now, and when it ends.

    from probes import _autograd
    task = _autograd.current_backward()        # None outside a backward pass
    if task is not None:
        _autograd.call_when_backward_ends(lambda: print("backward", task, "done"))

A backward pass is one graph task of the engine (one ``backward()`` or ``torch.autograd.grad`` call;
a reentrant checkpoint runs a nested one). A module forward that runs while a graph task is
running is a recomputation (activation checkpointing), not a step of training.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

SUPPORTED_TORCH = ((2, 1), (2, 15))


class AutogradInternalsError(RuntimeError):
    """torch's autograd engine lacks the private calls probes uses to find the end of a backward."""


@functools.cache
def _engine_api() -> tuple[Callable[[], int], Callable[[Callable[[], None]], None]]:
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    current = getattr(torch._C, "_current_graph_task_id", None)
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if current is None or queue is None:
        supported = ".".join(map(str, SUPPORTED_TORCH[0])), ".".join(map(str, SUPPORTED_TORCH[1]))
        raise AutogradInternalsError(
            f"torch {torch.__version__} has no torch._C._current_graph_task_id or "
            f"Variable._execution_engine.queue_callback; probes needs torch >= {supported[0]}, < {supported[1]} "
            f"(this is {'.'.join(map(str, version))}); install a supported torch or update probes/_autograd.py"
        )
    return current, queue


def current_backward() -> int | None:
    """The id of the graph task the autograd engine runs on this thread, or None outside backward."""
    task = _engine_api()[0]()
    return None if task < 0 else task


def call_when_backward_ends(callback: Callable[[], None]) -> None:
    """Runs ``callback`` once the current graph task has finished (call only inside a backward)."""
    _engine_api()[1](callback)
