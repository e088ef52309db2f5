"""One config file for every entry point: which subscribers to build, with which options.

    from probes import from_config
    subscribers = from_config("probes.yaml")        # [StatisticsSubscriber(...), AnomalySentinel(...)]
    SubscriberManager().subscribe(model, subscribers)

The file is YAML (``.yaml``/``.yml``) or JSON (``.json``):

    statistics:                 # a StatisticsSubscriber (or a list of them): its keyword arguments
      output_dir: probes_out
      every_n_steps: 50
      modules: ["blocks.*"]
      on_anomaly: raise
    sentinel:                   # an AnomalySentinel: its keyword arguments
      action: raise
    enabled: true               # false: the file builds no subscriber (recording off)

The stages: ``load_config`` reads the file and checks every key and value against the subscribers'
own signatures (unknown key, wrong type, bad pattern: one ``ConfigError`` naming the file and the key),
touching nothing on disk; ``ProbesConfig.build()`` constructs the subscribers (the statistics
subscriber opens its dump then, so a trainer callback builds them once the process knows its rank).
The schema is derived from the signatures, so it cannot drift from them; docs/config.md lists it
and a test keeps the two equal. Relative paths are relative to the working directory, as in Python.
"""

from __future__ import annotations

import collections.abc
import difflib
import inspect
import json
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from .core import SubscriberBase
from .core.selection import Selection
from .stats import AnomalySentinel, StatisticsSubscriber

ENV_VAR = "PROBES_CONFIG"

# Section -> (subscriber class, whether the section may be a list of option mappings).
SECTIONS: dict[str, tuple[type[SubscriberBase], bool]] = {
    "statistics": (StatisticsSubscriber, True),
    "sentinel": (AnomalySentinel, False),
}
TOP_LEVEL_KEYS = ("enabled", *SECTIONS)
# Arguments a file cannot express (a Python callable), with what to do instead.
NOT_IN_FILES: dict[str, str] = {
    "on_step_written": "a Python callable; pass it in code (StatisticsSubscriber(..., on_step_written=...))",
}
_SELECTION_KEYS = frozenset(inspect.signature(Selection.of).parameters)


class ConfigError(ValueError):
    """A bad config file or option; the message names the file (or the caller) and the key."""

    def __init__(self, source: str, key: str | None, problem: str) -> None:
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {problem}")
        self.source = source
        self.key = key
        self.problem = problem


@dataclass(frozen=True, kw_only=True)
class ProbesConfig:
    """A checked config: per section, the option mappings of the subscribers to build."""

    source: str
    enabled: bool = True
    sections: tuple[tuple[str, Mapping[str, Any]], ...] = ()

    def build(self) -> list[SubscriberBase]:
        """The subscribers, in file order (statistics first); [] when ``enabled`` is false."""
        if not self.enabled:
            return []
        built = []
        for section, options in self.sections:
            cls, _ = SECTIONS[section]
            try:
                built.append(cls(**options))
            except (TypeError, ValueError, OSError) as error:  # the subscriber's own checks, the dump directory's
                raise ConfigError(self.source, section, str(error)) from None
        return built


def option_types(cls: type[SubscriberBase]) -> dict[str, Any]:
    """The keyword options a file may give ``cls``: its signature's parameters and their type hints."""
    hints = typing.get_type_hints(cls.__init__)
    return {name: hints.get(name, Any) for name, parameter in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
            and name not in NOT_IN_FILES}


def required_options(cls: type[SubscriberBase]) -> frozenset[str]:
    return frozenset(name for name, parameter in inspect.signature(cls.__init__).parameters.items()
                     if name != "self" and parameter.default is parameter.empty
                     and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD))


