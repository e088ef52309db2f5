"""Progress lines on stderr (or a given stream) for long operations, silent when they are short.

    meter = progress_meter("reading pt_out", len(files), progress)   # None when progress is False
    for done, item in enumerate(files, 1): ...; meter and meter.update(done)
    if meter: meter.close()
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


class Progress:
    """Progress lines for one operation: silent during the first ``delay`` seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, delay: float = 1.0) -> None:
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.monotonic()
        self.delay = delay
        self._last_print = -math.inf
        self._printed = False

    def update(self, done: int) -> None:
        now = time.monotonic()
        interval = 0.5 if self.stream.isatty() else 5.0  # a log file needs fewer lines than a terminal
        if now - self.started < self.delay or now - self._last_print < interval:
            return
        self._last_print, self._printed = now, True
        self._write(f"{self.label}: {done}/{self.total}")

    def close(self) -> None:
        if self._printed:
            self._write(f"{self.label}: {self.total}/{self.total} done")
            if self.stream.isatty():
                self.stream.write("\n")

    def _write(self, text: str) -> None:
        tty = self.stream.isatty()
        self.stream.write(("\r" + text) if tty else text + "\n")
        self.stream.flush()


def progress_meter(label: str, total: int, progress: bool | TextIO) -> Progress | None:
    """A meter as a ``progress`` option asks: False none, True on stderr, a stream on that stream."""
    if not progress:
        return None
    return Progress(label, total, None if progress is True else progress)
