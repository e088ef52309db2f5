"""Kept so that ``probes.numerics`` imports keep working: the statistics numerics live in ``probes.stats.numerics``."""

from .stats.numerics import TensorSummary, backend, sample_indices, summarize, take_samples

__all__ = ["TensorSummary", "backend", "sample_indices", "summarize", "take_samples"]
