"""Progress bars (tqdm) on stderr, or a given stream, for long operations; nothing for short ones.

    meter = progress_meter("reading pt_out", len(files), progress)   # None when progress is False
    for done, item in enumerate(files, 1): ...; meter and meter.update(done)
    if meter: meter.close()

The bar appears only once an operation has run for ``delay`` seconds (1 s by default), so a compare
that takes a fraction of a second prints nothing.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

__all__ = ["Progress", "progress_meter"]


class Progress:
    """A tqdm bar for one operation, fed with the count done so far; silent during the first ``delay`` seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, delay: float = 1.0) -> None:
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        tty = self.stream.isatty()
        self._bar = tqdm(total=total, desc=label, file=self.stream, delay=delay, leave=True, dynamic_ncols=tty,
                         mininterval=0.5, ascii=not tty, disable=False)

    def update(self, done: int) -> None:
        """``done`` items of ``total`` are done."""
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)

    def close(self) -> None:
        self.update(self.total)  # shown only if the operation outlasted ``delay``
        self._bar.close()


def progress_meter(label: str, total: int, progress: bool | TextIO) -> Progress | None:
    """A meter as a ``progress`` option asks: False none, True on stderr, a stream on that stream."""
    if not progress:
        return None
    return Progress(label, total, None if progress is True else progress)
