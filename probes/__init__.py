"""probes: graph-embedded training probes for PyTorch, identical in eager PyTorch and ORTModule.

    from probes import SubscriberManager, StatisticsSubscriber
    SubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])

The names below are imported when first used, so the ``probes`` command's dump tools (show, compare, merge)
start without importing torch.

Diagnostics go to the ``probes`` logger (each module logs to ``probes.<module>``), which has a
``NullHandler`` as a library's should: configure ``logging`` to see them. What a user must act on is a
``warnings.warn``; only the command line prints.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import ConfigError, from_config
    from .core import (GlobalSubscriberManager, ProbeEvent, ProbeFailureWarning, ProbeSite, SubscriberBase,
                       SubscriberManager, Subscription, inspect_activation)
    from .dump import load_dump, load_table
    from .stats import AnomalyError, AnomalySentinel, StatisticsSubscriber
    from .zero3 import ZeROOffloadSubscriber, configure_ort_compatible_zero_stage3

_HOME = {  # public name -> the sub-package that defines it
    "AnomalyError": "stats",
    "AnomalySentinel": "stats",
    "ConfigError": "config",
    "GlobalSubscriberManager": "core",
    "ProbeEvent": "core",
    "ProbeFailureWarning": "core",
    "ProbeSite": "core",
    "StatisticsSubscriber": "stats",
    "SubscriberBase": "core",
    "SubscriberManager": "core",
    "Subscription": "core",
    "ZeROOffloadSubscriber": "zero3",
    "configure_ort_compatible_zero_stage3": "zero3",
    "from_config": "config",
    "inspect_activation": "core",
    "load_dump": "dump",
    "load_table": "dump",
}

__all__ = sorted(_HOME)

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'probes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
