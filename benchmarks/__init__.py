"""Benchmarks: every figure is a ratio against a baseline measured in the same run."""
