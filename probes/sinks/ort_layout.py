"""A dump in the original onnxruntime hooks' own layout, for scripts and tests written against it.

    write_ort_layout(ExportOptions(dump="pt_out", output="pt_ort", format="ort"))   # pt_ort/step_<i>/order.txt, ...

The original ``StatisticsSubscriber`` wrote, per step, a directory ``step_<i>`` holding one text file
per tensor and phase, named ``<Class>_<module index>_<i>th_output_forward`` (``..._backward``), and an
``order.txt`` listing those file names in the order they were written. This writes the same from a
probes dump, one rank (the lowest unless ``rank``), each file holding the original's text block
(``probes.dump.legacy_block``). Differences, each deliberate: file names are made safe path components
(``probes.dump.safe_component``: a name from the model never leaves the step directory); a module
called twice in a step gets ``_call<k>`` after its file name where the original overwrote the first
call's file; recomputation records (activation checkpointing), which the original never saw, are left
out; the samples line holds the samples the dump kept, with their flat indices.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..dump.layout import safe_component
from ..dump.legacy import legacy_block, legacy_file_name
from ..dump.reader import StepFile
from ..dump.record import Record, execution_order
from ..utils.phases import OBSERVED
from .output import ExportOptions, ExportSummary, atomic_output, check_output, ranks_of, select_files

__all__ = ["write_ort_layout"]


def write_ort_layout(options: ExportOptions) -> ExportSummary:
    """Writes ``options.output/step_<i>/`` directories in the original onnxruntime hooks' layout (see the
    module); what ``export_dump`` calls."""
    dump, output, rank = options.dump, options.output, options.rank
    check_output(output, dump, overwrite=options.overwrite)
    reader, files = select_files(dump, rank=rank)
    all_ranks = ranks_of(files)
    chosen = rank if rank is not None else (all_ranks[0] if all_ranks else 0)
    files = [item for item in files if (item.rank if item.rank is not None else 0) == chosen]
    notes = []
    if len(all_ranks) > 1 and rank is None:
        notes.append(f"rank {chosen} of ranks {', '.join(map(str, all_ranks))} (choose with rank=, --rank)")
    written = skipped = 0
    with atomic_output(output) as temporary:
        temporary.mkdir()
        for step_file, records in reader.read_each(files, progress=options.progress, label=f"exporting {dump}"):
            step_written, step_skipped = _write_step(records, step_file, temporary)
            written, skipped = written + step_written, skipped + step_skipped
    if skipped:
        notes.append(f"{skipped} recomputation records left out (the original layout has no such phase)")
    return ExportSummary.of("ort", output, written, files, tuple(notes))


def _write_step(records: list[Record], step_file: StepFile, root: Path) -> tuple[int, int]:
    kept = sorted((record for record in records if record.get("phase") in OBSERVED),
                  key=lambda r: execution_order(r["step"], "", r.get("seq"), r["rank"]))
    step_dir = root / f"step_{step_file.step}"
    step_dir.mkdir()
    seen: Counter[str] = Counter()
    order = []
    for record in kept:
        name = safe_component(legacy_file_name(record))
        seen[name] += 1
        if seen[name] > 1:
            name = f"{name}_call{seen[name] - 1}"
        (step_dir / name).write_text(legacy_block(record, with_name=False), encoding="utf-8")
        order.append(name)
    (step_dir / "order.txt").write_text("".join(f"{name}\n" for name in order), encoding="utf-8")
    return len(kept), len(records) - len(kept)
