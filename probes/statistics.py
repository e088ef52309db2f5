"""Kept so that ``probes.statistics`` imports keep working: the subscriber lives in ``probes.stats.subscriber``."""

from .stats.subscriber import StatisticsSubscriber, SubscriberClosedWarning, UnsupportedTensorWarning

__all__ = ["StatisticsSubscriber", "SubscriberClosedWarning", "UnsupportedTensorWarning"]
