"""The noise floor: calibration runs (``perturbed_rounding``) give each statistic a noise level; every report says
whether the records are beyond their noise floor or within it; a calibration run identical to the base says so.

The levels themselves are held to a hand-written statement of the rules by test_compare_vector.py; here real runs:
the base, calibration runs (the base again, perturbed), a run that differs only by rounding (another seed) and a
run with a 1% bug.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest

import helpers
from probes.__main__ import main as probes_main
from probes.compare import compare_dumps, format_report
from probes.compare.engine import compare_records
from probes.compare.html import render_html
from probes.compare.terminal import verdict
from probes.dump import load_dump
from probes.models import TransformerConfig
from probes.testing import assert_parity, perturbed_rounding

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
train_run = functools.partial(helpers.train_run, config=CONFIG, steps=3)
BUG = ("blocks.1.mlp.0", 1, "forward")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("noise")
    found = {name: root / name for name in ("base", "rerun", "noise_1", "noise_2", "rounded", "buggy")}
    train_run(found["base"])
    train_run(found["rerun"])  # bit-identical: measures nothing
    for name, seed in (("noise_1", 1), ("noise_2", 2), ("rounded", 3)):
        with perturbed_rounding(seed=seed):
            train_run(found[name])  # "rounded": another backend's rounding, as far as compare can tell
    train_run(found["buggy"], bug=BUG)
    return found


def test_a_rerun_measures_no_noise_and_the_report_says_so(runs, capsys):
    report = compare_dumps(runs["base"], runs["rounded"], noise=runs["rerun"])
    floor = report.noise_floor
    assert floor is not None and floor.silent == report.matched and floor.beyond == floor.within == 0
    assert all(record.noise is not None and not any(record.noise.values()) for record in report.records)
    assert all(record.beyond_noise is None for record in report.records)
    text = format_report(report)
    assert "the calibration run is identical to the base, so it measures no noise: make it with " \
           "probes.testing.perturbed_rounding" in text


def test_a_run_that_differs_by_rounding_is_within_the_noise_floor_everywhere(runs, capsys):
    fixed = compare_dumps(runs["base"], runs["rounded"], rtol=1e-7, atol=1e-9)
    assert not fixed.agrees, "another rounding should break a tolerance this tight"
    report = assert_parity(runs["base"], runs["rounded"], rtol=1e-7, atol=1e-9, noise=[runs["noise_1"], runs["noise_2"]])
    floor = report.noise_floor
    assert floor.beyond == 0 and floor.within + floor.silent == report.matched and floor.within > 0.9 * report.matched
    assert verdict(report) == f"AGREE ({report.matched} records within tolerance, none beyond the noise floor)"
    assert all(record.beyond_noise in (False, None) for record in report.records)
    code = probes_main(["compare", str(runs["base"]), str(runs["rounded"]), "--rtol", "1e-7", "--atol", "1e-9",
                        "--noise", str(runs["noise_1"]), str(runs["noise_2"])])
    out = capsys.readouterr().out
    assert code == 0 and f"noise floor: 0 records beyond the noise floor, {floor.within} within it" in out


def test_a_bug_is_beyond_the_noise_floor_in_every_report(runs, tmp_path, capsys):
    report = compare_dumps(runs["base"], runs["buggy"], noise=[runs["noise_1"], runs["noise_2"]])
    first = report.first_divergence
    assert (first.step, first.phase, first.name) == (1, "forward", "blocks.1.mlp.0.output.0")
    assert first.noise_floor == "beyond"
    assert verdict(report) == f"DIVERGED at rank 0, step 1, forward, blocks.1.mlp.0.output.0 ({first.metric}, " \
                              "beyond the noise floor)"
    assert report.noise_floor.first_beyond == (0, 1, "forward", "blocks.1.mlp.0.output.0")
    record = next(r for r in report.records if (r.step, r.phase, r.name) == (1, "forward", first.name))
    assert record.beyond_noise and record.noise_ratio > 100  # fp32: a 1% bug is far above rounding
    assert all(r.beyond_noise is not True for r in report.records if r.step == 0)

    code = probes_main(["compare", str(runs["base"]), str(runs["buggy"]), "--noise", str(runs["noise_1"]),
                        "--noise", str(runs["noise_2"]), "--json", str(tmp_path / "r.json"),
                        "--html", str(tmp_path / "r.html")])
    out = capsys.readouterr().out
    assert code == 1 and "beyond the noise floor" in out
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["noise"] == f"{runs['noise_1']}, {runs['noise_2']}"
    assert document["first_divergence"]["noise_floor"] == "beyond"
    assert document["noise_floor"]["beyond"] == report.noise_floor.beyond
    assert document["noise_floor"]["first_beyond"] == {"rank": 0, "step": 1, "phase": "forward",
                                                       "name": "blocks.1.mlp.0.output.0"}
    shown = document["divergences"][0]
    assert shown["noise_floor"] == "beyond" and set(shown["noise"]) == {"min", "max", "mean", "std", "norm", "samples"}
    assert all(metric["noise_floor"] == 10 * shown["noise"][name] for name, metric in shown["metrics"].items())
    page = (tmp_path / "r.html").read_text()
    assert "beyond the noise floor" in page and "noise floor" in render_html(report)
    with pytest.raises(AssertionError, match="beyond the noise floor"):
        assert_parity(runs["base"], runs["buggy"], noise=runs["noise_1"])


def test_several_calibration_runs_give_each_statistic_the_largest_level(runs):
    one, two = (compare_dumps(runs["base"], runs["rounded"], noise=runs[name]) for name in ("noise_1", "noise_2"))
    both = compare_dumps(runs["base"], runs["rounded"], noise=[runs["noise_1"], runs["noise_2"]])
    for a, b, joined in zip(one.records, two.records, both.records):
        assert joined.noise == {key: max(a.noise[key], b.noise[key]) for key in a.noise}
    assert both.noise == f"{runs['noise_1']}, {runs['noise_2']}"


def test_averages_get_smaller_levels_than_single_values(runs):
    """A statistic of many values moves less than they do: the mean, std and norm / sqrt(n) levels of a record are
    (typically far) below its single values' level, which lets a scaled output stand out in bfloat16
    (test_noise_floor.py) where single values move by as much."""
    report = compare_dumps(runs["base"], runs["rounded"], noise=runs["noise_1"])
    numel = {(r["step"], r["phase"], r["name"]): r["numel"] for r in load_dump(runs["base"])}
    ratios = {"mean": [], "std": []}
    for record in report.records:
        levels = record.noise
        if not levels or not levels["samples"] or numel[(record.step, record.phase, record.name)] < 64:
            continue
        assert levels["mean"] <= levels["samples"]
        assert levels["norm"] / math.sqrt(numel[(record.step, record.phase, record.name)]) <= levels["samples"] * 1.000001
        for name in ratios:
            ratios[name].append(levels[name] / levels["samples"])
    assert len(ratios["mean"]) > 20
    medians = {name: float(np.median(found)) for name, found in ratios.items()}
    assert medians["mean"] < 0.3 and medians["std"] < 0.3, medians


def test_compare_records_takes_the_calibration_record(runs):
    def one(path: Path, step: int = 2, name: str = "blocks.0.mlp.0.output.0") -> dict:
        return next(r for r in load_dump(path) if (r["step"], r["phase"], r["name"]) == (step, "forward", name))

    base, noise, other = one(runs["base"]), one(runs["noise_1"]), one(runs["rounded"])
    diff = compare_records(base, other, noise=noise)
    single = max([abs(noise[k] - base[k]) for k in ("min", "max")] +
                 [abs(y - x) for x, y in zip(base["samples"], noise["samples"])])
    assert diff.noise["min"] == diff.noise["max"] == diff.noise["samples"] >= single
    for name in ("mean", "std", "norm"):  # at least its own change
        assert diff.noise[name] >= abs(noise[name] - base[name]) and diff.noise[name] > 0
    assert diff.beyond_noise is False and compare_records(base, other).noise is None
