"""The per-dtype, scale-aware default tolerance (docs/compare.md, Tolerance) on records of real tensors, both sides:
rounding differences agree, changes of the size of a bug do not; explicit rtol/atol keep the fixed rule; the
reports say which tolerance they used. Expected tolerances are computed here in numpy float64 from the tensors.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from probes.compare import compare_dumps, format_report, write_html
from probes.compare.options import PRECISIONS, CompareConfig
from probes.compare.engine import compare_records
from probes.dump.writer import DumpWriter
from dump_records import write_record
from probes.stats.one_tensor import tensor_record

BF16_EPS = 2.0 ** -7


def record(name: str, tensor: torch.Tensor, phase: str = "forward", seq: int = 0, **fields) -> dict:
    return {"rank": 0, "step": 0, "name": name, "phase": phase, "seq": seq, **tensor_record(tensor, sample_count=32),
            **fields}


def write(path, steps: dict[int, list[dict]]) -> None:
    with DumpWriter(path) as writer:
        for step, records in steps.items():
            for found in records:
                write_record(writer, step, found)
            writer.finish_step(step)


def rms(tensor: torch.Tensor) -> float:
    values = tensor.double().numpy()
    return float(np.sqrt(np.mean(values * values)))


def test_bf16_rounding_agrees_and_a_one_percent_scale_is_found_by_the_moments():
    generator = torch.Generator().manual_seed(0)
    exact = torch.randn(64, 48, generator=generator)
    base = exact.bfloat16()
    # Another backend: the same values from an fp32 computation a few ulps away, rounded again.
    jitter = 1 + 3 * BF16_EPS * torch.randn(exact.shape, generator=generator)
    rounded = (exact * jitter).bfloat16()
    bug = (exact * 1.01).bfloat16()  # 1.01: about 1.3 ulps, within what rounding does to single values
    clean = compare_records(record("x", base), record("x", rounded))
    assert not clean.diverged, clean
    found = compare_records(record("x", base), record("x", bug))
    assert found.diverged
    broken = {m.metric for m in found.metrics if m.ratio > 1}
    assert broken and broken <= {"std", "norm", "mean"}, found  # no single value tells it from rounding
    scale = rms(base)
    numel = base.numel()
    by_metric = {m.metric: m for m in found.metrics}
    mtol = max(0.64 * BF16_EPS, 16 * BF16_EPS / math.sqrt(numel))  # docs/compare.md: max(mtol, rtol / sqrt(numel))
    norm = float(np.linalg.norm(base.double().numpy()))
    assert by_metric["norm"].tolerance == pytest.approx(mtol * max(norm, scale), rel=1e-12)
    sample = by_metric["samples"]
    assert sample.tolerance == pytest.approx(16 * BF16_EPS * max(abs(sample.base), scale), rel=1e-6)


def test_a_sample_is_judged_by_its_tensors_scale_both_ways():
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(256, generator=generator)
    base, other = record("big", values), record("big", values)
    # A sample near zero of a tensor of scale 1, 6e-6 away: rounding there (fp32 rtol 1e-4 of the tensor's rms).
    base["samples"], other["samples"] = [1e-7, 0.5], [6e-6, 0.5]
    base["sample_indices"] = other["sample_indices"] = [0, 1]
    assert not compare_records(base, other).diverged
    assert compare_records(base, other, CompareConfig(rtol=1e-4, atol=1e-6)).diverged  # the former rule
    # A tensor of scale 1e-7 changed by 10%: below the former atol, far beyond the default.
    small = values * 1e-7
    assert compare_records(record("small", small), record("small", small * 1.1)).diverged
    assert not compare_records(record("small", small), record("small", small * 1.1),
                               CompareConfig(rtol=1e-4, atol=1e-6)).diverged


def test_integer_tensors_compare_exactly():
    values = torch.arange(1000, dtype=torch.int64) * 1_000_003
    other = values.clone()
    other[-1] += 1
    found = compare_records(record("ids", values), record("ids", other))
    assert found.diverged and "max" in {m.metric for m in found.metrics if m.ratio > 1}
    assert not compare_records(record("ids", values), record("ids", values.clone())).diverged


def _mixed_step(tmp_path, factor: float, jitter: float = 0.0) -> tuple:
    """A step of a bf16-autocast run: a bf16 matmul output and the fp32 residual it was added to; in the other
    run the bf16 part is scaled by ``factor`` and rounded ``jitter`` ulps away (at random), the residual the same."""
    generator = torch.Generator().manual_seed(2)
    residual = torch.randn(32, 16, generator=generator)
    update = (residual @ torch.randn(16, 16, generator=generator)).bfloat16()
    total = residual + update.float()
    moved = update.float() * factor * (1 + jitter * BF16_EPS * torch.randn(update.shape, generator=generator))
    other_total = residual + moved.bfloat16().float()
    write(tmp_path / "base", {0: [record("mlp.output.0", update, seq=0), record("layer.output.0", total, seq=1)]})
    write(tmp_path / "other", {0: [record("mlp.output.0", update, seq=0),
                                   record("layer.output.0", other_total, seq=1)]})
    return tmp_path / "base", tmp_path / "other"


def test_fp32_records_of_a_bf16_step_get_bf16_tolerances_whatever_the_filters(tmp_path):
    base, other = _mixed_step(tmp_path, 1.0, jitter=2.0)  # the bf16 part rounded a few ulps away
    report = compare_dumps(base, other)
    assert report.agrees
    (diff,) = [r for r in report.records if r.name == "layer.output.0"]
    assert max(m.ratio for m in diff.metrics) > 0
    # Selecting the fp32 record alone does not make it fp32 again: the step's dtypes are read before the filter.
    assert compare_dumps(base, other, names=["layer.*"]).agrees
    assert not compare_dumps(base, other, rtol=1e-4, atol=1e-6).agrees  # at float32's precision it differs


def test_a_parameter_record_is_at_least_at_its_modules_scale(tmp_path):
    """Measured on BERT and OPT, eager against ORTModule and inductor: the key projection's bias gradient is zero in
    exact arithmetic (a softmax ignores a shift common to a row), so both runs hold rounding noise of ~1e-11 where
    the weight gradient is ~1e-4: relative to itself it differs completely, relative to its module it is noise."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 32, generator=generator) * 1e-4
    noise_b, noise_o = (torch.randn(32, generator=generator) * 2e-11 for _ in range(2))
    steps_b = {0: [record("k.weight", weight, "grad", 0, module="k"), record("k.bias", noise_b, "grad", 1, module="k")]}
    steps_o = {0: [record("k.weight", weight, "grad", 0, module="k"), record("k.bias", noise_o, "grad", 1, module="k")]}
    write(tmp_path / "base", steps_b)
    write(tmp_path / "other", steps_o)
    assert compare_dumps(tmp_path / "base", tmp_path / "other").agrees
    # On its own (no module to scale with), the bias's noise diverges; so does a real change of the bias.
    assert compare_records(steps_b[0][1], steps_o[0][1]).diverged
    write(tmp_path / "bug", {0: [steps_o[0][0], record("k.bias", noise_b + 1e-7, "grad", 1, module="k")]})
    assert not compare_dumps(tmp_path / "base", tmp_path / "bug").agrees


