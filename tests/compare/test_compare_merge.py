"""python -m probes.merge_activation_summary: the original command line, reading probes dumps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from probes.merge_activation_summary import main
from test_compare import ROOT, synthetic_records, write_dump

HEADER = re.compile(r"^>*(\S+) (forward|backward) run \[(\S+)\] shape: ")


def headers(path: Path) -> list[tuple[str, str]]:
    found = []
    for line in path.read_text().splitlines():
        match = HEADER.match(line)
        if match:
            found.append((match[3], match[2]))
    return found


def make_runs(tmp_path: Path) -> tuple[Path, Path, list[tuple[str, str]]]:
    base = {s: synthetic_records(s, 0) for s in range(2)}
    other = {s: synthetic_records(s, 0) for s in range(2)}
    # The ORT run writes its records in another order, lacks one and has one the baseline lacks.
    other[1] = list(reversed(other[1]))
    other[1] = [r for r in other[1] if not (r["name"] == "l1.output.0" and r["phase"] == "backward")]
    other[1].append(dict(other[1][0], name="extra.output.0", phase="forward", seq=100))
    write_dump(tmp_path / "pt", 0, base)
    write_dump(tmp_path / "ort", 0, other)
    base_order = [(r["name"], r["phase"]) for r in sorted(base[1], key=lambda r: r["seq"])]
    return tmp_path / "pt", tmp_path / "ort", base_order


def test_per_step_summaries_follow_the_baseline_order(tmp_path):
    pt, ort, base_order = make_runs(tmp_path)
    out = tmp_path / "merged"
    assert main(["--pt_dir", str(pt), "--ort_dir", str(ort), "--output_dir", str(out)]) == 0
    for run in ("merge_pt", "merge_ort"):
        assert sorted(p.name for p in (out / run).iterdir()) == ["step_0_.txt", "step_1_.txt"]
    assert headers(out / "merge_pt" / "step_1_.txt") == base_order
    expected = [key for key in base_order if key != ("l1.output.0", "backward")] + [("extra.output.0", "forward")]
    assert headers(out / "merge_ort" / "step_1_.txt") == expected
    assert headers(out / "merge_ort" / "step_0_.txt") == headers(out / "merge_pt" / "step_0_.txt")

    block = (out / "merge_pt" / "step_0_.txt").read_text().split("=" * 16 + "\n")[0].splitlines()
    assert block[0].startswith("l0.output.0 forward run [l0.output.0] shape: torch.Size([5, 10]) "
                               "dtype: torch.float32 size: torch.Size([50])")
    assert block[1].startswith("min: -1.0 max: 1.0, mean: ")
    assert block[2] == "nan: 0, inf: 0"
    assert block[3].startswith("samples(at flat indices [0, 7, 14, 21, 28, 35, 42, 49]): [-1.0, ")
    assert block[4] == "neg: 25, pos: 25, zero: 0,"


def test_existing_output_needs_overwrite_which_keeps_other_files(tmp_path, capsys):
    pt, ort, _ = make_runs(tmp_path)
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["--pt_dir", str(pt), "--ort_dir", str(ort), "--output_dir", str(out)]
    assert main(args) == 1
    assert "already exists. Enable --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main([*args, "--overwrite"]) == 0
    (out / "merge_pt" / "stale.txt").write_text("old")
    assert main([*args, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["merge_ort", "merge_pt", "notes.txt"]
    assert not (out / "merge_pt" / "stale.txt").exists()


def test_bad_dump_exits_2_before_touching_the_output(tmp_path, capsys):
    pt, ort, _ = make_runs(tmp_path)
    step_file = ort / "rank_0" / "step_000001.parquet"
    step_file.write_bytes(step_file.read_bytes()[:-10])
    out = tmp_path / "merged"
    assert main(["--pt_dir", str(pt), "--ort_dir", str(ort), "--output_dir", str(out)]) == 2
    assert f"{step_file}: not a readable Parquet step file" in capsys.readouterr().err and not out.exists()


def test_module_runs_as_a_script(tmp_path):
    pt, ort, _ = make_runs(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "probes.merge_activation_summary", "--pt_dir", str(pt), "--ort_dir", str(ort),
         "--output_dir", str(tmp_path / "merged")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "records are not in the baseline's order; appended at the end" in result.stderr
    assert (tmp_path / "merged" / "merge_ort" / "step_1_.txt").exists()
