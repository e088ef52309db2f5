"""The name map: how the record names of one run are written in the other, as regular expressions.

    name_map = load_name_map("names.yaml")          # or NameMap.from_rules({r"\\.ffn\\.": ".mlp."})
    name_map.apply("blocks.1.ffn.0.output.0")        # 'blocks.1.mlp.0.output.0'
    probes compare eager_out refactored_out --map names.yaml

A map file is YAML or JSON (by its ending: .yaml/.yml, else JSON), either a mapping
``{pattern: replacement}`` or a list of ``{pattern: ..., replace: ...}`` entries. Each pattern is a
Python regular expression searched anywhere in a name (anchor it with ``^``/``$``); the replacement may
use its groups (``\\1``). Rules apply in order, each to the result of the previous one. The map rewrites
the names of OTHER (the run being checked) into BASE's names; BASE and the noise run (a second run of
BASE) keep theirs. Any problem with a map is a NameMapError that names the file and what to fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

__all__ = ["NameMap", "NameMapError", "NameMapLike", "NameRules", "as_name_map", "load_name_map"]

NameRules = Union[Mapping[str, str], Sequence[Mapping[str, str]]]
NameMapLike = Union["NameMap", NameRules, str, Path]  # what ``name_map=`` options accept
FORMAT_HELP = ('a mapping {"pattern": "replacement"} or a list of {"pattern": ..., "replace": ...} entries, '
               "patterns being Python regular expressions")


class NameMapError(ValueError):
    """A name map that cannot be used: unreadable, malformed, an invalid pattern, or two names made one."""


@dataclass(frozen=True)
class NameMap:
    """Ordered (pattern, replacement) rules rewriting OTHER's record names into BASE's."""

    rules: tuple[tuple[re.Pattern[str], str], ...]
    source: str = "name map"

    @classmethod
    def from_rules(cls, rules: NameRules, *, source: str = "name map") -> "NameMap":
        """A map from ``{pattern: replacement}`` or ``[{"pattern": ..., "replace": ...}, ...]``."""
        if isinstance(rules, Mapping):
            pairs = list(rules.items())
        elif isinstance(rules, Sequence) and not isinstance(rules, (str, bytes)):
            pairs = []
            for number, entry in enumerate(rules, 1):
                if not isinstance(entry, Mapping) or set(entry) != {"pattern", "replace"}:
                    raise NameMapError(f"{source}: entry {number} is {entry!r}; each entry of a list needs exactly "
                                       f"the keys 'pattern' and 'replace' ({FORMAT_HELP})")
                pairs.append((entry["pattern"], entry["replace"]))
        else:
            raise NameMapError(f"{source}: holds {type(rules).__name__}; write {FORMAT_HELP}")
        if not pairs:
            raise NameMapError(f"{source}: has no rule; write {FORMAT_HELP}")
        compiled = []
        for pattern, replacement in pairs:
            if not isinstance(pattern, str) or not isinstance(replacement, str) or not pattern:
                raise NameMapError(f"{source}: rule {pattern!r} -> {replacement!r}: a pattern and its replacement "
                                   "must be strings, the pattern not empty (quote numbers in YAML)")
            try:
                regex = re.compile(pattern)
                regex.sub(replacement, "")  # a bad group reference in the replacement fails here
            except re.error as error:
                raise NameMapError(f"{source}: rule {pattern!r} -> {replacement!r} is not a valid regular expression "
                                   f"({error}); escape literal dots and brackets (\\\\.)") from None
            compiled.append((regex, replacement))
        return cls(tuple(compiled), source)

    def apply(self, name: str) -> str:
        """``name`` rewritten by every rule in turn."""
        for regex, replacement in self.rules:
            name = regex.sub(replacement, name)
        return name


def load_name_map(path: str | Path) -> NameMap:
    """Reads a YAML (.yaml, .yml) or JSON name map file; NameMapError says what is wrong with it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise NameMapError(f"name map {path}: cannot be read ({reason}); give a YAML or JSON file") from None
    return NameMap.from_rules(_parse(path, text), source=f"name map {path}")


def _parse(path: Path, text: str) -> Any:
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise NameMapError(f"name map {path}: reading YAML needs PyYAML (pip install PyYAML), "
                               "or write the map as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise NameMapError(f"name map {path}: not valid YAML ({' '.join(str(error).split())})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise NameMapError(f"name map {path}: not valid JSON ({error}); name a YAML map .yaml or .yml") from None


def as_name_map(name_map: NameMapLike | None) -> NameMap | None:
    """A ``name_map=`` option as a NameMap: a NameMap, its rules, or the path of a YAML/JSON file."""
    if name_map is None or isinstance(name_map, NameMap):
        return name_map
    if isinstance(name_map, (str, Path)):
        return load_name_map(name_map)
    return NameMap.from_rules(name_map)
