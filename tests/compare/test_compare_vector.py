"""The comparison rules (probes.compare.pairs and evaluation, on whole columns) against an independent statement
of them.

Random adversarial pairs (nan, inf, None, integers, overflow, signed zeros, shape/dtype/count changes,
samples at other positions or of other lengths, a zero tolerance, a noise run) go through compare_dumps;
each matched record's ratio, verdict, relative error, worst metric, noise level and every field of its
RecordDiff must equal what ``expected_record`` and ``expected_noise`` below give: the rules of
docs/compare.md written out in plain Python, one record at a time, sharing no code with probes.compare.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from probes.compare import compare_dumps
from probes.compare.options import CompareConfig
from probes.compare.pairs import from_columns, match
from probes.compare.reading import read_dump
from probes.compare.results import CellView, MetricDiff, RecordDiff
from probes.dump import load_dump
from probes.dump.writer import DumpWriter
from dump_records import write_record

SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-300, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), 3.5, 1e-7]


def base_record(rng: random.Random, index: int) -> dict:
    length = rng.choice([0, 1, 4, 8])
    numel = max(length, 1) * rng.choice([1, 3, 1000])
    samples = [rng.gauss(0, 1) for _ in range(length)]
    # Step 1 (odd indices) has bfloat16 records: its float32 records are compared at bfloat16's tolerance.
    dtype = rng.choice(["float32"] * 8 + ["int64"] + (["bfloat16"] if index % 2 else ["float32"]))
    # grad records of modules m0..m4: a parameter's scale is at least the largest of its module's (per step).
    return {"name": f"r{index}", "phase": rng.choice(["forward", "backward", "grad"]), "seq": index,
            "module": f"m{index % 5}",
            "shape": [numel], "dtype": dtype, "numel": numel, "nan": 0, "inf": 0, "zero": 0,
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
            write_record(writer, int(record["name"][1:]) % 2, record)
        writer.finish_step(0)
        writer.finish_step(1)


# --------------------------------------------------------------------------------------------- the rules, by hand

STRUCTURE, COUNTS, MOMENTS = ("shape", "dtype", "numel"), ("nan", "inf"), ("min", "max", "mean", "std", "norm")


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def same_value(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


# The per-dtype defaults (docs/compare.md): (rtol, mtol, smallest normal) of the precisions these records use.
DEFAULTS = {"float32": (1e-4, 1e-5, 2.0 ** -126), "bfloat16": (2.0 ** -7 * 16, 2.0 ** -7 * 0.64, 2.0 ** -126),
            "exact": (0.0, 1e-13, 0.0)}


def precision_of(record: dict, step_dtypes: set) -> str:
    """A record's precision: exact for integers, else the least precise float dtype of its step."""
    if record["dtype"] == "int64":
        return "exact"
    return "bfloat16" if "bfloat16" in step_dtypes else "float32"


def rms_of(record: dict) -> float:
    numel = record["numel"] if number(record.get("numel")) and record["numel"] > 0 else 1
    mean, std = (record.get(key) if number(record.get(key)) else 0.0 for key in ("mean", "std"))
    return float(np.hypot(mean, std * np.sqrt((numel - 1) / numel)))


def tolerance_of(config: CompareConfig, value, noise, statistic: str, record: dict, step: list):
    """``noise``: the record's levels per statistic (None: none); ``step``: the base records of the record's step."""
    moment = statistic in ("mean", "std", "norm")
    if config.rtol is None and config.atol is None:
        rtol, mtol, tiny = DEFAULTS[precision_of(record, {r["dtype"] for r in step})]
        numel = record["numel"] if number(record.get("numel")) and record["numel"] > 0 else 1
        scale = rms_of(record)
        if record["phase"] == "grad":
            scale = max([scale] + [rms_of(r) for r in step if r["phase"] == "grad" and r["module"] == record["module"]])
        if moment:  # gradients' moments: twice the activations' floor (forward and backward)
            rtol = max(mtol * (1 if record["phase"] == "forward" else 2), rtol / math.sqrt(numel))
        fixed = rtol * max(abs(value) if number(value) else 0.0, scale, tiny)
    else:
        rtol = 1e-4 if config.rtol is None else config.rtol
        atol = 1e-6 if config.atol is None else config.atol
        fixed = atol + rtol * abs(value) if number(value) else atol
    return max(fixed, config.noise_factor * noise[statistic]) if noise else fixed


