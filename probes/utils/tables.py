"""Plain-text tables for the terminal, and names made safe to print.

    print("\n".join(text_table(["name", "mean"], [["fc1", "0.5"]], right={1})))
"""

from __future__ import annotations

from typing import Any, Collection, Sequence


def printable(text: Any) -> str:
    """``str(text)`` with control characters escaped: names come from models and must not drive the terminal."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(text))


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Collection[int] = (),
               indent: str = "") -> list[str]:
    """Lines of a table whose columns are as wide as their widest cell; columns in ``right`` right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [cell.rjust(width) if i in right else cell.ljust(width)
                 for i, (cell, width) in enumerate(zip(row, widths))]
        lines.append(indent + "  ".join(cells).rstrip())
    return lines
