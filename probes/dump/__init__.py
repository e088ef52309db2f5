"""Dump I/O for statistics records: a background writer, a reader and a table printer.

Usage:
    writer = DumpWriter("pt_out", rank=0)             # raises now if the directory is unusable
    writer.write(step, {"name": "fc1", "phase": "forward", "seq": 0, "mean": 0.1})
    writer.finish_step(step)                          # the step becomes visible to readers
    writer.close()
    records = load_dump("pt_out")                     # or: python -m probes show pt_out --step 3

A record is a plain JSON-ready dict. Only "step", "rank", "name", "phase" and "seq" mean something
here; every other key is passed through untouched. Nothing is pickled: records travel to the writer
thread as dicts and reach the disk as JSON.

Layout of an output directory D (one writer per rank, all ranks may share D):

    D/manifest.json                          {"format": "probes-dump", "version": 1}; marks D as a dump
    D/rank_<r>/step_<NNNNNN>.jsonl           a finished step: one JSON object per line, in write order
    D/rank_<r>/step_<NNNNNN>.jsonl.partial   a step still being written, or left unfinished by a crash
    D/rank_<r>/step_<NNNNNN>.order.txt       the finished step's records in execution order, one
                                             "<name>_<phase>" per line (like order.txt of onnxruntime's
                                             StatisticsSubscriber)

<NNNNNN> is the step number zero-padded to six digits (more digits once steps reach a million).
Paths contain only rank and step numbers; names from the model appear only inside files.
A step is finished by flushing, fsync'ing and renaming its .partial file, so a crash loses at most
the steps not finished yet and never damages a finished one. Lines are standard JSON except that
non-finite floats are written as NaN / Infinity / -Infinity (Python's json reads them back).

Reading while this process still writes: the writer stays asynchronous (training never waits for the
disk), and every reader of this module (``load_dump``, ``list_steps``, ``show``, and through them
``probes.compare`` and ``probes.testing.assert_parity``) first waits for each live DumpWriter of this
process that writes into the path being read (the dump directory, one of its rank directories or a
file in one; paths compared resolved) to write everything it was given, ``finish_step`` renames
included. So a dump read right after training shows every finished step, without a sleep. The wait
never raises the writer's own error (that goes to the training thread); the reader then reads what
is on disk. ``flush_writers(path)`` is that wait on its own. Writers of other processes are not
waited for: their unfinished steps read as unfinished.

Interpreter exit: a writer that is still open is closed by an atexit hook. If something could not be
written by then (the directory was removed, the disk filled up and nobody was told yet), that is one
warning line on stderr naming the directory and the steps lost, never a traceback. Calls the
manager's own atexit hook makes on a closed or failed writer are dropped the same way.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import queue
import re
import shutil
import string
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .record import Record, RecordKey, record_key

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "DumpFormatError",
    "Record",
    "RecordKey",
    "DumpLayout",
    "DumpWriteError",
    "DumpWriter",
    "WriterConfig",
    "flush_writers",
    "format_records",
    "list_steps",
    "load_dump",
    "record_key",
    "safe_component",
]

FORMAT_NAME = "probes-dump"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
OVERRIDE_HINT = "pass override_output_dir=True (DumpWriter(..., override=True)) or choose another directory"

_RANK_DIR_RE = re.compile(r"rank_(0|[1-9][0-9]*)")
_MANIFEST_RE = re.compile(re.escape(MANIFEST_NAME))
_MANIFEST_TEMP_RE = re.compile(r"\.manifest\.json\.[0-9]+\.[0-9]+\.tmp")
_STEP_FILE_RE = re.compile(r"step_([0-9]{6,})\.jsonl(\.partial)?")
_PROBE_FILE_NAME = ".write-test"
_BUFFER_SIZE = 1 << 16


class DumpWriteError(OSError):
    """The writer thread could not write the dump; ``path`` names the file, ``__cause__`` is the original error."""

    def __init__(self, message: str, path: Path | str, cause: BaseException | None = None) -> None:
        super().__init__(cause.errno if isinstance(cause, OSError) else None, message, str(path))
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.strerror)


class DumpFormatError(ValueError):
    """A file is not valid dump data; the message names the file, the 1-based line and the problem."""

    def __init__(self, path: Path | str, line: int | None, problem: str) -> None:
        where = f"{path}, line {line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")
        self.path = Path(path)
        self.line = line
        self.problem = problem


# --------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class DumpLayout:
    """File names inside an output directory (see the module docstring)."""

    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    def rank_dir(self, rank: int) -> Path:
        return self.root / f"rank_{rank}"

    def step_file(self, rank: int, step: int, *, partial: bool = False) -> Path:
        return self.rank_dir(rank) / (f"step_{step:06d}.jsonl" + (".partial" if partial else ""))

    def order_file(self, rank: int, step: int) -> Path:
        return self.rank_dir(rank) / f"step_{step:06d}.order.txt"


_SAFE_CHARS = frozenset(string.ascii_letters + string.digits + "-_.")


def safe_component(name: str, *, max_length: int = 100) -> str:
    """Turns any name into a single safe path component (a file or directory name).

    Every character other than ASCII letters, digits, '-', '_' and '.' is percent-escaped as UTF-8
    ('/' -> %2F, '\\' -> %5C, NUL -> %00, '%' -> %25), and so is a leading '.', so '.', '..' and hidden
    names cannot come out and different names give different components. A result longer than
    ``max_length`` is cut and ends with '~' and a hash of the whole name. Raises ValueError for ''.
    """
    if not isinstance(name, str):
        raise TypeError(f"safe_component needs a str, got {type(name).__name__}")
    if not name:
        raise ValueError("safe_component: an empty name cannot be a path component")
    if max_length < 32:
        raise ValueError(f"safe_component: max_length must be at least 32, got {max_length}")
    parts = []
    for index, char in enumerate(name):
        if char in _SAFE_CHARS and not (index == 0 and char == "."):
            parts.append(char)
        else:
            parts.append("".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass")))
    result = "".join(parts)
    if len(result) > max_length:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        result = result[: max_length - len(digest) - 1] + "~" + digest
    return result


# --------------------------------------------------------------------------------------------- writer


@dataclass(frozen=True)
class WriterConfig:
    output_dir: Path
    rank: int = 0
    override: bool = False
    queue_size: int = 4096

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {self.rank!r}")
        if isinstance(self.queue_size, bool) or not isinstance(self.queue_size, int) or self.queue_size < 1:
            raise ValueError(f"queue_size must be an int >= 1, got {self.queue_size!r}")


@dataclass
class _OpenStep:
    partial: Path
    file: BinaryIO
    order: list[tuple[Any, str]] = field(default_factory=list)  # (seq, order.txt line), in write order


# Work items for the writer thread: (kind, step, payload); flush, barrier and stop items carry _NO_STEP.
# A barrier is a reader's flush: it makes buffered lines visible but does not fsync.
_WRITE, _FINISH, _FLUSH, _BARRIER, _STOP = "write", "finish", "flush", "barrier", "stop"
_NO_STEP = -1

# The open writers of this process, so that readers can wait for them (see the module docstring).
_LIVE_WRITERS: weakref.WeakSet[DumpWriter] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _at_exit() -> bool:
    """True once the interpreter is exiting: atexit hooks run after the main thread has stopped."""
    return not threading.main_thread().is_alive()


def _resolved(path: str | Path) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):  # a symlink loop, an unreadable component: compare as given
        return Path(os.path.abspath(path))


def flush_writers(path: str | Path) -> None:
    """Waits until every live DumpWriter of this process writing into ``path`` has written what it got.

    Usage: ``flush_writers("pt_out")`` (``load_dump``, ``list_steps``, ``probes.compare`` and
    ``assert_parity`` already do this). ``path`` may be a dump directory, a rank directory or a step
    file. Never raises a writer's error: a failed writer's error belongs to the training thread.
    """
    with _LIVE_LOCK:
        writers = list(_LIVE_WRITERS)
    if not writers:
        return
    target = _resolved(path)
    for writer in writers:
        if writer._writes_into(target):
            writer._wait_written()


def _open_step_file(path: Path) -> BinaryIO:
    # Exclusive create: a step file is never appended to or overwritten. Tests replace this to inject faults.
    return open(path, "xb", buffering=_BUFFER_SIZE)


class DumpWriter:
    """Writes records off the training thread: a background thread, a bounded queue.

    ``write`` blocks while the queue is full (backpressure); records are never dropped.

    Output directory rules (checked at construction, before training starts):
      * missing or empty: used;
      * a probes dump (manifest.json present) without ``rank_<r>``: joined (other ranks of the same run);
      * a probes dump that already has ``rank_<r>``: FileExistsError, unless ``override=True``, which
        deletes that ``rank_<r>`` directory only (never other ranks' data: they may be writing right now);
      * anything else (a file, a non-empty directory without manifest): FileExistsError, even with
        ``override=True``. Arbitrary directories are never deleted.
    The directory is created and a test file written and removed, so an unwritable location fails here
    with PermissionError/OSError naming the path.

    Errors of the writer thread (disk full, ...) stop all further writing; finished steps stay intact
    and the unfinished ones stay ``.partial``. The error is raised as DumpWriteError on the next
    ``write``/``finish_step``/``flush`` call (every time), or by ``close`` if nothing reported it yet;
    at interpreter exit none of them raise, ``close`` prints one warning line instead. Readers of
    this process wait for the writer of the directory they read (see the module docstring).
    """

    def __init__(
        self, output_dir: str | Path, rank: int = 0, *, override: bool = False, queue_size: int = 4096
    ) -> None:
        self.config = WriterConfig(Path(output_dir), rank, override, queue_size)
        # Absolute: the writer thread opens files long after this call, maybe after an os.chdir().
        self.layout = DumpLayout(Path(os.path.abspath(self.config.output_dir)))
        _prepare_output_dir(self.layout, self.config.rank, self.config.override)
        self._resolved_root = _resolved(self.layout.root)
        self._queue: queue.Queue[tuple[str, int, Any]] = queue.Queue(maxsize=queue_size)
        self._finished: set[int] = set()
        self._lost: set[int] = set()  # steps given records or finished that did not reach a finished file
        self._error: DumpWriteError | None = None
        self._error_reported = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"probes-dump-writer-rank{rank}", daemon=True)
        self._thread.start()
        # The thread is a daemon (a forgotten close() must not hang the interpreter), so write what is
        # queued at exit; open steps stay unfinished because nobody said they were complete.
        atexit.register(self._close_at_exit)
        with _LIVE_LOCK:
            _LIVE_WRITERS.add(self)

    @property
    def error(self) -> BaseException | None:
        """The first error of the writer thread, as a DumpWriteError (the original is its ``__cause__``)."""
        return self._error

    @property
    def rank_dir(self) -> Path:
        return self.layout.rank_dir(self.config.rank)

    # ----------------------------------------------------------------------- training-thread API

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        """Queues one record of ``step``; records of a step reach the file in call order."""
        if not self._usable(step):
            return
        _check_step(step)
        if not isinstance(record, Mapping):
            raise TypeError(f"a record must be a dict, got {type(record).__name__}")
        if "name" not in record:
            raise ValueError("a record needs a 'name' key")
        if step in self._finished:
            raise ValueError(f"step {step} was already finished; its file cannot take more records")
        if record.get("step", step) != step:
            raise ValueError(f"record {record['name']!r} says step {record['step']!r} but was written to step {step}")
        if record.get("rank", self.config.rank) != self.config.rank:
            raise ValueError(
                f"record {record['name']!r} says rank {record['rank']!r} but this writer is rank {self.config.rank}"
            )
        # A shallow copy, so the caller may reuse its dict; nested values must not change after the call.
        self._put((_WRITE, step, dict(record)))

    def finish_step(self, step: int) -> None:
        """Queues the finalisation of ``step`` (flush, fsync, rename). A step without records writes no file."""
        if not self._usable(step):
            return
        _check_step(step)
        self._finished.add(step)
        self._put((_FINISH, step, None))

    def flush(self) -> None:
        """Blocks until everything queued so far is written and fsync'ed (open steps stay .partial)."""
        if self._closed or not self._usable(_NO_STEP):
            return
        done = threading.Event()
        self._put((_FLUSH, _NO_STEP, done))
        while not done.wait(0.5):
            self._check_thread_alive()
        self._usable(_NO_STEP)  # raises what the thread hit meanwhile

    def close(self, *, finish_open_steps: bool = True) -> None:
        """Writes everything queued, finishes every open step (unless told not to) and stops the thread.

        Idempotent. Raises the writer's error if no earlier call reported it; at interpreter exit it
        prints one warning line instead (see the module docstring).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self._close_at_exit)
            with _LIVE_LOCK:
                _LIVE_WRITERS.discard(self)
            self._put((_STOP, _NO_STEP, finish_open_steps))
            self._thread.join()
        if _at_exit():
            warning = self._exit_warning()
            if warning is not None:
                print(warning, file=sys.stderr, flush=True)
        elif not self._error_reported:
            self._raise_error()

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # After an exception the open step is probably incomplete: leave it visible as unfinished.
        self.close(finish_open_steps=exc_type is None)

    def _close_at_exit(self) -> None:
        try:
            self.close(finish_open_steps=False)
        except Exception as error:  # a traceback at exit helps nobody; the line says what happened
            print(f"probes: warning: closing the dump writer of {self.rank_dir} at exit failed: {error}",
                  file=sys.stderr, flush=True)

    def _usable(self, step: int) -> bool:
        """Whether a training-thread call may go ahead; raises when the writer is closed or failed.

        At interpreter exit it returns False instead of raising (the manager's atexit hook still
        finishes steps): the step is remembered as lost and close() warns once.
        """
        if self._closed:
            if _at_exit():
                return False
            raise RuntimeError(f"the DumpWriter of {self.rank_dir} is closed")
        if self._error is not None:
            if _at_exit():
                if step != _NO_STEP:
                    self._lost.add(step)
                return False
            self._raise_error()
        return True

    def _exit_warning(self) -> str | None:
        """The one line that says what could not be written, or None when nothing unreported was lost."""
        if self._error is not None and self._error_reported:
            return None  # the training thread was told
        lost = sorted(self._lost)
        if self._error is None and not lost:
            return None
        steps = (f"step {lost[0]} was" if len(lost) == 1 else f"steps {', '.join(map(str, lost))} were") \
            if lost else "the records queued at exit were"
        if not self.rank_dir.is_dir():
            return (f"probes: warning: the dump directory {self.layout.root} was removed before its writer "
                    f"(rank {self.config.rank}) was closed; {steps} not written.")
        return f"probes: warning: {str(self._error).removeprefix('probes dump: ')} At exit {steps} not finished."

    def _writes_into(self, target: Path) -> bool:
        """Whether ``target`` (resolved) is this writer's dump directory or lies inside it."""
        root = self._resolved_root
        return target == root or root in target.parents

    def _wait_written(self) -> None:
        """A reader's flush: waits for everything queued so far, never raises the writer's error."""
        if self._closed or self._error is not None or threading.current_thread() is self._thread:
            return
        done = threading.Event()
        if not self._put((_BARRIER, _NO_STEP, done), quiet=True):
            return
        while not done.wait(0.5):
            if not self._thread.is_alive():
                return  # closed meanwhile (the stop item came first) or failed: read what is there

    def _raise_error(self) -> None:
        error = self._error
        if error is not None:
            self._error_reported = True
            raise error.with_traceback(None)

    def _put(self, item: tuple[str, int, Any], *, quiet: bool = False) -> bool:
        """Queues ``item``, blocking while the queue is full; ``quiet``: False instead of raising."""
        while True:
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                if not quiet:
                    self._check_thread_alive()
                elif not self._thread.is_alive():
                    return False

    def _check_thread_alive(self) -> None:
        if not self._thread.is_alive():
            self._raise_error()
            raise RuntimeError(f"the dump writer thread of {self.rank_dir} has stopped")

    # ----------------------------------------------------------------------- writer thread

    def _run(self) -> None:
        open_steps: dict[int, _OpenStep] = {}
        while True:
            kind, step, payload = self._queue.get()
            try:
                if kind == _STOP:
                    self._shutdown(open_steps, finish=payload)
                    return
                if kind in (_FLUSH, _BARRIER):
                    if self._error is None:
                        self._sync_open_steps(open_steps, durable=kind == _FLUSH)
                    continue
                if self._error is not None:
                    self._lost.add(step)
                    continue  # drain without writing, so a blocked put() on the training thread returns
                if kind == _WRITE:
                    self._append(open_steps, step, payload)
                else:
                    self._finish(open_steps, step)
            except Exception as error:  # a bug here must still reach the training thread
                self._fail(error, self.rank_dir, "failed while writing", open_steps, step)
                if kind == _STOP:
                    return
            finally:
                if kind in (_FLUSH, _BARRIER):
                    payload.set()

    def _append(self, open_steps: dict[int, _OpenStep], step: int, record: dict[str, Any]) -> None:
        partial = self.layout.step_file(self.config.rank, step, partial=True)
        try:
            line = json.dumps(record).encode("ascii") + b"\n"
        except (TypeError, ValueError) as error:
            action = f"could not write record {record.get('name')!r} (not JSON-serialisable) to"
            self._fail(error, partial, action, open_steps, step)
            return
        entry = open_steps.get(step)
        try:
            if entry is None:
                entry = open_steps[step] = _OpenStep(partial, _open_step_file(partial))
            entry.file.write(line)
        except OSError as error:
            self._fail(error, partial, "could not write", open_steps, step)
            return
        entry.order.append((record.get("seq"), _order_line(record)))

    def _finish(self, open_steps: dict[int, _OpenStep], step: int) -> None:
        entry = open_steps.pop(step, None)
        if entry is None:
            return
        rank = self.config.rank
        path = entry.partial
        try:
            entry.file.flush()
            os.fsync(entry.file.fileno())
            entry.file.close()
            path = self.layout.order_file(rank, step)
            _write_durably(path, "".join(line + "\n" for line in _execution_order(entry.order)).encode("utf-8"))
            path = entry.partial
            os.replace(entry.partial, self.layout.step_file(rank, step))
            _fsync_dir(self.rank_dir)
        except OSError as error:
            _close_quietly(entry)
            self._fail(error, path, "could not finish step", open_steps, step)

    def _sync_open_steps(self, open_steps: dict[int, _OpenStep], *, durable: bool = True) -> None:
        for entry in open_steps.values():
            try:
                entry.file.flush()
                if durable:
                    os.fsync(entry.file.fileno())
            except OSError as error:
                self._fail(error, entry.partial, "could not flush", open_steps)
                return

    def _shutdown(self, open_steps: dict[int, _OpenStep], *, finish: bool) -> None:
        if self._error is None:
            if finish:
                for step in sorted(open_steps):
                    self._finish(open_steps, step)
            else:
                self._sync_open_steps(open_steps)
        if open_steps and not self.rank_dir.is_dir():
            self._lost.update(open_steps)  # synced into files that no longer have a name
        for entry in open_steps.values():
            _close_quietly(entry)
        open_steps.clear()

    def _fail(self, error: BaseException, path: Path, action: str, open_steps: dict[int, _OpenStep],
              step: int = _NO_STEP) -> None:
        if self._error is None:
            wrapped = DumpWriteError(self._failure_message(error, path, action), path, error)
            wrapped.__cause__ = error
            self._error = wrapped
        self._lost.update(open_steps)
        if step != _NO_STEP:
            self._lost.add(step)
        for entry in open_steps.values():
            _close_quietly(entry)
        open_steps.clear()

    def _failure_message(self, error: BaseException, path: Path, action: str) -> str:
        if isinstance(error, FileNotFoundError) and not self.rank_dir.is_dir():
            return (
                f"probes dump: {action} {path}: the dump directory {self.layout.root} (or its "
                f"{self.rank_dir.name}) was removed while the writer was open. Dumping stopped; keep the "
                "directory until the subscriber is closed (SubscriberManager.unsubscribe())."
            )
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        if not isinstance(error, OSError):
            reason = f"{type(error).__name__}: {reason}"
        return (
            f"probes dump: {action} {path}: {reason}. Dumping stopped; steps finished before this "
            f"error are intact, unfinished ones stay as .partial files in {self.rank_dir}."
        )


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")


def _order_line(record: Mapping[str, Any]) -> str:
    name = str(record["name"])
    phase = record.get("phase")
    line = f"{name}_{phase}" if phase else name
    return line.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _execution_order(order: list[tuple[Any, str]]) -> list[str]:
    # "seq" is the execution order; write order can differ when records are produced late.
    if order and all(isinstance(seq, int) and not isinstance(seq, bool) for seq, _ in order):
        return [line for _, line in sorted(order, key=lambda item: item[0])]  # stable: ties keep write order
    return [line for _, line in order]


def _close_quietly(entry: _OpenStep) -> None:
    try:
        entry.file.close()
    except OSError:
        pass


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    """Makes a rename in ``path`` durable; skipped where directories cannot be opened or fsync'ed."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of ``root`` if it is a probes dump manifest, else None."""
    try:
        manifest = json.loads(root.joinpath(MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME:
        return manifest
    return None


def _prepare_output_dir(layout: DumpLayout, rank: int, override: bool) -> None:
    """Applies the output directory rules of DumpWriter, then proves the rank directory is writable."""
    try:
        _check_existing_output_dir(layout, rank, override)
        _create_output_dir(layout, rank)
    except FileExistsError:
        raise
    except OSError as error:
        message = (
            f"cannot write the probes dump to {layout.root}: {error.strerror or error}. "
            "Choose a writable output directory or fix its permissions"
        )
        raise type(error)(error.errno, message, str(error.filename or layout.root)) from error


def _check_existing_output_dir(layout: DumpLayout, rank: int, override: bool) -> None:
    root = layout.root
    rank_dir = layout.rank_dir(rank)
    if not os.path.lexists(root):
        return
    if not root.is_dir():
        raise FileExistsError(
            errno.EEXIST, f"the output path {root} exists and is not a directory; {OVERRIDE_HINT}", str(root)
        )
    manifest = _read_manifest(root)
    if manifest is None and not all(_is_dump_entry(entry.name) for entry in root.iterdir()):
        raise FileExistsError(
            errno.EEXIST,
            f"the output directory {root} is not empty and is not a probes dump (no valid {MANIFEST_NAME}); "
            "choose another directory. override_output_dir=True only replaces earlier probes dumps, "
            "it never deletes other directories",
            str(root),
        )
    if manifest is not None and manifest.get("version") != FORMAT_VERSION:
        raise FileExistsError(
            errno.EEXIST,
            f"the output directory {root} holds a probes dump of format version {manifest.get('version')!r}, "
            f"this writer writes version {FORMAT_VERSION}; choose another directory",
            str(root),
        )
    if not os.path.lexists(rank_dir):
        return
    if not override:
        raise FileExistsError(
            errno.EEXIST, f"the output directory {root} already holds a dump of rank {rank}; {OVERRIDE_HINT}", str(root)
        )
    if rank_dir.is_symlink() or not rank_dir.is_dir():
        raise FileExistsError(
            errno.EEXIST, f"{rank_dir} is not a directory; not deleting it, remove it yourself", str(rank_dir)
        )
    shutil.rmtree(rank_dir)


def _is_dump_entry(name: str) -> bool:
    """Whether ``name`` is something a DumpWriter creates: another rank may be creating the dump now,
    its manifest still under a temporary name."""
    return any(pattern.fullmatch(name) for pattern in (_MANIFEST_RE, _RANK_DIR_RE, _MANIFEST_TEMP_RE))


def _create_output_dir(layout: DumpLayout, rank: int) -> None:
    root = layout.root
    rank_dir = layout.rank_dir(rank)
    root.mkdir(parents=True, exist_ok=True)
    if _read_manifest(root) is None:
        _write_manifest(root)
    try:
        rank_dir.mkdir()
    except FileExistsError as error:
        raise FileExistsError(
            errno.EEXIST,
            f"{rank_dir} appeared while opening: is another DumpWriter for rank {rank} using {root}?",
            str(rank_dir),
        ) from error
    probe = rank_dir / _PROBE_FILE_NAME
    _write_durably(probe, b"probes\n")
    probe.unlink()


def _write_manifest(root: Path) -> None:
    # Written to a unique temporary name and renamed, so a reader never sees half a manifest; ranks racing
    # here write identical content, so whichever rename lands last is fine.
    temporary = root / f".{MANIFEST_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
    _write_durably(temporary, (json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION}) + "\n").encode("utf-8"))
    os.replace(temporary, root / MANIFEST_NAME)
    _fsync_dir(root)


# --------------------------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class _StepFile:
    path: Path
    rank: int | None  # None: a lone step file outside a rank_<r> directory
    step: int
    finished: bool


def _scan(path: Path) -> tuple[list[int | None], list[_StepFile]]:
    """The ranks and step files under ``path`` (a dump dir, a rank dir or one step file), sorted."""
    if not os.path.lexists(path):
        raise FileNotFoundError(errno.ENOENT, f"no probes dump at {path}", str(path))
    if path.is_file():
        match = _STEP_FILE_RE.fullmatch(path.name)
        if match is None:
            expected = "expected step_<NNNNNN>.jsonl or step_<NNNNNN>.jsonl.partial"
            raise DumpFormatError(path, None, f"not a step file ({expected})")
        rank_match = _RANK_DIR_RE.fullmatch(path.parent.name)
        rank = int(rank_match[1]) if rank_match else None
        return [rank], [_StepFile(path, rank, int(match[1]), match[2] is None)]
    if os.path.lexists(path / MANIFEST_NAME):
        manifest = _read_manifest(path)
        if manifest is None:
            raise DumpFormatError(
                path / MANIFEST_NAME, None, f"not a probes dump manifest (expected format {FORMAT_NAME!r})"
            )
        if manifest.get("version") != FORMAT_VERSION:
            raise DumpFormatError(
                path / MANIFEST_NAME,
                None,
                f"format version {manifest.get('version')!r}; this reader reads {FORMAT_VERSION}",
            )
        rank_dirs = [
            (int(match[1]), child)
            for child in path.iterdir()
            if (match := _RANK_DIR_RE.fullmatch(child.name)) and child.is_dir()
        ]
    elif match := _RANK_DIR_RE.fullmatch(path.name):
        rank_dirs = [(int(match[1]), path)]
    else:
        raise DumpFormatError(path, None, f"not a probes dump: no {MANIFEST_NAME} and not a rank_<r> directory")
    rank_dirs.sort(key=lambda item: item[0])
    files: list[_StepFile] = []
    for rank, directory in rank_dirs:
        found: dict[tuple[int, bool], Path] = {}
        for child in directory.iterdir():
            match = _STEP_FILE_RE.fullmatch(child.name)
            if match and f"{int(match[1]):06d}" == match[1] and child.is_file():
                found[(int(match[1]), match[2] is None)] = child
        for (step, finished), file_path in sorted(found.items()):
            if not finished and (step, True) in found:
                continue  # a finished file supersedes a leftover partial of the same step
            files.append(_StepFile(file_path, rank, step, finished))
    return [rank for rank, _ in rank_dirs], files


def _parse_line(step_file: _StepFile, number: int, raw: bytes) -> dict[str, Any]:
    path = step_file.path
    if not raw.strip():
        raise DumpFormatError(path, number, "empty line")
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise DumpFormatError(path, number, f"not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise DumpFormatError(path, number, f"invalid JSON: {error.msg} at column {error.colno}") from None
    if not isinstance(record, dict):
        raise DumpFormatError(path, number, f"expected a JSON object, found {type(record).__name__}")
    if "name" not in record:
        raise DumpFormatError(path, number, "missing key 'name'")
    for key, expected in (("step", step_file.step), ("rank", step_file.rank)):
        if expected is None:
            if key not in record:
                problem = f"missing key {key!r} (and the file is not inside a rank_<r> directory)"
                raise DumpFormatError(path, number, problem)
        elif key not in record:
            record[key] = expected
        elif record[key] != expected:
            problem = f"the record says {key} {record[key]!r} but the file belongs to {key} {expected}"
            raise DumpFormatError(path, number, problem)
    return record


def _read_step_file(step_file: _StepFile) -> list[dict[str, Any]]:
    lines = step_file.path.read_bytes().split(b"\n")
    tail = lines.pop()  # what follows the last newline: b"" unless the last line was cut short
    records = [_parse_line(step_file, number, raw) for number, raw in enumerate(lines, 1)]
    if tail and step_file.finished:
        raise DumpFormatError(
            step_file.path, len(lines) + 1, "truncated last line (no newline at the end of a finished step file)"
        )
    # In a .partial file an unterminated last line is the write a crash interrupted: skipped.
    return records


def load_dump(path: str | Path, *, include_partial: bool = False) -> list[dict[str, Any]]:
    """Reads the records of a dump directory (all ranks), a rank_<r> directory or a single step file.

    Records come sorted by (rank, step, line in the file); each has 'rank' and 'step'. Unfinished
    (.partial) steps are skipped unless ``include_partial``, which loads their complete lines.
    Live writers of this process into ``path`` are waited for first (``flush_writers``).
    Raises DumpFormatError naming the file and line for invalid data.
    """
    flush_writers(path)
    return _load_dump(Path(path), include_partial=include_partial)


def _load_dump(path: Path, *, include_partial: bool = False) -> list[dict[str, Any]]:
    """``load_dump`` without waiting for live writers (the caller did)."""
    _, files = _scan(path)
    if path.is_file() and not files[0].finished and not include_partial:
        raise ValueError(f"{path} is an unfinished step; load it with include_partial=True (show: --include-partial)")
    records: list[dict[str, Any]] = []
    for step_file in files:
        if step_file.finished or include_partial:
            records.extend(_read_step_file(step_file))
    return records


def list_steps(path: str | Path) -> dict[int | None, dict[str, list[int]]]:
    """``{rank: {"finished": [steps], "unfinished": [steps]}}`` for the dump at ``path``, steps sorted.

    Live writers of this process into ``path`` are waited for first (``flush_writers``).
    """
    flush_writers(path)
    return _list_steps(Path(path))


def _list_steps(path: Path) -> dict[int | None, dict[str, list[int]]]:
    """``list_steps`` without waiting for live writers (the caller did)."""
    ranks, files = _scan(path)
    result: dict[int | None, dict[str, list[int]]] = {rank: {"finished": [], "unfinished": []} for rank in ranks}
    for step_file in files:
        result[step_file.rank]["finished" if step_file.finished else "unfinished"].append(step_file.step)
    return result


# --------------------------------------------------------------------------------------------- display

_COLUMNS = ("step", "phase", "seq", "name", "shape", "dtype", "min", "max", "mean", "std", "nan", "inf")
_LEFT_ALIGNED = frozenset({"phase", "name", "shape", "dtype"})


def _printable(text: str) -> str:
    # Names come from the model: keep control characters from reaching the terminal.
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _cell(record: Mapping[str, Any], key: str) -> str:
    if key not in record:
        return ""
    value = record[key]
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if key == "shape" and isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(size) for size in value) + "]"
    return _printable(str(value))


def format_records(records: Iterable[Mapping[str, Any]]) -> str:
    """A text table, one line per record: step, phase, seq, name, shape, dtype, min, max, mean, std, nan, inf.

    A rank column comes first when the records span several ranks. No trailing newline.
    """
    records = list(records)
    columns = list(_COLUMNS)
    if len({record.get("rank") for record in records}) > 1:
        columns.insert(0, "rank")
    rows = [columns] + [[_cell(record, column) for column in columns] for record in records]
    widths = [max(len(row[index]) for row in rows) for index in range(len(columns))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if column in _LEFT_ALIGNED else cell.rjust(width)
            for column, cell, width in zip(columns, row, widths)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
