"""Exact tensor statistics: the numerics (compute on a bucket, merge buckets), the C++ kernel, the
views of odd tensors, the record of one tensor, and ``StatisticsSubscriber``, which records them for
every probed tensor.

    from probes.stats import StatisticsSubscriber, summarize, tensor_record
"""

from .numerics import TensorSummary, backend, sample_indices, summarize, take_samples
from .record import tensor_record
from .sentinel import AnomalyError, AnomalySentinel, AnomalyWarning
from .recorder import StatisticsSubscriber, SubscriberClosedWarning, UnsupportedTensorWarning

__all__ = ["AnomalyError", "AnomalySentinel", "AnomalyWarning", "StatisticsSubscriber", "SubscriberClosedWarning", "TensorSummary", "UnsupportedTensorWarning",
           "backend", "sample_indices", "summarize", "take_samples", "tensor_record"]
