"""Reading a dump for comparison: its records keyed by (rank, step, phase, name), after the filters.

    loaded = read_dump("pt_out", CompareConfig(steps=frozenset({3})), progress=True)
    loaded = read_dump("refactored_out", name_map=load_name_map("names.yaml"))   # names as BASE writes them
    loaded.records[(0, 3, "forward", "fc1.output.0")]["mean"]; loaded.steps; loaded.unfinished

Parsing, completeness (the order files) and waiting for live writers are the dump reader's
(``probes.dump.DumpReader``); here only what comparing needs on top: filters, the types of the key
fields, no duplicate keys, which steps each rank finished, and names rewritten by a name map (before
the name filter; the original name is kept in the record as ``renamed_from``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..dump import DumpFormatError, DumpReader, Record, RecordKey, StepFile, record_key
from .model import CompareConfig
from .names import NameMap, NameMapError

__all__ = ["LoadedDump", "read_dump"]


@dataclass
class LoadedDump:
    """The records of one dump, keyed by (rank, step, phase, name), after the config's filters."""

    path: Path
    records: dict[RecordKey, Record]
    steps: dict[int, list[int]]  # rank -> finished steps read
    unfinished: dict[int, list[int]]  # rank -> unfinished steps (not read)
    renamed: dict[str, str] = field(default_factory=dict)  # original name -> name after the map, those it changed


def read_dump(path: str | Path, config: CompareConfig = CompareConfig(), *,
              progress: bool | TextIO = True, name_map: NameMap | None = None) -> LoadedDump:
    """Loads and validates a dump for comparison, keeping only the steps and names ``config`` selects.

    Raises DumpFormatError (naming file and line) for invalid, duplicated or truncated records, and
    OSError for unreadable paths, NameMapError when ``name_map`` makes two records of a step one.
    ``progress``: False, True (stderr) or a stream. A live writer of this process into ``path`` is
    waited for first, so every step it finished is read.
    """
    reader = DumpReader(path)
    loaded = LoadedDump(reader.path, {}, {}, {})
    files: list[StepFile] = []
    if reader.path.is_file():
        chunks: Iterable[tuple[Path, list[Record]]] = [(reader.path, reader.records())]
    else:
        for rank, by_state in reader.steps().items():
            if rank is not None and by_state["unfinished"]:
                loaded.unfinished[rank] = by_state["unfinished"]
        files = [step_file for step_file in reader.step_files()
                 if step_file.rank is not None and config.wants_step(step_file.step)]
        chunks = ((step_file.path, records) for step_file, records in reader.read_each(files, progress=progress))
    for file_path, records in chunks:
        for line, record in enumerate(records, 1):
            _check_record(file_path, line, record)
            step, rank = record["step"], record["rank"]
            if not config.wants_step(step):
                continue
            steps = loaded.steps.setdefault(rank, [])
            if not steps or steps[-1] != step:
                steps.append(step)
            if name_map is not None:
                _rename(record, name_map, loaded.renamed)
            if not config.wants_name(record["name"]):
                continue
            key = record_key(record)
            if key in loaded.records:
                if name_map is not None and ("renamed_from" in record or "renamed_from" in loaded.records[key]):
                    first = loaded.records[key].get("renamed_from", key[3])
                    raise NameMapError(f"{name_map.source}: maps {first!r} and {record.get('renamed_from', key[3])!r} "
                                       f"of {path} both to {key[3]!r} (rank {rank} step {step} {key[2]}); make "
                                       "the patterns tell them apart")
                raise DumpFormatError(file_path, line, f"duplicate record: rank {rank} step {step} "
                                                       f"{record['phase']} {record['name']!r} appears twice")
            record.setdefault("seq", line - 1)
            loaded.records[key] = record
    for step_file in files:  # a finished step whose records were all filtered out is still a step
        steps = loaded.steps.setdefault(step_file.rank, [])
        if step_file.step not in steps:
            steps.append(step_file.step)
    for steps in loaded.steps.values():
        steps.sort()
    return loaded


def _rename(record: Record, name_map: NameMap, renamed: dict[str, str]) -> None:
    original = record["name"]
    name = renamed.get(original) or name_map.apply(original)
    if name != original:
        renamed[original] = name
        record["renamed_from"] = original  # type: ignore[typeddict-unknown-key]
        record["name"] = name


def _check_record(path: Path, line: int, record: Record) -> None:
    """The key fields have the types matching and ordering rely on (the dump reader checks they exist)."""
    phase = record.get("phase")
    if not isinstance(phase, str):
        raise DumpFormatError(path, line, f"record {record.get('name')!r} has no 'phase' string")
    if not isinstance(record["name"], str):
        raise DumpFormatError(path, line, f"the record's 'name' is not a string: {record['name']!r}")
    for key in ("step", "rank"):
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise DumpFormatError(path, line, f"the record's {key!r} is not an int: {value!r}")
