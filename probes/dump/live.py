"""The open writers of this process, so that a reader can wait for the ones writing what it reads.

    flush_writers("pt_out")      # every live DumpWriter into pt_out has written what it was given

The writer stays asynchronous (training never waits for the disk), and every reader of this package
(``DumpReader``, ``load_dump``, ``list_steps``, ``show``, and through them ``probes.compare`` and
``probes.testing.assert_parity``) first waits for each live DumpWriter of this process that writes
into the path being read (the dump directory, one of its rank directories or a file in one; paths
compared resolved) to write everything it was given, ``finish_step`` renames included. So a dump read
right after training shows every finished step, without a sleep. The wait never raises the writer's
own error (that goes to the training thread); the reader then reads what is on disk. Writers of other
processes are not waited for: their unfinished steps read as unfinished.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from typing import Protocol


class LiveWriter(Protocol):
    """What the registry needs of a writer (DumpWriter)."""

    def writes_into(self, target: Path) -> bool:
        """Whether ``target`` (resolved) is the writer's dump directory or lies inside it."""

    def wait_written(self) -> None:
        """Waits for everything queued so far; never raises the writer's error."""


class _LiveWriters:
    """The DumpWriters of this process that are open, held weakly (a writer dropped unclosed is not kept).

    Process-wide: a reader finds the writers to wait for by the path it reads, whoever opened them.
    """

    def __init__(self) -> None:
        self._writers: weakref.WeakSet[LiveWriter] = weakref.WeakSet()
        self._lock = threading.Lock()  # writers open and close on other threads while a reader copies the set

    def add(self, writer: LiveWriter) -> None:
        with self._lock:
            self._writers.add(writer)

    def discard(self, writer: LiveWriter) -> None:
        with self._lock:
            self._writers.discard(writer)

    def snapshot(self) -> list[LiveWriter]:
        with self._lock:
            return list(self._writers)


_LIVE = _LiveWriters()


def add_live(writer: LiveWriter) -> None:
    _LIVE.add(writer)


def discard_live(writer: LiveWriter) -> None:
    _LIVE.discard(writer)


def resolved(path: str | Path) -> Path:
    """``path`` resolved, for comparing a reader's path with a writer's directory."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):  # a symlink loop, an unreadable component: compare as given
        return Path(os.path.abspath(path))


def flush_writers(path: str | Path) -> None:
    """Waits until every live DumpWriter of this process writing into ``path`` has written what it got.

    Usage: ``flush_writers("pt_out")`` (``DumpReader``, ``load_dump``, ``list_steps``, ``probes.compare``
    and ``assert_parity`` already do this). ``path`` may be a dump directory, a rank directory or a step
    file. Never raises a writer's error: a failed writer's error belongs to the training thread.
    """
    writers = _LIVE.snapshot()
    if not writers:
        return
    target = resolved(path)
    for writer in writers:
        if writer.writes_into(target):
            writer.wait_written()
