"""The dump format on disk: names, the manifest, the directory rules, and the two errors.

    layout = DumpLayout(Path("pt_out"))
    layout.step_file(rank=0, step=3)          # pt_out/rank_0/step_000003.parquet
    layout.step_file(rank=0, step=3, format="jsonl")   # pt_out/rank_0/step_000003.jsonl
    prepare_output_dir(layout, 0, override=False)   # what DumpWriter does before its thread starts

Layout of an output directory D (one writer per rank, all ranks may share D):

    D/manifest.json                          {"format": "probes-dump", "version": 2}; marks D as a dump
    D/rank_<r>/step_<NNNNNN>.parquet         a finished step (the default format): one row per record, the
                                             columns of ``probes.dump.columns.SCHEMA``, in write order; the
                                             footer's key-value metadata "probes.records" is the record count
    D/rank_<r>/step_<NNNNNN>.parquet.partial/part_<KKKKKK>.parquet
                                             a step still being written, or left unfinished by a crash: each
                                             sync's records, one Parquet part each (the journal)
    D/rank_<r>/step_<NNNNNN>.jsonl           a finished step of the JSON Lines format (``format="jsonl"``,
                                             and every dump of version 1): one JSON object per line
    D/rank_<r>/step_<NNNNNN>.jsonl.partial   a JSON Lines step still being written (and, in dumps written
                                             before the Parquet journal, an unfinished Parquet-format step)
    D/rank_<r>/step_<NNNNNN>.order.txt       a JSON Lines step's records in execution order, one "<name>_<phase>"
                                             per line (like order.txt of onnxruntime's StatisticsSubscriber);
                                             dumps written before the footer count have one per Parquet step too
    D/rank_<r>/trainer_steps.jsonl           only under a trainer callback: one JSON object per probes step,
                                             the trainer's step it belongs to (``probes.dump.trainer_steps``)

<NNNNNN> is the step number zero-padded to six digits (more digits once steps reach a million).
Paths contain only rank and step numbers; names from the model appear only inside files.
A step is finished by writing its file under a temporary name (a .partial or a .parquet.tmp), fsync'ing
and renaming it, so a crash loses at most the steps not finished yet and never damages a finished one.
JSON lines are standard JSON except that non-finite floats are written as NaN / Infinity / -Infinity
(Python's json reads them back). Version 2 added the Parquet step files; readers read versions 1 and 2,
and a writer joining a version 1 dump (another rank, an override) marks it version 2.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import string
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_NAME = "probes-dump"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
STEP_FORMATS = ("parquet", "jsonl")
MANIFEST_NAME = "manifest.json"
TRAINER_STEPS_NAME = "trainer_steps.jsonl"
OVERRIDE_HINT = "pass override_output_dir=True (DumpWriter(..., override=True)) or choose another directory"

RANK_DIR_RE = re.compile(r"rank_(0|[1-9][0-9]*)")
STEP_FILE_RE = re.compile(r"step_([0-9]{6,})\.(parquet|jsonl)(\.partial)?")  # step, format, unfinished
_MANIFEST_RE = re.compile(re.escape(MANIFEST_NAME))
_MANIFEST_TEMP_RE = re.compile(r"\.manifest\.json\.[0-9]+\.[0-9]+\.tmp")
_PROBE_FILE_NAME = ".write-test"


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


@dataclass(frozen=True)
class DumpLayout:
    """File names inside an output directory (see the module docstring)."""

    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    def rank_dir(self, rank: int) -> Path:
        return self.root / f"rank_{rank}"

    def step_file(self, rank: int, step: int, *, partial: bool = False, format: str = "parquet") -> Path:
        """A finished step file of ``format``; ``partial``: the step being written (parquet: the journal directory)."""
        return self.rank_dir(rank) / f"step_{step:06d}.{format}{'.partial' if partial else ''}"

    def temporary_file(self, rank: int, step: int) -> Path:
        """Where a Parquet step is written before its rename; readers never list it."""
        return self.rank_dir(rank) / f"step_{step:06d}.parquet.tmp"

    def order_file(self, rank: int, step: int) -> Path:
        """A JSON Lines step's record list (and a Parquet step's, in dumps written before the footer held the count)."""
        return self.rank_dir(rank) / f"step_{step:06d}.order.txt"

    def trainer_steps_file(self, rank: int) -> Path:
        """Which trainer step each probes step belongs to (written by the trainer callbacks)."""
        return self.rank_dir(rank) / TRAINER_STEPS_NAME


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


# --------------------------------------------------------------------------------------------- files


def write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def fsync_dir(path: Path) -> None:
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


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of ``root`` if it is a probes dump manifest, else None."""
    try:
        manifest = json.loads(root.joinpath(MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME:
        return manifest
    return None


# --------------------------------------------------------------------------------------------- directory rules


def prepare_output_dir(layout: DumpLayout, rank: int, *, override: bool) -> None:
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
    manifest = read_manifest(root)
    if manifest is None and not all(_is_dump_entry(entry.name) for entry in root.iterdir()):
        raise FileExistsError(
            errno.EEXIST,
            f"the output directory {root} is not empty and is not a probes dump (no valid {MANIFEST_NAME}); "
            "choose another directory. override_output_dir=True only replaces earlier probes dumps, "
            "it never deletes other directories",
            str(root),
        )
    if manifest is not None and manifest.get("version") not in READABLE_VERSIONS:
        raise FileExistsError(
            errno.EEXIST,
            f"the output directory {root} holds a probes dump of format version {manifest.get('version')!r}, "
            f"this writer writes version {FORMAT_VERSION} (and joins version 1); choose another directory",
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
    return any(pattern.fullmatch(name) for pattern in (_MANIFEST_RE, RANK_DIR_RE, _MANIFEST_TEMP_RE))


def _create_output_dir(layout: DumpLayout, rank: int) -> None:
    root = layout.root
    rank_dir = layout.rank_dir(rank)
    root.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(root)
    if manifest is None or manifest.get("version") != FORMAT_VERSION:
        _write_manifest(root)  # version 2 reads every version 1 file: the upgrade only widens what may follow
    try:
        rank_dir.mkdir()
    except FileExistsError as error:
        raise FileExistsError(
            errno.EEXIST,
            f"{rank_dir} appeared while opening: is another DumpWriter for rank {rank} using {root}?",
            str(rank_dir),
        ) from error
    probe = rank_dir / _PROBE_FILE_NAME
    write_durably(probe, b"probes\n")
    probe.unlink()


def _write_manifest(root: Path) -> None:
    # Written to a unique temporary name and renamed, so a reader never sees half a manifest; ranks racing
    # here write identical content, so whichever rename lands last is fine.
    temporary = root / f".{MANIFEST_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
    write_durably(temporary, (json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION}) + "\n").encode("utf-8"))
    os.replace(temporary, root / MANIFEST_NAME)
    fsync_dir(root)
