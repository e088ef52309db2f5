"""probes: graph-embedded training probes for PyTorch, identical in eager PyTorch and ORTModule.

    from probes import SubscriberManager, StatisticsSubscriber
    SubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core import (GlobalSubscriberManager, ProbeEvent, ProbeFailureWarning, ProbeSite, SubscriberBase,
                       SubscriberManager, Subscription, inspect_activation)
    from .dump import load_dump, load_table
    from .stats import AnomalyError, AnomalySentinel, StatisticsSubscriber
    from .zero3 import ZeROOffloadSubscriber, configure_ort_compatible_zero_stage3

# Imported when first used: reading or comparing dumps (``probes compare``) never pays for importing torch.
_HOMES = {
    **dict.fromkeys(("GlobalSubscriberManager", "ProbeEvent", "ProbeFailureWarning", "ProbeSite", "SubscriberBase",
                     "SubscriberManager", "Subscription", "inspect_activation"), "core"),
    **dict.fromkeys(("load_dump", "load_table"), "dump"),
    **dict.fromkeys(("AnomalyError", "AnomalySentinel", "StatisticsSubscriber"), "stats"),
    **dict.fromkeys(("ZeROOffloadSubscriber", "configure_ort_compatible_zero_stage3"), "zero3"),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'probes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AnomalyError",
    "AnomalySentinel",
    "GlobalSubscriberManager",
    "ProbeEvent",
    "ProbeFailureWarning",
    "ProbeSite",
    "StatisticsSubscriber",
    "SubscriberBase",
    "SubscriberManager",
    "Subscription",
    "ZeROOffloadSubscriber",
    "configure_ort_compatible_zero_stage3",
    "inspect_activation",
    "load_dump",
    "load_table",
]
