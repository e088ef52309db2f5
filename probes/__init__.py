"""probes: graph-embedded training probes for PyTorch, identical in eager PyTorch and ORTModule.

    from probes import SubscriberManager, StatisticsSubscriber
    SubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])
"""

from .core import (GlobalSubscriberManager, ProbeEvent, ProbeFailureWarning, ProbeSite, SubscriberBase, SubscriberManager, Subscription,
                   inspect_activation)
from .dump import load_dump, load_table
from .stats import AnomalyError, AnomalySentinel, StatisticsSubscriber
from .zero3 import ZeROOffloadSubscriber, configure_ort_compatible_zero_stage3

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