def type_name(hint: Any) -> str:
    """A type hint in the words a config file uses: ``"integer or null"``, ``"list of string"``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(type_name(arg) for arg in args))
    if origin is Literal:
        return " or ".join(json.dumps(arg) for arg in args)
    if origin in (collections.abc.Sequence, collections.abc.Iterable, list, tuple):
        return f"list of {type_name(args[0])}"
    names = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
             os.PathLike: "string"}
    if hint in names:
        return names[hint]
    raise TypeError(f"probes.config: no file type for the hint {hint!r}; teach type_name and _matches")


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if origin in (collections.abc.Sequence, collections.abc.Iterable, list, tuple):
        return isinstance(value, list) and all(_matches(item, args[0]) for item in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is os.PathLike:  # a file gives a string; code may give a Path
        return isinstance(value, (str, os.PathLike))
    raise TypeError(f"probes.config: no file type for the hint {hint!r}; teach type_name and _matches")


def check_options(cls: type[SubscriberBase], options: Mapping[str, Any], *, source: str, section: str,
                  in_code: bool = False) -> dict[str, Any]:
    """``options`` checked against ``cls``'s signature: every key known, every value of its type, the
    selection valid. Constructs nothing. ``in_code``: keyword arguments given in Python, where
    ``NOT_IN_FILES`` options are allowed (and passed on unchecked)."""
    if not isinstance(options, Mapping):
        raise ConfigError(source, section, f"must be a mapping of {cls.__name__} options, got {_kind(options)}")
    known = option_types(cls)
    for key, value in options.items():
        where = f"{section}.{key}" if section else str(key)
        if key in NOT_IN_FILES:
            if in_code:
                continue
            raise ConfigError(source, where, f"cannot be set here: {NOT_IN_FILES[key]}")
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(source, where, f"unknown option of {cls.__name__}; {hint}known: {', '.join(known)}")
        if not _matches(value, known[key]):
            raise ConfigError(source, where, f"must be {type_name(known[key])}, got {_kind(value)} {value!r}")
    missing = sorted(required_options(cls) - set(options))
    if missing:
        raise ConfigError(source, f"{section}.{missing[0]}" if section else missing[0],
                          f"is required by {cls.__name__}")
    try:
        Selection.of(**{key: value for key, value in options.items() if key in _SELECTION_KEYS})
    except ValueError as error:
        raise ConfigError(source, section or None, str(error)) from None
    return dict(options)


def parse_config(data: Any, *, source: str) -> ProbesConfig:
    """A checked ``ProbesConfig`` from the file's parsed content (see the module docstring)."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, None, f"must hold a mapping with the keys {', '.join(TOP_LEVEL_KEYS)}, "
                                        f"got {_kind(data)}")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(str(key), TOP_LEVEL_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(source, str(key), f"unknown key; {hint}known: {', '.join(TOP_LEVEL_KEYS)}")
    enabled = data.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(source, "enabled", f"must be a boolean, got {_kind(enabled)} {enabled!r}")
    sections: list[tuple[str, Mapping[str, Any]]] = []
    for section, (cls, many) in SECTIONS.items():
        if section not in data:
            continue
        value = data[section]
        entries = value if many and isinstance(value, list) else [value]
        for index, options in enumerate(entries):
            name = f"{section}[{index}]" if entries is value else section
            sections.append((section, check_options(cls, options, source=source, section=name)))
    if enabled and not sections:
        raise ConfigError(source, None, f"names no subscriber: give {' or '.join(SECTIONS)} "
                                        "(or enabled: false to record nothing)")
    return ProbesConfig(source=source, enabled=enabled, sections=tuple(sections))


def load_config(path: str | os.PathLike) -> ProbesConfig:
    """Read and check a YAML or JSON config file; a ``ConfigError`` names the file and the key."""
    path = Path(path)
    source = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(source, None, "a config file must end in .yaml, .yml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, None, "no such file; check the path (or the PROBES_CONFIG variable)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(source, None, f"cannot be read ({error})") from None
    try:
        if suffix == ".json":
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text)
    except ValueError as error:  # json.JSONDecodeError
        raise ConfigError(source, None, f"is not valid JSON ({error})") from None
    except Exception as error:  # yaml.YAMLError; PyYAML is imported only for YAML files
        raise ConfigError(source, None, f"is not valid YAML ({str(error).splitlines()[0]})") from None
    return parse_config(data, source=source)


def from_config(path: str | os.PathLike) -> list[SubscriberBase]:
    """The subscribers a YAML or JSON config file describes (see the module docstring).

        SubscriberManager().subscribe(model, from_config("probes.yaml"))
    """
    return load_config(path).build()


def _kind(value: Any) -> str:
    names = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a mapping"}
    return names.get(type(value), type(value).__name__)


def env_config() -> ProbesConfig | None:
    """The config ``PROBES_CONFIG`` names, checked; None when the variable is unset or empty."""
    path = os.environ.get(ENV_VAR, "")
    return load_config(path) if path else None


def options_config(options: Mapping[str, Any], *, source: str) -> ProbesConfig:
    """A statistics subscriber's options given in code (a callback's keyword arguments), checked the same way."""
    return ProbesConfig(source=source, sections=(("statistics", check_options(
        StatisticsSubscriber, options, source=source, section="", in_code=True)),))

