"""One interpreter-exit sequence for all of probes, in a fixed order of stages.

Several parts of probes have work to do at exit, and the order matters: ZeRO-3 must know the process
is exiting before subscriptions close, the open step must be finished before the dump writers close.
Instead of several ``atexit`` hooks whose order depends on who registered last, each part registers
here under its stage and one ``atexit`` hook runs the stages in this order:

1. ``"exiting"``: work before anything is torn down (``exiting()`` is already true);
2. ``"subscriptions"``: finish open steps and remove subscriptions;
3. ``"writers"``: close dump writers (last: the steps just finished are written).

    handle = at_exit("writers", writer.close)     # handle.remove() when the writer closes by itself
    if exiting(): ...                              # the sequence has begun: the process is going away
"""

from __future__ import annotations

import atexit
import itertools
from typing import Callable

from exporters.handles import Handle

STAGES = ("exiting", "subscriptions", "writers")


class _ExitSequence:
    """The callbacks of each stage, run in stage order by one ``atexit`` hook.

    Process-wide: the interpreter exits once, and the order across all of probes is the point.
    """

    def __init__(self) -> None:
        self._callbacks: dict[str, dict[int, Callable[[], None]]] = {stage: {} for stage in STAGES}
        self._keys = itertools.count()
        self.started = False

    def add(self, stage: str, callback: Callable[[], None]) -> Handle:
        if stage not in self._callbacks:
            raise ValueError(f"unknown exit stage {stage!r}; expected one of {STAGES}")
        key = next(self._keys)
        callbacks = self._callbacks[stage]
        callbacks[key] = callback
        return Handle(lambda: callbacks.pop(key, None))

    def run(self) -> None:
        self.started = True
        for stage in STAGES:
            callbacks = self._callbacks[stage]
            while callbacks:  # callbacks may register or remove others; each runs once
                key = next(iter(callbacks))
                callbacks.pop(key)()


_SEQUENCE = _ExitSequence()
atexit.register(_SEQUENCE.run)


def at_exit(stage: str, callback: Callable[[], None]) -> Handle:
    """Run ``callback()`` at interpreter exit in ``stage`` (see the module doc); ``remove()`` cancels it."""
    return _SEQUENCE.add(stage, callback)


def exiting() -> bool:
    """True once the exit sequence has begun (the interpreter is exiting)."""
    return _SEQUENCE.started
