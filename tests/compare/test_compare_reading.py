"""Reading dumps for compare: bad input gives exit 2 naming file and line; filters; progress lines."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest

from probes.compare.options import CompareConfig
from probes.compare.reading import read_dump
from probes.utils.progress import Progress
from probes.utils.progress import progress_meter
from test_compare import ROOT, run_cli, synthetic_records, write_dump

COMPARE = ROOT / "probes" / "compare"


def step_file(root: Path, step: int = 1) -> Path:
    return root / "rank_0" / f"step_{step:06d}.jsonl"


@pytest.fixture
def two_dumps(tmp_path) -> tuple[Path, Path]:
    # JSON Lines: the damage below is done to lines (test_dump_parquet.py damages Parquet files).
    for name in ("base", "other"):
        write_dump(tmp_path / name, 0, {s: synthetic_records(s, 0) for s in range(3)}, format="jsonl")
    return tmp_path / "base", tmp_path / "other"


def test_corrupted_line_gives_exit_2_naming_file_and_line(two_dumps, capsys):
    base, other = two_dumps
    path = step_file(other)
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"\"phase\": ", b"\"phase\" ", 1)  # a lost colon
    path.write_bytes(b"\n".join(lines))
    code, out, err = run_cli(base, other, capsys=capsys)
    assert code == 2 and out == ""
    assert f"{path}, line 3: invalid JSON" in err


def test_truncated_dump_gives_exit_2(two_dumps, capsys):
    base, other = two_dumps
    path = step_file(other, 2)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 30])  # cut inside the last line
    code, _, err = run_cli(base, other, capsys=capsys)
    assert code == 2 and f"{path}, line 8: truncated last line" in err

    lines = data.split(b"\n")
    path.write_bytes(b"\n".join(lines[:5]) + b"\n")  # cut at a line boundary: caught by the order file
    code, _, err = run_cli(other, base, capsys=capsys)
    assert code == 2 and f"{path}, line 6: truncated: step_000002.order.txt lists 8 records" in err


def test_missing_and_non_dump_inputs_give_exit_2(two_dumps, tmp_path, capsys):
    base, _ = two_dumps
    code, _, err = run_cli(base, tmp_path / "nowhere", capsys=capsys)
    assert code == 2 and str(tmp_path / "nowhere") in err
    (tmp_path / "plain").mkdir()
    code, _, err = run_cli(tmp_path / "plain", base, capsys=capsys)
    assert code == 2 and "not a probes dump" in err
    assert run_cli(base, capsys=capsys)[0] == 2  # usage error


def test_duplicate_and_incomplete_records_are_bad_input(tmp_path, capsys):
    records = synthetic_records(0, 0)
    write_dump(tmp_path / "dup", 0, {0: records + [dict(records[1], seq=50)]}, format="jsonl")
    code, _, err = run_cli(tmp_path / "dup", tmp_path / "dup", capsys=capsys)
    assert code == 2 and f"{step_file(tmp_path / 'dup', 0)}, line 9: duplicate record" in err
    write_dump(tmp_path / "nophase", 0, {0: [{k: v for k, v in records[0].items() if k != "phase"}]},
               format="jsonl")
    code, _, err = run_cli(tmp_path / "nophase", tmp_path / "nophase", capsys=capsys)
    assert code == 2 and "line 1: record 'l0.output.0' has no 'phase'" in err


def test_progress_goes_to_the_given_stream(two_dumps):
    stream = io.StringIO()
    meter = Progress("reading x", 10, stream, delay=0)
    meter.update(4)
    meter.close()
    shown = stream.getvalue().split("\r")  # tqdm's redraws
    assert shown[-1].startswith("reading x: 100%") and "10/10" in shown[-1] and shown[-1].endswith("\n")
    quiet = io.StringIO()
    read_dump(two_dumps[0], progress=quiet)  # small and fast: nothing printed
    assert quiet.getvalue() == ""


def test_progress_meter_follows_the_progress_option():
    assert progress_meter("x", 3, False) is None
    assert progress_meter("x", 3, True).stream is not None  # stderr
    stream = io.StringIO()
    meter = progress_meter("x", 3, stream)
    assert isinstance(meter, Progress) and meter.stream is stream


def test_read_dump_keeps_the_selected_steps_and_names(two_dumps):
    base, _ = two_dumps
    loaded = read_dump(base, CompareConfig(steps=frozenset({1, 2}), names=("nothing*",)), progress=False)
    assert loaded.records == {} and loaded.steps_by_rank == {0: [1, 2]}  # a step whose records were all filtered is a step
    loaded = read_dump(base, CompareConfig(names=("l0.*",)), progress=False)
    assert sorted(loaded.records) == [(0, step, phase, "l0.output.0") for step in range(3)
                                      for phase in ("backward", "forward")]
    assert loaded.steps_by_rank == {0: [0, 1, 2]} and loaded.unfinished == {}


def test_read_dump_of_one_step_file(two_dumps):
    loaded = read_dump(step_file(two_dumps[0], 1), progress=False)
    assert loaded.steps_by_rank == {0: [1]} and len(loaded.records) == 8
    assert all(record["step"] == 1 for record in loaded.records.values())


def imported_names(path: Path) -> set[str]:
    """"module" and "module.name" for every import of a file (relative modules resolved inside probes)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                source = ".".join(["probes", "compare"][: 3 - node.level] + ([source] if source else []))
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def test_compare_reads_dumps_through_the_dump_readers_public_api():
    # The dump reader owns parsing, the order files and waiting for writers; compare uses its public names.
    for path in sorted(COMPARE.glob("*.py")):
        private = sorted(name for name in imported_names(path)
                         if name.startswith("probes.dump.") and name.rpartition(".")[2].startswith("_"))
        assert private == [], f"{path.name} imports private names of probes.dump: {private}"
        assert "order_file" not in path.read_text(), f"{path.name} reads order files itself"
