"""Exact tensor statistics: the numerics (compute on a bucket, merge buckets), the C++ kernel, and
``StatisticsSubscriber``, which records them for every probed tensor.

    from probes.stats import StatisticsSubscriber, summarize
"""

from .numerics import TensorSummary, backend, sample_indices, summarize, take_samples
from .subscriber import StatisticsSubscriber, SubscriberClosedWarning, UnsupportedTensorWarning

__all__ = ["StatisticsSubscriber", "SubscriberClosedWarning", "TensorSummary", "UnsupportedTensorWarning",
           "backend", "sample_indices", "summarize", "take_samples"]
