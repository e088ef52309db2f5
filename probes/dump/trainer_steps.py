"""The trainer's step beside the probes' own: which optimizer update each recorded step belongs to.

    log = TrainerStepLog(Path("out"), rank=0)
    log.append([TrainerStep(step=4, trainer_step=3, micro_step=0, epoch=0.75)])
    read_trainer_steps("out")              # {rank: {4: TrainerStep(step=4, trainer_step=3, ...)}}

A probes step is one forward and its backward: one micro-batch. A trainer (Hugging Face ``Trainer``,
Lightning) counts optimizer updates instead, so under gradient accumulation several probes steps make
one trainer step. The trainer callbacks (``probes.integrations``) write the mapping as they go, one JSON
object per probes step in ``<dump>/rank_<r>/trainer_steps.jsonl``:

    {"step": 4, "trainer_step": 3, "micro_step": 0, "epoch": 0.75}

- ``trainer_step``: the trainer's own count of updates once this step's update is done (the number
  its logs show, Hugging Face's ``state.global_step``, Lightning's ``trainer.global_step``); None when
  training ended before that update.
- ``micro_step``: the step's position among the micro-batches of that update (0-based).
- ``epoch``: the trainer's epoch when the update was done (Hugging Face: fractional), or None.

Lines are appended per update (flushed, not fsync'ed: the training thread does not wait for the disk),
so a crash of the process loses nothing and a cut last line, if any, is skipped by readers.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from .layout import DumpFormatError, DumpLayout, TRAINER_STEPS_NAME, RANK_DIR_RE


@dataclass(frozen=True, kw_only=True)
class TrainerStep:
    """One probes step's place in the trainer's numbering (see the module docstring)."""

    step: int
    trainer_step: int | None
    micro_step: int
    epoch: float | None = None

    def describe(self) -> str:
        """``"trainer step 3, micro-batch 0"`` (how reports show it)."""
        update = "before any trainer step ended" if self.trainer_step is None else f"trainer step {self.trainer_step}"
        return f"{update}, micro-batch {self.micro_step}"


class TrainerStepLog:
    """Appends a rank's ``TrainerStep`` entries to its file in the dump (one writer per rank and dump)."""

    def __init__(self, root: Path, *, rank: int) -> None:
        self.path = DumpLayout(Path(root)).trainer_steps_file(rank)

    def append(self, entries: Iterable[TrainerStep]) -> None:
        lines = "".join(json.dumps(asdict(entry), allow_nan=False) + "\n" for entry in entries)
        if not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as stream:
            stream.write(lines)  # closing flushes: a crash of the process loses nothing; no fsync on the
            # training thread (the step files are made durable by the writer's thread)

    def clear(self) -> None:
        """Start the file again (a new run writing into the same dump with ``override_output_dir``)."""
        self.path.unlink(missing_ok=True)


def read_trainer_steps(path: str | os.PathLike) -> dict[int, dict[int, TrainerStep]]:
    """Every rank's mapping from probes step to ``TrainerStep``; ranks without a file are left out.

    ``path`` is what the readers take: a dump directory, a ``rank_<r>`` directory or a step file (then
    its rank only). A cut last line (a crash while appending) is skipped; any other bad line is a
    ``DumpFormatError``.
    """
    path = Path(path)
    if path.is_file():
        path = path.parent
    if RANK_DIR_RE.fullmatch(path.name):
        rank_dirs = [path]
    elif path.is_dir():
        rank_dirs = sorted(path.iterdir())
    else:
        return {}
    found: dict[int, dict[int, TrainerStep]] = {}
    for rank_dir in rank_dirs:
        match = RANK_DIR_RE.fullmatch(rank_dir.name)
        log = rank_dir / TRAINER_STEPS_NAME
        if match and log.is_file():
            found[int(match.group(1))] = _read(log)
    return found


def _read(path: Path) -> dict[int, TrainerStep]:
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines and not data.endswith(b"\n"):
        lines.pop()  # cut by a crash while appending
    steps: dict[int, TrainerStep] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            entry = TrainerStep(step=fields["step"], trainer_step=fields["trainer_step"],
                                micro_step=fields["micro_step"], epoch=fields.get("epoch"))
        except (ValueError, KeyError, TypeError) as error:
            raise DumpFormatError(path, number, f"not a trainer step entry ({error})") from None
        if not isinstance(entry.step, int) or isinstance(entry.step, bool):
            raise DumpFormatError(path, number, f"'step' must be an integer, got {entry.step!r}")
        steps[entry.step] = entry
    return steps
