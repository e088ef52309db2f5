"""The column-wise comparison (probes.compare.vector) decides every pair exactly as compare_records does.

Random adversarial pairs (nan, inf, None, integers, overflow, signed zeros, shape/dtype/count changes,
samples at other positions or of other lengths, a zero tolerance, a noise run) go through compare_dumps;
each matched record's ratio, verdict, relative error, worst metric and noise level must equal what the
record-by-record rules (compare_records, record_noise) give for the same two records.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from probes.compare import compare_dumps
from probes.compare.config import CompareConfig
from probes.compare.engine import compare_records, record_noise
from probes.compare.results import CellView
from probes.dump import DumpWriter, load_dump

SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-300, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), 3.5, 1e-7]


def base_record(rng: random.Random, index: int) -> dict:
    length = rng.choice([0, 1, 4, 8])
    numel = max(length, 1) * rng.choice([1, 3])
    samples = [rng.gauss(0, 1) for _ in range(length)]
    return {"name": f"r{index}", "phase": rng.choice(["forward", "backward"]), "seq": index,
            "shape": [numel], "dtype": "float32", "numel": numel, "nan": 0, "inf": 0, "zero": 0,
            "min": min(samples, default=0.0), "max": max(samples, default=0.0), "mean": rng.gauss(0, 1),
            "std": abs(rng.gauss(1, 0.1)), "samples": samples,
            "sample_indices": sorted(rng.sample(range(numel), length))}


def perturb(rng: random.Random, record: dict, amount: float) -> dict:
    """A copy with small changes, and now and then something unusual."""
    other = {**record, "samples": list(record["samples"]), "sample_indices": list(record["sample_indices"])}
    for key in ("min", "max", "mean", "std"):
        other[key] = record[key] * (1 + rng.choice([0.0, amount, -amount, 10 * amount]))
    other["samples"] = [value * (1 + rng.choice([0.0, amount, 3 * amount])) for value in other["samples"]]
    odd = rng.randrange(24)
    if odd == 0:
        other["mean"] = rng.choice(SPECIAL)
    elif odd == 1 and other["samples"]:
        other["samples"][rng.randrange(len(other["samples"]))] = rng.choice(SPECIAL)
    elif odd == 2:
        other[rng.choice(["mean", "std", "min"])] = None
    elif odd == 3:
        other["shape"] = [other["numel"], 1]
    elif odd == 4:
        other["dtype"] = "bfloat16"
    elif odd == 5:
        other["nan"] = 1
    elif odd == 6:
        other.pop("std")
    elif odd == 7 and other["sample_indices"]:
        other["sample_indices"][0] = other["sample_indices"][0] + other["numel"]  # another position
    elif odd == 8 and other["samples"]:
        other["samples"] = other["samples"][:-1]  # one sample fewer
    elif odd == 9:
        other["min"], other["max"] = 3, 7  # an integer tensor's statistics (exact ints)
    elif odd == 10:
        other["mean"] = True  # not a number: kept in "extra"
    elif odd == 11:
        other.pop("samples")
    elif odd == 12:
        other["max"] = 1e308 if record["max"] < 0 else -1e308  # a difference beyond the float range
    elif odd == 13:
        other["numel"] = None
    return other


def write(path, records) -> None:
    with DumpWriter(path) as writer:
        for record in records:
            writer.write(0, record)
        writer.finish_step(0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tolerance", [{}, {"rtol": 0.0, "atol": 0.0}, {"rtol": 1e-3, "atol": 1e-5}])
def test_every_pair_is_decided_as_compare_records_decides_it(tmp_path, seed, tolerance):
    rng = random.Random(seed)
    base = [base_record(rng, index) for index in range(300)]
    for record in base[:: 17]:  # odd values in the base run too
        record["mean"] = rng.choice(SPECIAL)
        if record["samples"]:
            record["samples"][0] = rng.choice(SPECIAL)
    other = [perturb(rng, record, 1e-6) for record in base]
    noise = [perturb(rng, record, 1e-8) for record in base]
    for path, records in (("base", base), ("other", other), ("noise", noise)):
        write(tmp_path / path, records)
    config = CompareConfig(**tolerance)
    by_name = {path: {r["name"]: r for r in load_dump(tmp_path / path)} for path in ("base", "other", "noise")}
    for use_noise in (False, True):
        report = compare_dumps(tmp_path / "base", tmp_path / "other", noise=tmp_path / "noise" if use_noise else None,
                               **tolerance)
        records = report.records
        assert len(records) == len(base)
        views = records.views(np.arange(len(records)))
        for index in range(len(records)):
            phase, name = records.phase_name(index)
            b, o = by_name["base"][name], by_name["other"][name]
            level = record_noise(b, by_name["noise"][name]) if use_noise else None
            expected = compare_records(b, o, config, level)
            assert records.ratio[index] == expected.ratio, (name, b, o)
            assert bool(records.diverged[index]) == expected.diverged, (name, b, o)
            assert records.rel_error[index] == expected.rel_error, (name, b, o)
            view, want = views[index], CellView.of(expected)
            assert (view.metric, view.diverged, view.ratio) == (want.metric, want.diverged, want.ratio), name
            for got, value in ((view.base, want.base), (view.other, want.other)):
                assert got == value or (isinstance(got, float) and math.isnan(got) and math.isnan(value)) \
                    or view.metric in (None, "shape", "dtype", "numel", "nan", "inf"), (name, got, value)
            built = records[index]  # the record itself, built on demand, is compare_records' own
            assert built.ratio == expected.ratio and built.noise == level
        assert report.diverged_count == sum(
            compare_records(by_name["base"][n], by_name["other"][n], config,
                            record_noise(by_name["base"][n], by_name["noise"][n]) if use_noise else None).diverged
            for n in by_name["base"])
        if use_noise:
            unmatched = sum(record_noise(by_name["base"][n], by_name["noise"][n]) is None for n in by_name["base"])
            assert report.noise_unmatched == unmatched


def test_records_and_verdicts_of_a_report_are_the_same_as_a_list(tmp_path):
    rng = random.Random(7)
    base = [base_record(rng, index) for index in range(50)]
    write(tmp_path / "base", base)
    write(tmp_path / "other", [perturb(rng, record, 1e-3) for record in base])
    report = compare_dumps(tmp_path / "base", tmp_path / "other")
    listed = list(report.records)
    assert [r.name for r in listed] == [report.records[i].name for i in range(len(listed))]
    assert report.divergences == [r.divergence() for r in listed if r.diverged]
    assert report.records.worst(5) == sorted((r for r in listed if r.ratio > 0), key=lambda r: r.ratio,
                                             reverse=True)[:5]
    assert report.records[-1] is listed[-1] and report.records[1:3] == listed[1:3]
    with pytest.raises(IndexError):
        report.records[len(listed)]