def floor_of(config: CompareConfig, noise, statistic):
    return config.noise_factor * noise[statistic] if noise is not None else None


def metric(name, b, o, tolerance, index=None, floor=None) -> MetricDiff:
    if not (number(b) and number(o)):
        size = 0.0 if same_value(b, o) else math.inf
        return MetricDiff(name, b, o, size, size, tolerance, index, floor)
    size = float(abs(o - b))
    return MetricDiff(name, b, o, size, size / abs(b) if b != 0 else (0.0 if size == 0 else math.inf), tolerance, index,
                      floor)


def sample_pairs(base: dict, other: dict, notes: list | None = None) -> list:
    lists = [base.get("sample_indices"), base.get("samples"), other.get("sample_indices"), other.get("samples")]
    if not all(isinstance(item, list) for item in lists):
        return []
    b_idx, b_val, o_idx, o_val = lists
    if b_idx == o_idx:
        return list(zip(b_idx, b_val, o_val))
    at = dict(zip(o_idx, o_val))
    pairs = [(i, v, at[i]) for i, v in zip(b_idx, b_val) if i in at]
    if notes is not None:
        notes.append(f"sample_indices differ: compared the {len(pairs)} common positions")
    return pairs


def expected_noise(base: dict, base2: dict):
    """The noise levels of docs/compare.md (Noise floor), per statistic."""
    if any(base.get(key) != base2.get(key) for key in STRUCTURE):
        return None
    change = {k: float(abs(base2[k] - base[k])) if number(base.get(k)) and number(base2.get(k)) else 0.0
              for k in MOMENTS}
    samples = [float(abs(y - x)) for _, x, y in sample_pairs(base, base2) if number(x) and number(y)]
    count = sum(sign * base[k] for k, sign in (("numel", 1), ("nan", -1), ("inf", -1)) if number(base.get(k)))
    root = math.sqrt(max(count, 0))
    per_value = 1 / root if root else 0.0
    largest = max(samples, default=0.0)
    scale = largest if largest > 0 and math.isfinite(largest) else 1.0
    total = 0.0
    for diff in samples:  # the squares of diff / largest, in position order
        part = diff / scale
        total += part * part  # correctly rounded: ``part ** 2`` (C pow) can be an ulp off
    rms = scale * math.sqrt(total / max(len(samples), 1)) if math.isfinite(largest) else math.inf
    floor = rms * per_value if root else 0.0
    value = max(change["min"], change["max"], change["mean"], change["norm"] * per_value, largest)
    return {"min": value, "max": value, "mean": max(change["mean"], floor), "std": max(change["std"], floor),
            "norm": max(change["norm"], floor * root), "samples": value}


