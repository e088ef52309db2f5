"""The one undo-handle shape of the project (as ``torch.utils.hooks.RemovableHandle``).

Every registration, patch or subscription returns a ``Handle``: ``remove()`` undoes it, a second
``remove()`` does nothing, and a ``with`` block removes it on exit.

    handle = Handle(undo)          # undo() is called once, on the first remove()
    with handle: ...               # or handle.remove()
    handle.active                  # False once removed
"""

from __future__ import annotations

from typing import Any, Callable, Iterable


class Handle:
    """Undoes one registration when removed; idempotent; a context manager."""

    def __init__(self, undo: Callable[[], Any] | None = None) -> None:
        self._undo = undo

    @classmethod
    def chain(cls, handles: Iterable["Handle"]) -> "Handle":
        """One handle that removes ``handles`` in reverse order (the last registered first)."""
        held = list(handles)
        return cls(lambda: [handle.remove() for handle in reversed(held)])

    @property
    def active(self) -> bool:
        """True until the handle is removed."""
        return self._undo is not None

    def remove(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()
