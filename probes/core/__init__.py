"""The core floor: probe sites and events, the subscriber interface, the probe Functions, the manager.

    from probes.core import SubscriberManager, SubscriberBase
"""

from .failures import ProbeFailureWarning
from .manager import GlobalSubscriberManager, SubscriberManager, Subscription, inspect_activation
from .interface import ProbeEvent, ProbeSite, SubscriberBase

__all__ = [
    "GlobalSubscriberManager", "ProbeEvent", "ProbeFailureWarning", "ProbeSite", "SubscriberBase",
    "SubscriberManager", "Subscription", "inspect_activation",
]