def expected_record(base: dict, other: dict, config: CompareConfig, noise, step: list) -> RecordDiff:
    metrics, notes = [], []
    for key in (*STRUCTURE, *COUNTS):
        b, o = base.get(key), other.get(key)
        if b != o:
            size = abs(o - b) if key in COUNTS and number(b) and number(o) else math.inf
            metrics.append(MetricDiff(key, b, o, float(size), math.inf, 0.0))
    for key in MOMENTS:
        b, o = base.get(key), other.get(key)
        if not ((b is None and o is None) or (key == "norm" and (b is None or o is None))):
            metrics.append(metric(key, b, o, tolerance_of(config, b, noise, key, base, step),
                                  floor=floor_of(config, noise, key)))
    record = RecordDiff(base["rank"], base["step"], base["phase"], base["name"], base.get("seq", 0), metrics,
                        noise=noise, notes=notes)
    pairs = sample_pairs(base, other, notes) if base.get("shape") == other.get("shape") else []
    if pairs:
        worst, worst_ratio, dot, norm_b, norm_o, largest = 0, -1.0, 0.0, 0.0, 0.0, 0.0
        for position, (_, b, o) in enumerate(pairs):
            try:
                diff = abs(o - b)
            except TypeError:
                diff = math.inf
            if math.isfinite(diff):
                dot, norm_b, norm_o = dot + b * o, norm_b + b * b, norm_o + o * o
            else:
                diff = 0.0 if same_value(b, o) else math.inf
            if diff:
                tolerance = tolerance_of(config, b, noise, "samples", base, step)
                ratio = diff / tolerance if tolerance > 0 else math.inf
                if ratio > worst_ratio:
                    worst, worst_ratio = position, ratio
            largest = max(largest, diff)
        index, b, o = pairs[worst]
        metrics.append(metric("samples", b, o, tolerance_of(config, b, noise, "samples", base, step), index,
                              floor_of(config, noise, "samples")))
        record.samples_compared, record.samples_max_abs = len(pairs), largest
        record.samples_cosine = (1.0 if norm_b == 0 and norm_o == 0 else 0.0 if norm_b == 0 or norm_o == 0
                                 else dot / math.sqrt(norm_b * norm_o))
    return record


def same_fields(got, want) -> bool:
    """Equal, nan equal to nan, and of the same type (an int and a float print differently in the JSON)."""
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return type(got) is type(want) and got == want


def assert_same_record(got: RecordDiff, want: RecordDiff) -> None:
    assert (got.rank, got.step, got.phase, got.name, got.seq, got.notes) == \
        (want.rank, want.step, want.phase, want.name, want.seq, want.notes)
    assert [m.metric for m in got.metrics] == [m.metric for m in want.metrics], want.name
    for mine, theirs in zip(got.metrics, want.metrics):
        for field in ("base", "other", "abs_diff", "rel_diff", "tolerance", "index", "floor"):
            assert same_fields(getattr(mine, field), getattr(theirs, field)), (want.name, mine, theirs, field)
    for field in ("samples_compared", "samples_max_abs", "samples_cosine"):
        assert same_fields(getattr(got, field), getattr(want, field)), (want.name, field)
    assert (got.noise is None) == (want.noise is None), want.name
    if want.noise is not None:
        assert got.noise.keys() == want.noise.keys(), want.name
        for key in want.noise:
            assert same_fields(got.noise[key], want.noise[key]), (want.name, key, got.noise, want.noise)
    assert got.to_json() == want.to_json()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tolerance", [{}, {"rtol": 0.0, "atol": 0.0}, {"rtol": 1e-3, "atol": 1e-5}, {"rtol": 1e-3}])
