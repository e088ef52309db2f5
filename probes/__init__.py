"""probes: graph-embedded training probes for PyTorch, identical in eager PyTorch and ORTModule.

    from probes import SubscriberManager, StatisticsSubscriber
    SubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])
"""

from .manager import GlobalSubscriberManager, SubscriberManager, Subscription, inspect_activation
from .subscriber import ProbeEvent, ProbeSite, SubscriberBase

__all__ = [
    "GlobalSubscriberManager",
    "ProbeEvent",
    "ProbeSite",
    "SubscriberBase",
    "SubscriberManager",
    "Subscription",
    "inspect_activation",
]
