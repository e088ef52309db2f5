"""Exact tensor statistics: the numerics (compute on a bucket, merge buckets), the C++ kernel, the
views of odd tensors, the record of one tensor, and ``StatisticsSubscriber``, which records them for
every probed tensor.

    from probes.stats import StatisticsSubscriber, summarize, tensor_record
"""

from .numerics import TensorSummary, summarize
from .sentinel import AnomalyError, AnomalySentinel, AnomalyWarning
from .recorder import StatisticsSubscriber, SubscriberClosedWarning, UnsupportedTensorWarning

__all__ = [
    "AnomalyError", "AnomalySentinel", "AnomalyWarning", "StatisticsSubscriber", "SubscriberClosedWarning",
    "TensorSummary", "UnsupportedTensorWarning", "summarize",
]
