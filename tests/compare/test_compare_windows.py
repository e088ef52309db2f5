"""A comparison read in windows of steps, in one process or several, reports exactly what one read of the whole
dumps reports: the JSON document, the terminal summary, the HTML page and every RecordDiff."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from probes.cli import main
from probes.compare import compare_dumps, format_report
from probes.compare.html import render_html
from probes.compare.engine import windows_of
from probes.compare.options import CompareConfig
from probes.stats.recorder import tensor_record
from test_compare import synthetic_records, write_dump

STEPS = 6


def _other_records(step: int, rank: int, rename: dict[str, str]) -> list[dict]:
    bumps = {(1, 2): {("forward", 2): 1.5}, (0, 4): {("backward", 3): 1.0001}, (0, 3): {("forward", 1): float("nan")}}
    records = synthetic_records(step, rank, bump=bumps.get((rank, step)))
    if step == 1 and rank == 0:  # a materialised zero gradient, and a record the base run lacks
        zero = {"name": "head.output.0", "phase": "backward", "seq": 50, "step": step, "rank": rank}
        zero.update(tensor_record(torch.zeros(5, 10), sample_count=8))
        extra = dict(records[0], name="extra.output.0", seq=51)
        records += [zero, extra]
    if step == 2 and rank == 1:
        records = [r for r in records if r["name"] != "l0.output.0" or r["phase"] != "backward"]
    for record in records:
        record["name"] = rename.get(record["name"], record["name"])
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("windows")
    for rank in (0, 1):
        write_dump(root / "base", rank, {s: synthetic_records(s, rank) for s in range(STEPS)})
        noisy = {s: synthetic_records(s, rank, bump={("forward", 0): 1 + 1e-7 * (s + 1)}) for s in range(STEPS)}
        write_dump(root / "noise", rank, noisy)
        steps = range(STEPS if rank == 0 else STEPS - 1)  # rank 1 of the other run stopped a step early
        write_dump(root / "other", rank, {s: _other_records(s, rank, {}) for s in steps})
        write_dump(root / "renamed", rank, {s: _other_records(s, rank, {"l1.output.0": "k1.output.0"}) for s in steps})
    return root


CASES = {
    "noise": dict(other="other", noise="noise"),
    "strict zero gradients, filters": dict(other="other", strict_zero_grads=True, steps=[0, 1, 2, 3, 5],
                                           names=["l*", "head*"]),
    "name map": dict(other="renamed", name_map={r"^k1\.": "l1."}),
    "fuzzy": dict(other="renamed", fuzzy=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_windows_report_exactly_what_one_read_reports(runs, case):
    options = dict(CASES[case])
    other = runs / options.pop("other")
    if "noise" in options:
        options["noise"] = runs / options["noise"]
    whole = compare_dumps(runs / "base", other, window=None, **options)
    assert len(windows_of(runs / "base", other, options.get("noise"), CompareConfig(), 10)) == STEPS
    for jobs in (1, 2):
        windowed = compare_dumps(runs / "base", other, window=10, jobs=jobs, **options)
        assert windowed.to_json() == whole.to_json()
        assert format_report(windowed) == format_report(whole)
        assert render_html(windowed) == render_html(whole)
        assert [r.to_json() for r in windowed.records] == [r.to_json() for r in whole.records]  # rebuilt windows too
    assert whole.diverged_count and whole.only_in_base and whole.first_nonfinite["other"] is not None
    if case == "noise":
        assert whole.zero_grads and whole.noise_unmatched < whole.matched
    if case in ("name map", "fuzzy"):
        assert [r.other for r in whole.renamed] == ["k1.output.0"] * (1 if case == "name map" else 2)


def test_a_window_is_whole_steps_of_about_the_records_asked(runs):
    base, other = runs / "base", runs / "other"
    per_step = 2 * 8  # two ranks of eight records
    assert windows_of(base, other, None, CompareConfig(), None) == [None]
    assert windows_of(base, other, None, CompareConfig(), 1) == [frozenset({s}) for s in range(STEPS)]
    assert windows_of(base, other, None, CompareConfig(), 3 * per_step) == [frozenset({0, 1, 2}), frozenset({3, 4, 5})]
    assert windows_of(base, other, None, CompareConfig(steps=frozenset({1, 5})), 1000) == [frozenset({1, 5})]
    assert windows_of(base / "rank_0" / "step_000001.parquet", other, None, CompareConfig(), 1) == [None]
    with pytest.raises(ValueError, match="window must be at least 1"):
        windows_of(base, other, None, CompareConfig(), 0)


def test_the_command_line_takes_a_window_and_jobs(runs, tmp_path, capsys):
    outputs = {}
    for label, extra in (("one", ["--window", "1000000", "--jobs", "1"]), ("six", ["--window", "16", "--jobs", "2"])):
        code = main(["compare", str(runs / "base"), str(runs / "other"), "--noise", str(runs / "noise"),
                     "--json", str(tmp_path / f"{label}.json"), "--html", str(tmp_path / f"{label}.html"), *extra])
        assert code == 1
        outputs[label] = capsys.readouterr().out.replace(f"{label}.", "X.")
    assert outputs["one"] == outputs["six"]
    assert (tmp_path / "one.json").read_text() == (tmp_path / "six.json").read_text()
    assert (tmp_path / "one.html").read_text() == (tmp_path / "six.html").read_text()
    for bad in (["--window", "0"], ["--jobs", "-1"], ["--jobs", "two"]):
        assert main(["compare", str(runs / "base"), str(runs / "other"), *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "expected a whole number of at least 1" in err


@pytest.mark.parametrize("rank_scale", [1, 1 << 20])  # a table of keys; keys too sparse for one: sorted
def test_the_heatmap_rows_are_those_of_a_sort(rank_scale):
    from types import SimpleNamespace

    import numpy as np

    from probes.compare.recorddiffs import _rows_of

    rng = np.random.default_rng(0)
    count = 5000
    records = SimpleNamespace(rank=(rng.integers(0, 3, count) * rank_scale).astype(np.int32),
                              phase=rng.integers(0, 2, count).astype(np.int32),
                              name=rng.integers(0, 40, count).astype(np.int32),
                              labels=(["forward", "backward"], [f"n{i}" for i in range(40)]))
    packed = (records.rank.astype(np.int64) << 40) | (records.phase.astype(np.int64) << 32) | records.name
    _, first, inverse = np.unique(packed, return_index=True, return_inverse=True)
    found_first, found_inverse = _rows_of(records)
    assert found_first.tolist() == first.tolist() and found_inverse.tolist() == inverse.tolist()


def test_the_windows_arrays_are_on_disk_and_read_back_as_one_read_holds_them(runs):
    import numpy as np

    from probes.compare.recorddiffs import SpilledRecordDiffs

    whole = compare_dumps(runs / "base", runs / "other", window=None)
    windowed = compare_dumps(runs / "base", runs / "other", window=10, jobs=1)
    records = windowed.records
    assert isinstance(records, SpilledRecordDiffs) and len(list(records.chunks())) == STEPS
    assert len(records) == len(whole.records)
    for name in ("rank", "step", "seq", "ratio", "diverged", "rel_error"):
        assert np.array_equal(getattr(records, name), getattr(whole.records, name)), name
    for count in (1, 5, 100):  # 100: more than a window's summary keeps, read from the arrays
        assert [r.to_json() for r in records.worst(count)] == [r.to_json() for r in whole.records.worst(count)]
    first = whole.first_divergence
    assert np.array_equal(records.rows_where(rank=first.rank, step=first.step, phase=first.phase),
                          np.flatnonzero(whole.records.where(rank=first.rank, step=first.step, phase=first.phase)))
    assert np.array_equal(records.diverged_rows(), np.flatnonzero(whole.records.diverged))
