"""How a compared value is printed and written to JSON: one place for the terminal, the HTML page and the JSON.

    format_value(1.234567891)      # "1.23457"; None "-"; names with control characters escaped
    json_value(float("nan"))       # "NaN": the JSON document is strict JSON
    key_json((0, 3, "forward", "fc1.output.0"))   # {"rank": 0, "step": 3, "phase": ..., "name": ...}
"""

from __future__ import annotations

import math
from typing import Any

from ..dump.record import RecordKey
from ..utils.tables import printable

__all__ = ["format_value", "is_finite_number", "json_value", "key_json"]


def is_finite_number(value: Any) -> bool:
    """An int or float (never a bool) that is finite: what the tolerance rules measure a distance between."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def format_value(value: Any) -> str:
    """A value as the reports print it: None "-", floats to 6 digits, names with control characters escaped."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    return printable(value)



def key_json(key: RecordKey) -> dict[str, Any]:
    return {"rank": key[0], "step": key[1], "phase": key[2], "name": key[3]}


def json_value(value: Any) -> Any:
    """A value as strict JSON holds it: non-finite floats become "NaN", "Infinity", "-Infinity"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (list, tuple)):
        return [json_value(item) for item in value]
    return value
