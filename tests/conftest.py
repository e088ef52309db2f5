"""Shared test set-up: lane detection, ORT guard rails, the recording subscriber."""

from __future__ import annotations

import os
import sys

# Any ORTModule test must fail rather than silently run PyTorch.
os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

LANE = os.environ.get("PROBES_LANE", "unknown")


def _ortmodule_importable() -> str | None:
    """None when ORTModule imports, else the reason it does not."""
    try:
        from onnxruntime.training.ortmodule import ORTModule  # noqa: F401
    except Exception as error:  # ImportError, or ORT's own init exceptions
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


_ORT_MISSING = _ortmodule_importable()


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(1)
    if _ORT_MISSING and LANE == "ort":
        raise pytest.UsageError(f"the ort lane must run ORTModule, but importing it failed: {_ORT_MISSING}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _ORT_MISSING:
        return
    skip = pytest.mark.skip(reason=f"ORTModule not available on the {LANE} lane ({_ORT_MISSING})")
    for item in items:
        if "ort" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    return f"probes lane: {LANE}, torch {torch.__version__}, ORTModule: {_ORT_MISSING or 'available'}"
