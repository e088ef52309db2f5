"""The background writer: records leave the training thread at once and reach the disk, a Parquet file per step.

    writer = DumpWriter("pt_out", rank=0)             # raises now if the directory is unusable
    writer.write(step, block)                         # a RowBlock (StepRows.take()), or an Arrow table of SCHEMA
    writer.finish_step(step)                          # the step becomes visible to readers
    writer.close()

    ring = DumpWriter("pt_out", rank=0, keep_last=8)  # only the newest 8 finished steps stay on disk
    ring.keep_all()                                   # from now on nothing is removed (an anomaly was found)
    text = DumpWriter("pt_out", rank=0, format="jsonl")  # step files in JSON Lines instead

Nothing is pickled: records travel to the writer thread as the statistics rows of a ``RowBlock`` (host
copies of the device rows), become an Arrow table there and reach the disk as Parquet (or JSON Lines); the
layout is in ``probes.dump.layout``, the columns in ``probes.dump.columns``; what a reader of this process
waits for, in ``probes.dump.live``.

Interpreter exit: a writer that is still open is closed in the "writers" stage of
``probes.utils.at_exit`` (after the subscriptions finished their open steps). If something could not
be written by then (the directory was removed, the disk filled up and nobody was told yet), that is
one warning (``warnings.warn``) naming the directory and the steps lost, never a traceback. Calls made at
exit on a closed or failed writer are dropped the same way.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from ..utils.checks import check_int
from ..utils.exit import at_exit
from .columns import SCHEMA
from .layout import STEP_FORMATS, DumpLayout, DumpWriteError, prepare_output_dir
from .live import add_live, discard_live, resolved
from .rowblock import RowBlock
from .stepfiles import OpenSteps, StepFileError

__all__ = ["DumpWriter", "WriterConfig"]


@dataclass(frozen=True)
class WriterConfig:
    output_dir: Path
    rank: int = 0
    override: bool = False
    queue_size: int = 4096
    keep_last: int | None = None  # a ring buffer: only the newest N finished steps stay on disk
    # Called on the writer thread with (step, finished step file) after each step is finished; e.g. a live
    # TensorBoard export. It must not wait for this writer (read with DumpReader(path, wait=False)).
    on_step_written: Callable[[int, Path], None] | None = None
    format: str = "parquet"  # of finished step files: "parquet" or "jsonl" (probes.dump.layout)

    def __post_init__(self) -> None:
        if self.format not in STEP_FORMATS:
            raise ValueError(f"unknown dump format {self.format!r}; expected one of {', '.join(STEP_FORMATS)}")
        check_int(self.rank, "rank")
        check_int(self.queue_size, "queue_size", minimum=1)
        if self.keep_last is not None:
            check_int(self.keep_last, "keep_last (or None)", minimum=1)


# Work items for the writer thread: (kind, step, payload); flush, barrier, stop and keep-all items carry _NO_STEP.
# A barrier is a reader's flush: it makes buffered lines visible but does not fsync.
_WRITE, _FINISH, _FLUSH, _BARRIER, _STOP, _KEEP_ALL = "write", "finish", "flush", "barrier", "stop", "keep all"
_NO_STEP = -1
_LOG = logging.getLogger(__name__)


def _at_exit() -> bool:
    """True once the interpreter is exiting: exit hooks run after the main thread has stopped."""
    return not threading.main_thread().is_alive()


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
    at interpreter exit none of them raise, ``close`` warns once instead. Readers of
    this process wait for the writer of the directory they read (see ``probes.dump.live``).
    """

    def __init__(
        self, output_dir: str | Path, rank: int = 0, *, override: bool = False, queue_size: int = 4096,
        keep_last: int | None = None, on_step_written: Callable[[int, Path], None] | None = None,
        format: str = "parquet",
    ) -> None:
        self.config = WriterConfig(Path(output_dir), rank, override, queue_size, keep_last, on_step_written, format)
        # Absolute: the writer thread opens files long after this call, maybe after an os.chdir().
        self.layout = DumpLayout(Path(os.path.abspath(self.config.output_dir)))
        prepare_output_dir(self.layout, self.config.rank, override=self.config.override)
        self._resolved_root = resolved(self.layout.root)
        self._queue: queue.Queue[tuple[str, int, Any]] = queue.Queue(maxsize=queue_size)
        self._steps = OpenSteps(self.layout, rank=self.config.rank, format=format)  # used on the writer thread only
        self._finished: set[int] = set()
        self._kept: collections.deque[int] = collections.deque()  # finished step files, oldest first (ring only)
        self._pruning = keep_last is not None
        self._listener_failed = False
        self._lost: set[int] = set()  # steps given records or finished that did not reach a finished file
        self._error: DumpWriteError | None = None
        self._error_reported = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"probes-dump-writer-rank{rank}", daemon=True)
        self._thread.start()
        # The thread is a daemon (a forgotten close() must not hang the interpreter), so write what is
        # queued at exit; open steps stay unfinished because nobody said they were complete.
        self._exit_handle = at_exit("writers", self._close_at_exit)
        add_live(self)

    @property
    def error(self) -> BaseException | None:
        """The first error of the writer thread, as a DumpWriteError (the original is its ``__cause__``)."""
        return self._error

    @property
    def rank_dir(self) -> Path:
        return self.layout.rank_dir(self.config.rank)

    # ----------------------------------------------------------------------- training-thread API

    def write(self, step: int, batch: RowBlock | pa.Table) -> None:
        """Queues records of ``step``: a ``RowBlock`` (its rows become an Arrow table on the writer thread) or an
        Arrow table of ``probes.dump.columns.SCHEMA`` (``records_to_table``); a step's batches reach its file in
        call order."""
        if not self._usable(step):
            return
        check_int(step, "step")
        if step in self._finished:
            raise ValueError(f"step {step} was already finished; its file cannot take more records")
        if isinstance(batch, RowBlock):
            steps, ranks = [batch.step], [batch.rank]
        elif isinstance(batch, pa.Table):
            if not batch.schema.equals(SCHEMA):
                raise TypeError("a table written to a dump needs the columns of probes.dump.columns.SCHEMA "
                                "(build it with records_to_table)")
            steps, ranks = pc.unique(batch.column("step")).to_pylist(), pc.unique(batch.column("rank")).to_pylist()
        else:
            raise TypeError(f"DumpWriter.write takes a RowBlock or an Arrow table, got {type(batch).__name__}")
        if steps not in ([], [step]) or ranks not in ([], [self.config.rank]):
            raise ValueError(f"records of step {steps} and rank {ranks} were written to step {step} of rank "
                             f"{self.config.rank}")
        self._put((_WRITE, step, batch))

    def finish_step(self, step: int) -> None:
        """Queues the finalisation of ``step`` (flush, fsync, rename). A step without records writes no file."""
        if not self._usable(step):
            return
        check_int(step, "step")
        self._finished.add(step)
        self._put((_FINISH, step, None))

    def keep_all(self) -> None:
        """Stops the ring buffer (``keep_last``): no finished step is removed after this call.

        The sentinel calls it when it finds an anomaly, so that step and the ones before it stay. It is
        queued like a record, so the steps finished before the call are pruned exactly as without it.
        """
        if self.config.keep_last is not None and self._usable(_NO_STEP):
            self._put((_KEEP_ALL, _NO_STEP, None))

    def flush(self) -> None:
        """Blocks until everything queued so far is written and fsync'ed (open steps: their journals)."""
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
        warns once instead (see the module docstring).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._exit_handle.remove()
            discard_live(self)
            self._put((_STOP, _NO_STEP, finish_open_steps))
            self._thread.join()
        if _at_exit():
            warning = self._exit_warning()
            if warning is not None:
                warnings.warn(warning, RuntimeWarning, stacklevel=2)
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
        except Exception as error:  # a traceback at exit helps nobody; the warning says what happened
            warnings.warn(f"closing the dump writer of {self.rank_dir} at exit failed: {error}", RuntimeWarning,
                          stacklevel=2)

    def _usable(self, step: int) -> bool:
        """Whether a training-thread call may go ahead; raises when the writer is closed or failed.

        At interpreter exit it returns False instead of raising (the subscriptions' exit hook still
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
            return (f"probes: the dump directory {self.layout.root} was removed before its writer "
                    f"(rank {self.config.rank}) was closed; {steps} not written.")
        return f"probes: {str(self._error).removeprefix('probes dump: ')} At exit {steps} not finished."

    def writes_into(self, target: Path) -> bool:
        """Whether ``target`` (resolved) is this writer's dump directory or lies inside it."""
        root = self._resolved_root
        return target == root or root in target.parents

    def wait_written(self) -> None:
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
        while True:
            kind, step, payload = self._queue.get()
            try:
                if kind == _STOP:
                    self._shutdown(finish=payload)
                    return
                if kind in (_FLUSH, _BARRIER):
                    if self._error is None:
                        with self._stop_on_failure():
                            self._steps.sync(durable=kind == _FLUSH)
                    continue
                if kind == _KEEP_ALL:
                    self._pruning = False
                    continue
                if self._error is not None:
                    self._lost.add(step)
                    continue  # drain without writing, so a blocked put() on the training thread returns
                with self._stop_on_failure(step):
                    if kind == _WRITE:
                        self._steps.append(step, payload)
                    elif self._steps.finish(step):
                        self._step_written(step)
                        if self.config.keep_last is not None:
                            self._prune(step)
            except Exception as error:  # a bug here must still reach the training thread
                self._fail(error, self.rank_dir, "failed while writing", step)
                if kind == _STOP:
                    return
            finally:
                if kind in (_FLUSH, _BARRIER):
                    payload.set()

    def _step_written(self, step: int) -> None:
        """``on_step_written``: its failure is logged once and it is not called again, never a lost step."""
        listener = self.config.on_step_written
        if listener is None or self._listener_failed:
            return
        try:
            listener(step, self.layout.step_file(self.config.rank, step, format=self.config.format))
        except Exception as error:
            self._listener_failed = True
            _LOG.warning("on_step_written (%r) failed on step %d of %s: %s: %s; it is not called again, the dump "
                         "goes on", getattr(listener, "__qualname__", listener), step, self.rank_dir,
                         type(error).__name__, error)

    def _prune(self, finished: int) -> None:
        """The ring buffer: removes the oldest finished steps beyond ``keep_last`` (unless ``keep_all``)."""
        self._kept.append(finished)
        while self._pruning and len(self._kept) > self.config.keep_last:
            self._steps.remove_finished(self._kept.popleft())

    def _shutdown(self, *, finish: bool) -> None:
        if self._error is None:
            if finish:
                for step in sorted(self._steps.steps()):
                    with self._stop_on_failure(step):
                        self._steps.finish(step)
            else:
                with self._stop_on_failure():
                    self._steps.sync()
        if self._steps.steps() and not self.rank_dir.is_dir():
            self._lost.update(self._steps.steps())  # synced into files that no longer have a name
        self._steps.close()

    @contextmanager
    def _stop_on_failure(self, step: int = _NO_STEP) -> Iterator[None]:
        """A step file that cannot be written stops the writer (``_fail``); ``step``: the one at hand."""
        try:
            yield
        except StepFileError as error:
            self._fail(error.cause, error.path, error.action, step)

    def _fail(self, error: BaseException, path: Path, action: str, step: int = _NO_STEP) -> None:
        if self._error is None:
            wrapped = DumpWriteError(self._failure_message(error, path, action), path, error)
            wrapped.__cause__ = error
            self._error = wrapped
        self._lost.update(self._steps.steps())
        if step != _NO_STEP:
            self._lost.add(step)
        self._steps.close()

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
            f"error are intact, unfinished ones stay .partial (what was synced of them) in {self.rank_dir}."
        )
