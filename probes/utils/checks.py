"""Argument checks with one wording: what was expected, what was given.

    step = check_int(step, "step")                     # a non-negative int (bool is not an int here)
    size = check_int(queue_size, "queue_size", minimum=1)
"""

from __future__ import annotations

from typing import Any


def check_int(value: Any, what: str, *, minimum: int = 0) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``; else a ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{what} must be {expected}, got {value!r}")
    return value
