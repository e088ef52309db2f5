"""Name patterns, one rule for every place that selects by name (subscriber selection, compare, TensorBoard).

    matches = name_matcher(["blocks.*", "re:.*attn.*"], argument="modules")
    matches("blocks.0.fc")        # True

A pattern is a glob (``fnmatch.fnmatchcase``: case-sensitive, ``*`` also crosses dots), or a regular
expression when written ``"re:<regex>"`` (``re.fullmatch``). A bad pattern is a ValueError that names
the argument and says how to fix it, raised when the patterns are checked, not when first matched.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Callable, Sequence

REGEX_PREFIX = "re:"


def compile_pattern(pattern: str, argument: str = "pattern") -> Callable[[str], bool]:
    """``pattern`` as a predicate on names; ValueError for an empty or non-string pattern or a bad regex."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{argument} patterns must be non-empty strings (globs, or 're:<regex>'), got {pattern!r}")
    if pattern.startswith(REGEX_PREFIX):
        try:
            regex = re.compile(pattern[len(REGEX_PREFIX):])
        except re.error as error:
            raise ValueError(f"{argument} pattern {pattern!r} is not a valid regular expression ({error}); "
                             "fix the regex, or drop the 're:' prefix to write a glob") from None
        return lambda name: regex.fullmatch(name) is not None
    # fnmatch.translate gives the exact regex fnmatchcase uses; compiled once instead of per call.
    glob = re.compile(fnmatch.translate(pattern))
    return lambda name: glob.match(name) is not None


def check_patterns(value: str | Sequence[str] | None, argument: str) -> tuple[str, ...]:
    """``value`` (one pattern, a list of them, or None for "every name") as a checked tuple; () for None."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    elif not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"{argument} must be a pattern string, a list of them or None, got {type(value).__qualname__}")
    patterns = tuple(value)
    if not patterns:
        raise ValueError(f"{argument} is empty; pass None to select every module (every name), or at least one pattern")
    for pattern in patterns:
        compile_pattern(pattern, argument)  # fails now, naming the bad pattern
    return patterns


def name_matcher(patterns: Sequence[str], argument: str = "pattern") -> Callable[[str], bool]:
    """A predicate true for names any of ``patterns`` matches (every name when there are none)."""
    compiled = [compile_pattern(pattern, argument) for pattern in patterns]
    if not compiled:
        return lambda name: True
    return lambda name: any(matches(name) for matches in compiled)