def test_every_pair_is_decided_by_the_rules(tmp_path, seed, tolerance):
    rng = random.Random(seed)
    base = [base_record(rng, index) for index in range(300)]
    for record in base[:: 17]:  # odd values in the base run too
        record["mean"] = rng.choice(SPECIAL)
        if record["samples"]:
            record["samples"][0] = rng.choice(SPECIAL)
    # Changes around the fixed rules' tolerances, and around float32's and bfloat16's defaults.
    other = [perturb(rng, record, 1e-6 if tolerance else 1e-3) for record in base]
    noise = [perturb(rng, record, 1e-8) for record in base]
    for path, records in (("base", base), ("other", other), ("noise", noise)):
        write(tmp_path / path, records)
    config = CompareConfig(**tolerance)
    by_name = {path: {r["name"]: r for r in load_dump(tmp_path / path)} for path in ("base", "other", "noise")}
    steps = {step: [r for r in by_name["base"].values() if r["step"] == step] for step in (0, 1)}
    assert "bfloat16" in {r["dtype"] for r in steps[1]} and "bfloat16" not in {r["dtype"] for r in steps[0]}

    def wanted(name: str, level) -> RecordDiff:
        b = by_name["base"][name]
        return expected_record(b, by_name["other"][name], config, level, steps[b["step"]])

    for use_noise in (False, True):
        report = compare_dumps(tmp_path / "base", tmp_path / "other", noise=tmp_path / "noise" if use_noise else None,
                               **tolerance)
        records = report.records
        assert len(records) == len(base)
        views = records.views(np.arange(len(records)))
        for index in range(len(records)):
            phase, name = records.phase_name(index)
            b, o = by_name["base"][name], by_name["other"][name]
            level = expected_noise(b, by_name["noise"][name]) if use_noise else None
            expected = wanted(name, level)
            assert same_fields(float(records.ratio[index]), expected.ratio), (name, b, o)  # inf / inf: nan
            assert bool(records.diverged[index]) == expected.diverged, (name, b, o)
            assert records.rel_error[index] == expected.rel_error, (name, b, o)
            view, want = views[index], CellView.of(expected)
            assert (view.metric, view.diverged) == (want.metric, want.diverged), name
            assert same_fields(float(view.ratio), float(want.ratio)), name
            for got, value in ((view.base, want.base), (view.other, want.other)):
                assert got == value or (isinstance(got, float) and math.isnan(got) and math.isnan(value)) \
                    or view.metric in (None, "shape", "dtype", "numel", "nan", "inf"), (name, got, value)
            assert_same_record(records[index], expected)  # the record itself, built on demand
        assert report.diverged_count == sum(
            wanted(n, expected_noise(by_name["base"][n], by_name["noise"][n]) if use_noise else None).diverged
            for n in by_name["base"])
        if use_noise:
            unmatched = sum(expected_noise(by_name["base"][n], by_name["noise"][n]) is None for n in by_name["base"])
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


def test_integer_tensors_are_compared_exactly_on_their_columns(tmp_path):
    """Integer tensors' statistics and samples differ by 1 at 2**62, or by more than an int64 holds: the
    verdicts (every pair on its columns, none through Python records) are those of Python's exact integers."""
    top = 1 << 62

    def record(index: int, samples: list[int], **values) -> dict:
        return {"name": f"r{index}", "phase": "forward", "seq": index, "module": "m0", "shape": [8], "dtype": "int64",
                "numel": 8, "nan": 0, "inf": 0, "zero": 0, "min": min(samples), "max": max(samples), "mean": 1.5,
                "std": 2.5, "samples": samples, "sample_indices": list(range(0, 16, 2)), **values}

    samples = [top + step for step in range(8)]
    base = [record(index, samples) for index in range(8)]
    other = [record(0, samples), record(1, samples, max=top + 8), record(2, [*samples[:3], top + 4, *samples[4:]]),
             record(3, samples, min=-(1 << 63), max=(1 << 63) - 1), record(4, [-value for value in samples]),
             record(5, samples, min=float(top)), record(6, [float(value) for value in samples]),
             record(7, samples, mean=1.5 + 1e-9)]
    write(tmp_path / "base", base)
    write(tmp_path / "other", other)
    loaded = [read_dump(tmp_path / path, progress=False) for path in ("base", "other")]
    _, odd = from_columns(*loaded, match(*loaded))
    assert not odd.any()  # on columns, integers included
    by_name = {path: {r["name"]: r for r in load_dump(tmp_path / path)} for path in ("base", "other")}
    steps = {step: [r for r in by_name["base"].values() if r["step"] == step] for step in (0, 1)}
    config = CompareConfig()
    report = compare_dumps(tmp_path / "base", tmp_path / "other")
    records = report.records
    for index in range(len(records)):
        _, name = records.phase_name(index)
        b = by_name["base"][name]
        expected = expected_record(b, by_name["other"][name], config, None, steps[b["step"]])
        assert same_fields(float(records.ratio[index]), expected.ratio), name
        assert bool(records.diverged[index]) == expected.diverged, name
        assert records.rel_error[index] == expected.rel_error, name
    diverged = {records.phase_name(index)[1] for index in np.flatnonzero(records.diverged)}
    assert diverged == {"r1", "r2", "r3", "r4", "r7"}  # r5, r6: the same values as floats (a float has no more)
