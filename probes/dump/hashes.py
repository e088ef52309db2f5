"""A record's ``hash``: the 64-bit hash of its tensor's bytes (``probes.stats.hashing`` computes it).

    hex_hash(record["hash"])          # "0x3f2a09c4d2e1b877": how show and compare print it
    has_hashes(records)               # every record with statistics carries a hash

The dump holds it as int64 bits (the ``hash`` column; null, and absent from the record, in dumps
recorded without ``hash=True``). A record without statistics (``"unsupported"``) has no hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["HASH", "has_hashes", "hex_hash"]

HASH = "hash"
_MASK64 = (1 << 64) - 1


def hex_hash(value: int) -> str:
    """A hash (its int64 bits) as 16 hex digits: ``hex_hash(-1) == "0xffffffffffffffff"``."""
    return f"0x{value & _MASK64:016x}"


def has_hashes(records: Iterable[Mapping[str, Any]]) -> bool:
    """True when every record with statistics has a hash (records without statistics never do)."""
    return all(record.get(HASH) is not None for record in records if record.get("unsupported") is None)
