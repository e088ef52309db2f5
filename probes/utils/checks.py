"""Argument checks with one wording: what was expected, what was given.

    step = check_int(step, "step")                     # a non-negative int (bool is not an int here)
    size = check_int(queue_size, "queue_size", minimum=1)
    int_problem(0, minimum=1)                          # "must be a positive int, got 0" (None when fine)
"""

from __future__ import annotations

from typing import Any


def int_problem(value: Any, *, minimum: int = 0) -> str | None:
    """What is wrong with ``value`` as an int (not a bool) ``>= minimum``; None when nothing is."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        return f"must be {expected}, got {value!r}"
    return None


def check_int(value: Any, what: str, *, minimum: int = 0) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``; else a ValueError naming ``what``."""
    problem = int_problem(value, minimum=minimum)
    if problem:
        raise ValueError(f"{what} {problem}")
    return value
