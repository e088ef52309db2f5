"""Per-step text summaries of two runs in the baseline's order, like onnxruntime's merge_activation_summary.

    python -m probes merge --pt_dir pt_out --ort_dir ort_out --output_dir merged [--overwrite]

The original tool's flags (``probes.cli.merge``; ``python -m probes.merge_activation_summary`` too), on probes
dumps: ``<output_dir>/merge_pt/step_<N>_.txt`` and ``merge_ort/step_<N>_.txt`` hold one block per record (the
original's layout) in the baseline's order of that step, so that a plain ``diff`` lines up. Deliberately unlike
the original: each step has its own order (not step 0's); ORT records missing from the baseline are appended (not
dropped), and records missing from either run are warned about once per step; ``--overwrite`` replaces merge_pt/
and merge_ort/ only (not the whole directory); one rank (``--rank``); samples are those the dump kept, labelled with
their flat indices. For a numeric comparison, ``probes compare``.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..dump import Record
from ..dump.legacy import legacy_block
from ..dump.record import execution_order
from ..utils.flags import option, settle

logger = logging.getLogger("probes.merge_activation_summary")

OrderKey = tuple[str, str]  # name, phase


@dataclass(frozen=True)
class MergeConfig:
    """What to merge and where; each field is also a flag of ``probes merge`` (``probes.utils.flags``)."""

    pt_dir: Path = option(flag="--pt_dir", convert=Path, help="root of the PyTorch (baseline) run's probes dump")
    ort_dir: Path = option(flag="--ort_dir", convert=Path, help="root of the ORTModule run's probes dump")
    output_dir: Path = option(flag="--output_dir", convert=Path, help="where merge_pt/ and merge_ort/ are written")
    overwrite: bool = option(False, help="replace merge_pt/ and merge_ort/ if present")
    rank: int | None = option(None, help="the rank to merge (default: the baseline's lowest rank)")

    def __post_init__(self) -> None:
        settle(self)


def _by_step(records: Sequence[Record], rank: int) -> dict[int, dict[OrderKey, Record]]:
    steps: dict[int, dict[OrderKey, Record]] = {}
    ordered = sorted((r for r in records if r["rank"] == rank),
                     key=lambda r: execution_order(r["step"], r.get("phase", ""), r.get("seq"), r["rank"]))
    for record in ordered:
        steps.setdefault(record["step"], {})[(record["name"], record.get("phase", ""))] = record
    return steps


def _write_run(destination: Path, label: str, steps: Mapping[int, Mapping[OrderKey, Record]],
               order_of: Mapping[int, list[OrderKey]], fallback: list[OrderKey]) -> None:
    destination.mkdir(parents=True)
    for step, records in sorted(steps.items()):
        order = order_of.get(step, fallback)
        missing = [key for key in order if key not in records]
        extra = [key for key in records if key not in set(order)]
        if missing:
            logger.warning("%s step %d: %d records of the baseline's order are missing (first: %s_%s)",
                           label, step, len(missing), *missing[0])
        if extra:
            logger.warning("%s step %d: %d records are not in the baseline's order; appended at the end (first: %s_%s)",
                           label, step, len(extra), *extra[0])
        with (destination / f"step_{step}_.txt").open("w", encoding="utf-8") as out:
            for key in [*order, *extra]:
                if key in records:
                    out.write(legacy_block(records[key]))
                    out.write("\n")


def generate_summaries_per_step(config: MergeConfig, base_records: Sequence[Record],
                                other_records: Sequence[Record]) -> None:
    """Writes merge_pt/ and merge_ort/ under ``config.output_dir`` (prepared by ``prepare_output_dir``)."""
    ranks = sorted({r["rank"] for r in base_records})
    rank = config.rank if config.rank is not None else (ranks[0] if ranks else 0)
    if len(ranks) > 1:
        logger.warning("the baseline has ranks %s; merging rank %d (choose with --rank)", ranks, rank)
    base = _by_step(base_records, rank)
    other = _by_step(other_records, rank)
    order_of = {step: list(records) for step, records in base.items()}
    fallback = order_of[min(order_of)] if order_of else []
    for label, steps, name in (("pt", base, "merge_pt"), ("ort", other, "merge_ort")):
        destination = config.output_dir / name
        logger.warning("writing per-step summaries of %s to %s", label, destination)
        _write_run(destination, label, steps, order_of, fallback)


def prepare_output_dir(config: MergeConfig) -> None:
    """Refuses an existing output directory unless --overwrite, which replaces merge_pt/ and merge_ort/ only."""
    output = config.output_dir
    if os.path.lexists(output) and not output.is_dir():
        raise FileExistsError(f"Output path {output} exists and is not a directory.")
    if output.exists():
        if not config.overwrite:
            raise FileExistsError(
                f"Output directory {output} already exists. Enable --overwrite to allow overwriting it.")
        logger.warning("Output directory %s already exists, overwriting merge_pt and merge_ort in it.", output)
        for name in ("merge_pt", "merge_ort"):
            target = output / name
            if target.is_symlink() or target.is_file():
                target.unlink()
            elif target.exists():
                shutil.rmtree(target)
    output.mkdir(parents=True, exist_ok=True)
