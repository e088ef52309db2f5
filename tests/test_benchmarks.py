"""The benchmarks run in a reduced form (small sizes, few repeats) so that they cannot rot."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.__main__ import BENCHMARKS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_in_quick_form(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name == name:
            pytest.skip(f"{name} is not part of this checkout")
        raise
    section = module.run(quick=True)
    lines = section.splitlines()
    if lines[-1].endswith("not installed: not measured."):  # e.g. ORTModule's benchmark on the modern lane
        pytest.skip(lines[-1])
    assert lines[0].startswith("### ")
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| ---")]
    assert len(rows) >= 2, section  # a header and at least one measured row
    assert "nan" not in section.lower().replace("nanosecond", "")
