"""The public surface, exactly: every package's ``__all__``. Growing it is a decision; update docs/api.md too.

Everything not listed here is private: importable from its module for tests and tools, but free to change.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SURFACE: dict[str, list[str]] = {
    "probes": ["AnomalyError", "AnomalySentinel", "ConfigError", "GlobalSubscriberManager", "ProbeEvent", "ProbeFailureWarning",
               "ProbeSite", "StatisticsSubscriber", "SubscriberBase", "SubscriberManager", "Subscription",
               "ZeROOffloadSubscriber", "configure_ort_compatible_zero_stage3", "from_config", "inspect_activation",
               "load_dump", "load_table"],
    "probes.core": ["GlobalSubscriberManager", "ProbeEvent", "ProbeFailureWarning", "ProbeSite", "SubscriberBase",
                    "SubscriberManager", "Subscription", "inspect_activation"],
    "probes.stats": ["AnomalyError", "AnomalySentinel", "AnomalyWarning", "StatisticsSubscriber",
                     "SubscriberClosedWarning", "TensorSummary", "UnsupportedTensorWarning", "summarize"],
    "probes.dump": ["DumpFormatError", "DumpReader", "DumpWriteError", "Record", "first_anomaly", "load_dump",
                    "load_table"],
    "probes.compare": ["NameMap", "NameMapError", "Report", "compare_dumps", "format_report", "load_name_map",
                       "write_html"],
    "probes.sinks": ["ExportSummary", "LiveTensorBoard", "export_dump", "write_tensorboard"],
    "probes.zero3": ["DeepCopiedModuleError", "ZeROOffloadSubscriber", "configure_ort_compatible_zero_stage3",
                     "restore_zero_stage3_hooks"],
    "probes.testing": ["assert_parity", "inject_bug", "perturbed_rounding"],
    "probes.replay": ["ModuleCapture", "replay_module"],
    "probes.integrations": [],
    "probes.integrations.transformers": ["ProbesCallback"],
    "probes.integrations.lightning": ["ProbesCallback"],
    "probes.utils": [],
    "probes.cli": [],
    "exporters": ["ProbeExportWarning", "PythonOpExportError", "export_onnx", "inference_session", "install_for_ort", "ortmodule_threads",
                  "partitioned_embedding_export", "register_probe_function"],
}
# The original onnxruntime hooks' names, which a user keeps by changing only the import.
SEED = ["SubscriberManager", "GlobalSubscriberManager", "SubscriberBase", "StatisticsSubscriber", "inspect_activation",
        "ZeROOffloadSubscriber", "configure_ort_compatible_zero_stage3"]


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_the_public_names_are_exactly_these(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(SURFACE[package])
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_the_public_surface_has_54_distinct_names_each_added_for_a_reason() -> None:
    distinct = {name for names in SURFACE.values() for name in names}
    # 47 after issue 25.
    # 51: probes.testing.perturbed_rounding (issue 34), the one way to make a calibration run for the noise floor.
    # 52: exporters.ortmodule_threads (issue 35): ORTModule has no setting for its threads, and ranks sharing a
    # machine need one.
    # 54: probes.replay's ModuleCapture and replay_module (issue 36): a module's own error, on its captured call,
    # with nothing carried in from upstream; op records themselves are a keyword (ops=), not a name.
    assert len(distinct) == 54, sorted(distinct)


def test_the_original_names_keep_working_from_probes() -> None:
    import probes

    assert set(SEED) <= set(probes.__all__)
    original = importlib.import_module("probes.merge_activation_summary")
    assert callable(original.main)


def test_every_public_name_is_documented_in_api_md() -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", api))
    missing = sorted({name for names in SURFACE.values() for name in names} - documented)
    assert missing == []


@pytest.mark.parametrize("removed", ["probes.numerics", "probes.statistics", "probes.report_html", "probes.export"])
def test_the_moved_modules_of_this_version_are_gone(removed: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(removed)