def test_explicit_rtol_or_atol_keep_the_fixed_rule(tmp_path):
    base, other = _mixed_step(tmp_path, 1.05)
    for given, (rtol, atol) in (({"rtol": 1e-3, "atol": 1e-5}, (1e-3, 1e-5)), ({"rtol": 1e-3}, (1e-3, 1e-6)),
                                ({"atol": 1e-2}, (1e-4, 1e-2)), ({"rtol": 0.0, "atol": 0.0}, (0.0, 0.0))):
        report = compare_dumps(base, other, **given)
        for diff in report.records:
            for metric in diff.metrics:
                if isinstance(metric.base, float) and metric.metric != "samples":
                    assert metric.tolerance == atol + rtol * abs(metric.base), (given, metric)
        assert report.to_json()["tolerance"] == {"rtol": rtol, "atol": atol, "noise_factor": 10.0}
    assert CompareConfig().fixed is None and CompareConfig(atol=0.0).fixed == (1e-4, 0.0)
    with pytest.raises(ValueError, match="rtol must be a finite number"):
        CompareConfig(rtol=-1.0)


def test_the_reports_show_the_per_dtype_defaults(tmp_path):
    base, other = _mixed_step(tmp_path, 1.05)
    report = compare_dumps(base, other)
    text = format_report(report)
    assert "defaults  rtol/mtol" in text and "bfloat16 0.125/0.005" in text and "float32 0.0001/1e-05" in text
    tolerance = report.to_json()["tolerance"]
    assert tolerance["rtol"] is None and tolerance["atol"] is None
    assert tolerance["per_dtype"]["bfloat16"] == {"rtol": 0.125, "mtol": 0.64 * BF16_EPS, "tiny": 2.0 ** -126}
    assert set(tolerance["per_dtype"]) == set(PRECISIONS)
    write_html(report, tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "per-dtype defaults" in page and "rtol*max(|base|, rms)" in page
    fixed = format_report(compare_dumps(base, other, rtol=1e-3))
    assert "atol + rtol*|base|  (rtol 0.001, atol 1e-06)" in fixed and "defaults  rtol/mtol" not in fixed


def test_the_command_line_takes_rtol_alone(tmp_path):
    base, other = _mixed_step(tmp_path, 1.0, jitter=2.0)
    command = [sys.executable, "-m", "probes", "compare", str(base), str(other)]
    assert subprocess.run(command, capture_output=True, text=True).returncode == 0
    fixed = subprocess.run([*command, "--rtol", "1e-4", "--json", str(tmp_path / "r.json")], capture_output=True,
                           text=True)
    assert fixed.returncode == 1, fixed.stderr
    assert json.loads((tmp_path / "r.json").read_text())["tolerance"]["atol"] == 1e-6
