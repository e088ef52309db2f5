"""Damage stays with its step: a damaged step file fails only what needs that step, every damaged file is
named at once, ``--skip-damaged`` shows the rest with a note, and nothing is ever written to the dump."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

from probes import load_dump, load_table
from probes.cli import main
from probes.compare import compare_dumps
from probes.dump import DumpFormatError
from probes.dump.reader import DamagedSteps
from probes.dump.writer import DumpWriter
from dump_records import write_record


def write(path: Path, *, steps: int = 3, format: str = "parquet", scale: float = 1.0) -> Path:
    with DumpWriter(path, format=format) as writer:
        for step in range(steps):
            for seq, name in enumerate(("a.output.0", "b.output.0", "c.output.0")):
                write_record(writer, step, {"name": name, "phase": "forward", "seq": seq, "shape": [4], "dtype": "float32",
                                    "numel": 4, "nan": 0, "inf": 0, "zero": 0, "mean": 0.25 * (seq + 1) * scale,
                                    "min": -1.0, "max": 1.0 + step, "std": 0.5,
                                    "samples": [0.1 * step, 0.2, 0.3, 0.4], "sample_indices": [0, 1, 2, 3]})
            writer.finish_step(step)
    return path


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 3  # inside the data pages, which the page checksums cover
    for offset in range(middle, middle + 8):
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _unix_socket(path: Path) -> None:
    path.unlink()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()


DAMAGE = {
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2]),
    "flipped bytes": _flip,
    "zero bytes": lambda path: path.write_bytes(b""),
    "a directory": lambda path: (path.unlink(), path.mkdir(), (path / "x").write_text("x")),
    "a broken link": lambda path: (path.unlink(), os.symlink(path.parent / "nowhere", path)),
    "a socket": _unix_socket,
}
FORMATS = {kind: ("parquet", "jsonl") for kind in DAMAGE}
FORMATS["flipped bytes"] = ("parquet",)  # JSON Lines has no checksums: a flipped digit is another number


def _cases():
    for kind, formats in FORMATS.items():
        for format in formats:
            yield pytest.param(kind, format, id=f"{kind}-{format}")


def _snapshot(root: Path) -> dict[str, str]:
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.exists():
            found[str(path)] = "link"
        elif path.is_file():
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[str(path)] = "dir" if path.is_dir() else "other"
    return found


@pytest.mark.parametrize("kind,format", list(_cases()))
def test_a_damaged_step_fails_only_what_needs_it(tmp_path, capsys, kind, format):
    base = write(tmp_path / "base", format=format)
    other = write(tmp_path / "other", format=format)
    damaged = base / "rank_0" / f"step_000001.{format}"
    DAMAGE[kind](damaged)
    before = _snapshot(tmp_path)

    with pytest.raises(DumpFormatError, match="step_000001") as raised:
        load_dump(base)
    assert isinstance(raised.value, DamagedSteps) and raised.value.path == damaged
    with pytest.raises(DamagedSteps, match="1 damaged step file: .*step_000001"):
        load_table(base)

    # Selections without the step work, in Python and on the command line.
    report = compare_dumps(base, other, steps=[0, 2])
    assert report.agrees and report.matched == 6
    assert main(["show", str(base), "--step", "2"]) == 0
    assert main(["compare", str(base), str(other), "--step", "0,2"]) == 0
    capsys.readouterr()

    # The whole dump: one line naming the file, exit 2, no traceback.
    for command in (["show", str(base)], ["compare", str(base), str(other)], ["compare", str(other), str(base)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(damaged) in err and "Traceback" not in err, err

    # --skip-damaged: the rest, and a note naming the damaged step.
    assert main(["show", str(base), "--skip-damaged"]) == 0
    captured = capsys.readouterr()
    assert "a.output.0" in captured.out and "note: 1 damaged step file left out" in captured.err
    assert str(damaged) in captured.err
    shown_steps = {int(line.split()[0]) for line in captured.out.splitlines()[2:] if line.strip()}
    assert shown_steps == {0, 2}
    json_out = tmp_path / "r.json"
    assert main(["compare", str(base), str(other), "--skip-damaged", "--json", str(json_out)]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and str(damaged) in out
    import json
    document = json.loads(json_out.read_text())
    assert document["counts"]["matched"] == 6
    assert [item["path"] for item in document["damaged"]["base"]] == [str(damaged)]
    assert document["damaged"]["other"] == []
    json_out.unlink()
    assert _snapshot(tmp_path) == before  # reading never changes the dump


def test_every_damaged_file_is_named_in_one_line(tmp_path, capsys):
    base = write(tmp_path / "base", steps=4)
    other = write(tmp_path / "other", steps=4)
    first, second = (base / "rank_0" / f"step_00000{step}.parquet" for step in (1, 3))
    DAMAGE["truncated"](first)
    DAMAGE["a directory"](second)
    with pytest.raises(DamagedSteps, match="2 damaged step files") as raised:
        load_dump(base)
    assert [path for path, _ in ((f.path, e) for f, e in raised.value.damaged)] == [first, second]
    assert main(["compare", str(base), str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(first) in err and str(second) in err


def test_a_damaged_step_in_both_runs_and_a_noise_run(tmp_path, capsys):
    base, other, noise = (write(tmp_path / name) for name in ("base", "other", "noise"))
    DAMAGE["zero bytes"](other / "rank_0" / "step_000002.parquet")
    DAMAGE["truncated"](noise / "rank_0" / "step_000000.parquet")
    report = compare_dumps(base, other, noise=noise, skip_damaged=True)
    assert report.agrees and report.matched == 6  # step 2 left out of both runs: nothing only in one
    assert [item.step for item in report.damaged["other"]] == [2]
    assert [item.step for item in report.damaged["noise"]] == [0]
    assert report.noise_unmatched == 3
    for jobs in (1, 2):  # read a step at a time: the same report
        windowed = compare_dumps(base, other, noise=noise, skip_damaged=True, window=1, jobs=jobs)
        assert windowed.to_json() == report.to_json()
    with pytest.raises(DamagedSteps, match="2 damaged step files: .*other.*step_000002.*noise.*step_000000"):
        compare_dumps(base, other, noise=noise, window=1)


@pytest.mark.parametrize("command", [["export", "--format", "csv", "--output"], ["export", "--format", "jsonl", "--output"],
                                     ["tensorboard", "--logdir"]])
def test_exports_name_every_damaged_file_and_write_nothing(tmp_path, capsys, command):
    base = write(tmp_path / "base", steps=4)
    first, second = (base / "rank_0" / f"step_00000{step}.parquet" for step in (0, 2))
    DAMAGE["flipped bytes"](first)
    DAMAGE["zero bytes"](second)
    before = _snapshot(base)
    output = tmp_path / "out"
    assert main([command[0], str(base), *command[1:], str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 damaged step files" in err and str(first) in err and str(second) in err
    assert _snapshot(base) == before
    if command[0] == "export":
        assert not output.exists()  # written in full or not at all
