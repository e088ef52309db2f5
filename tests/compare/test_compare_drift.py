"""Drift (issue 47, docs/compare.md, Drift): at the default tolerance a difference grown from what the step before
already carried is drift, not a divergence, and a jump is still DIVERGED at its step and record, whatever the
windows. The runs here are written by hand: the other run is the base with a fixed rounding pattern whose size grows
by GROWTH per step (as training grows the kernels' rounding differences), optionally with a jump of 1% at one step.
"""

from __future__ import annotations

import json

import pytest
import torch

from probes.cli import main
from probes.compare import compare_dumps, format_report
from probes.compare.html import render_html
from probes.compare.options import DRIFT_GROWTH
from probes.dump.writer import DumpWriter
from probes.stats.one_tensor import tensor_record
from dump_records import write_record

STEPS, GROWTH = 8, 1.6
LAYERS = ("a", "b", "c")
EPS = 1e-4  # the float32 default rtol of a value: a rounding pattern of size s * EPS has ratio about s


def _tensor(step: int, layer: int) -> torch.Tensor:
    return torch.randn(32, 32, generator=torch.Generator().manual_seed(100 * step + layer))


def _write(path, size: float, jump: tuple[int, str] | None = None, growth: float = GROWTH) -> None:
    """Every step's forward records of LAYERS; ``size``: the step-0 rounding in EPS (None: the base run itself)."""
    pattern = torch.rand(32, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 2 - 1
    with DumpWriter(path) as writer:
        for step in range(STEPS):
            for seq, layer in enumerate(LAYERS):
                tensor = _tensor(step, seq).double()
                if size:
                    tensor = tensor * (1 + size * growth ** step * EPS * pattern)
                if jump == (step, layer):
                    tensor = tensor * 1.01
                record = {"rank": 0, "step": step, "name": f"{layer}.output.0", "phase": "forward", "seq": seq,
                          **tensor_record(tensor.float(), sample_count=32)}
                write_record(writer, step, record)
            writer.finish_step(step)


@pytest.fixture
def runs(tmp_path):
    _write(tmp_path / "base", 0.0)
    return tmp_path


def test_a_difference_that_grows_from_what_the_step_before_carried_is_drift(runs):
    _write(runs / "grown", 0.3)
    strict = compare_dumps(runs / "base", runs / "grown", strict_drift=True)
    first = strict.first_divergence
    assert first is not None and first.step >= 2, "the pattern must grow beyond the tolerance after the first step"
    ratios = {}
    for record in strict.records:
        ratios[record.step] = max(ratios.get(record.step, 0.0), record.ratio)
    assert ratios[0] < 1 < ratios[STEPS - 1] and all(ratios[s] <= DRIFT_GROWTH * ratios[s - 1] for s in range(1, STEPS))
    report = compare_dumps(runs / "base", runs / "grown")
    assert report.agrees and report.first_divergence is None and report.diverged_count == 0
    assert report.drift_count == strict.diverged_count > 0
    drift = report.records.at(report.records.drift_rows())
    assert all(record.drift is not None and 1 < record.ratio <= DRIFT_GROWTH * record.drift for record in drift)
    assert not any(record.diverged for record in drift)
    document = report.to_json()
    assert document["verdict"] == "agree" and document["counts"]["drift"] == report.drift_count
    assert document["drift"][0]["carried"] == pytest.approx(drift[0].drift) and document["options"]["drift"]
    assert sum(step["drift"] for step in document["per_step"]) == report.drift_count
    text = format_report(report)
    assert "Drift:" in text and "not divergences" in text.splitlines()[-1], text
    assert 'id="drift"' in render_html(report)
    # at a fixed tolerance the rule does not apply: the user's rule is the rule
    assert compare_dumps(runs / "base", runs / "grown", rtol=1e-4, atol=1e-6).first_divergence is not None


def test_drift_exits_0_and_strict_drift_1(runs, capsys):
    _write(runs / "grown", 0.3)
    assert main(["compare", str(runs / "base"), str(runs / "grown")]) == 0
    assert "drift" in capsys.readouterr().out
    assert main(["compare", str(runs / "base"), str(runs / "grown"), "--strict-drift"]) == 1


@pytest.mark.parametrize("step, layer", [(6, "b"), (3, "a"), (1, "c")])
def test_a_jump_after_drift_is_diverged_at_its_step_and_record(runs, step, layer):
    _write(runs / "bug", 0.3, jump=(step, layer))
    report = compare_dumps(runs / "base", runs / "bug")
    first = report.first_divergence
    assert first is not None and (first.step, first.phase, first.name) == (step, "forward", f"{layer}.output.0"), \
        str(first)
    # after a jump its step's records are propagated from it: diverged, none drift; nothing diverged before it
    found = {(d.step, d.seq) for d in report.divergences}
    assert {(step, seq) for seq in range(LAYERS.index(layer), len(LAYERS))} <= found, found
    assert min(found) == (step, LAYERS.index(layer))
    drift = report.records.at(report.records.drift_rows())
    assert report.drift_count > 0 and not [r for r in drift if r.step == step and r.seq >= LAYERS.index(layer)]


def test_a_difference_beyond_tolerance_at_the_first_step_is_diverged(runs):
    """Nothing was carried into the first step compared: no drift there, whatever grows after it."""
    _write(runs / "early", 1.5, growth=1.0)
    report = compare_dumps(runs / "base", runs / "early")
    assert report.first_divergence is not None and report.first_divergence.step == 0
    assert report.drift_count > 0  # the same difference carried on: the later steps are drift


def test_growth_beyond_the_rule_is_diverged(runs):
    _write(runs / "fast", 0.3, growth=DRIFT_GROWTH * 1.5)
    report = compare_dumps(runs / "base", runs / "fast")
    assert report.first_divergence is not None and report.first_divergence.step > 0


@pytest.mark.parametrize("window, jobs", [(3, 1), (3, 2), (7, 1)])
def test_drift_is_the_same_whatever_the_windows(runs, window, jobs):
    _write(runs / "grown", 0.3, jump=(5, "c"))
    whole = compare_dumps(runs / "base", runs / "grown", window=None)
    parts = compare_dumps(runs / "base", runs / "grown", window=window, jobs=jobs)
    assert whole.drift_count > 0 and whole.first_divergence is not None
    assert json.dumps(parts.to_json(), sort_keys=True) == json.dumps(whole.to_json(), sort_keys=True)
    assert format_report(parts) == format_report(whole)
