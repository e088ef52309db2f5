"""The column path's shortcuts (samples of all-finite pairs, a slice of pairs at a time, runs with the same keys
in the same order, dtype on Arrow columns) against ``compare_records`` and a numpy float64 reference.

Blocks of 32 samples that are finite but for one odd value here and there (nan, inf, an overflowing
difference, a None sample, a zero tolerance), more pairs than one slice of the scan, a dtype of None: each
matched record's ratio, verdict, relative error, worst metric and its values must equal those of the RecordDiff
that ``compare_records`` makes of the same two records, and the worst sample of an all-finite pair must be
where a float64 ratio written here puts it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from probes.compare import compare_dumps
from probes.compare.engine import compare_records
from probes.compare.options import CompareConfig
from probes.compare.results import CellView
from probes.dump import load_dump
from probes.dump.writer import DumpWriter
from dump_records import write_record

COUNT, WIDTH = 5000, 32  # more pairs than one slice of the scan (4096)


def records(rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    base, other = [], []
    for index in range(COUNT):
        values = rng.standard_normal(WIDTH)
        changed = values * (1 + rng.choice([0.0, 1e-6, 1e-3], WIDTH))
        b_samples, o_samples = values.tolist(), changed.tolist()
        odd = index % 23
        position = int(rng.integers(WIDTH))
        if odd == 1:
            b_samples[position] = o_samples[position] = math.nan  # the same nan: no difference
        elif odd == 2:
            o_samples[position] = math.nan
        elif odd == 3:
            b_samples[position], o_samples[position] = math.inf, -math.inf
        elif odd == 4:
            b_samples[position], o_samples[position] = 1e308, -1e308  # finite, their difference is not
        elif odd == 5:
            o_samples[position] = None  # not a float: the pair goes through from_records
        elif odd == 6:
            b_samples = [0.0] * WIDTH  # a zero tolerance where atol is 0
            o_samples = [0.0] * (WIDTH - 1) + [1e-9]
        numel = 2 * WIDTH
        record = {"name": f"layer{index}.output.0", "phase": "forward", "seq": index, "shape": [numel],
                  "dtype": "float32", "numel": numel, "nan": 0, "inf": 0, "zero": 0, "min": float(values.min()),
                  "max": float(values.max()), "mean": float(values.mean()), "std": float(values.std()),
                  "sample_indices": list(range(0, numel, 2))}
        base.append({**record, "samples": b_samples})
        other.append({**record, "samples": o_samples})
        if odd == 7:
            other[-1]["dtype"] = None
        elif odd == 8:
            base[-1]["dtype"] = other[-1]["dtype"] = None
    return base, other


def write(path, rows: list[dict]) -> None:
    with DumpWriter(path) as writer:
        for record in rows:
            write_record(writer, 0, record)
        writer.finish_step(0)


def same(got, want) -> bool:
    return got == want or (isinstance(got, float) and isinstance(want, float) and math.isnan(got) and math.isnan(want))


class Runs:
    """The two runs, written once per module (the records, their order and the permutation are fixed by the seed):
    base, other in the same order and in another; each as loaded by ``load_dump``; and what ``compare_records``
    makes of each pair per tolerance, the reference, computed once per tolerance (it does not depend on the
    order the records are written in). Every test only reads them."""

    def __init__(self, root) -> None:
        rng = np.random.default_rng(3)
        base, other = records(rng)
        self.paths = {"base": root / "base", "same order": root / "other", "other order": root / "shuffled"}
        write(self.paths["base"], base)
        write(self.paths["same order"], other)
        write(self.paths["other order"], [other[i] for i in rng.permutation(COUNT)])
        self.loaded = {side: {r["name"]: r for r in load_dump(self.paths[side])} for side in ("base", "same order")}
        self._expected: dict[tuple, dict] = {}

    def expected(self, tolerance: dict) -> dict:
        """name -> ``compare_records`` of the pair under ``tolerance`` (the reference the column path must equal)."""
        key = tuple(sorted(tolerance.items()))
        if key not in self._expected:
            config = CompareConfig(**tolerance)
            self._expected[key] = {name: compare_records(b, self.loaded["same order"][name], config)
                                   for name, b in self.loaded["base"].items()}
        return self._expected[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("samples"))


@pytest.mark.slow
@pytest.mark.parametrize("shuffled", [False, True], ids=["same order", "other order"])
@pytest.mark.parametrize("tolerance", [{}, {"rtol": 0.0, "atol": 0.0}])
def test_the_column_path_equals_compare_records(runs, shuffled, tolerance):
    config = CompareConfig(**tolerance)
    loaded, reference = runs.loaded, runs.expected(tolerance)
    other = runs.paths["other order" if shuffled else "same order"]
    assert shuffled == ([r["name"] for r in load_dump(other)] != list(loaded["same order"]))
    report = compare_dumps(runs.paths["base"], other, **tolerance)
    found = report.records
    assert len(found) == COUNT
    views = found.views(np.arange(COUNT))
    plain_checked = 0
    for index in range(COUNT):
        name = found.phase_name(index)[1]
        b, o = loaded["base"][name], loaded["same order"][name]
        expected = reference[name]
        assert found.ratio[index] == expected.ratio, name
        assert bool(found.diverged[index]) == expected.diverged, name
        assert found.rel_error[index] == expected.rel_error, name
        view, want = views[index], CellView.of(expected)
        assert (view.metric, view.diverged, view.ratio) == (want.metric, want.diverged, want.ratio), name
        if view.metric not in (None, "dtype"):
            assert same(view.base, want.base) and same(view.other, want.other), name
        if all(isinstance(value, float) and math.isfinite(value) for value in b["samples"] + o["samples"]):
            samples_b, samples_o = np.array(b["samples"], np.float64), np.array(o["samples"], np.float64)
            with np.errstate(over="ignore"):
                diff = np.abs(samples_o - samples_b)
            if np.isfinite(diff).all() and diff.any():
                if tolerance:
                    tol = config.atol + config.rtol * np.abs(samples_b)
                else:  # float32's default: rtol 1e-4 of max(|x|, the tensor's rms), at least its smallest normal
                    numel = b["numel"]
                    rms = float(np.hypot(b["mean"], b["std"] * np.sqrt((numel - 1) / numel)))
                    tol = 1e-4 * np.maximum(np.abs(samples_b), max(rms, 2.0 ** -126))
                with np.errstate(divide="ignore"):
                    ratios = np.where(diff == 0, -1.0, np.where(tol > 0, diff / np.where(tol > 0, tol, 1.0), np.inf))
                worst = int(np.argmax(ratios))
                metric = next(m for m in expected.metrics if m.metric == "samples")
                assert metric.index == b["sample_indices"][worst], name
                assert metric.abs_diff == diff[worst] and metric.tolerance == tol[worst], name
                plain_checked += 1
    assert plain_checked > COUNT // 2
    assert found.diverged.any() and (tolerance or not found.diverged.all())
