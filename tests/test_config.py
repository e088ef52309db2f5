"""probes.config: files and options checked against the subscribers' own signatures, one clear error each."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from probes import AnomalySentinel, ConfigError, StatisticsSubscriber, from_config
from probes.config import SECTIONS, load_config, option_types, options_config, type_name

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "probes.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_file_builds_the_subscribers_it_names_with_their_options(tmp_path):
    path = write(tmp_path, f"""
statistics:
  - output_dir: {tmp_path / 'a'}
    every_n_steps: 3
    modules: ["blocks.*", "re:.*attn.*"]
    phases: forward
    on_anomaly: warn
    max_abs: 65504
  - output_dir: {tmp_path / 'b'}
    dump_format: jsonl
sentinel:
  action: warn
  steps: [1, 2]
""")
    first, second, sentinel = from_config(path)
    assert isinstance(first, StatisticsSubscriber) and isinstance(second, StatisticsSubscriber)
    assert isinstance(sentinel, AnomalySentinel)
    assert first.output_dir == tmp_path / "a" and first.selection.every_n_steps == 3
    assert first.selection.modules == ("blocks.*", "re:.*attn.*") and first.selection.phases == {"forward"}
    assert first.watch.action == "warn" and first.watch.max_abs == 65504
    assert second.output_dir == tmp_path / "b"
    assert sentinel.watch.action == "warn" and sentinel.selection.steps == {1, 2}
    for subscriber in (first, second):
        subscriber.close()


def test_enabled_false_builds_nothing_and_touches_no_directory(tmp_path):
    path = write(tmp_path, json.dumps({"enabled": False, "statistics": {"output_dir": str(tmp_path / "x")}}),
                 "probes.json")
    assert from_config(path) == [] and not (tmp_path / "x").exists()


BAD = [
    ("statistics:\n  output_dir: o\n  every_n_step: 5\n", r"statistics\.every_n_step: unknown option of "
     r"StatisticsSubscriber; did you mean 'every_n_steps'\?"),
    ("statistic:\n  output_dir: o\n", r"statistic: unknown key; did you mean 'statistics'\?"),
    ("statistics:\n  output_dir: o\n  every_n_steps: ten\n",
     r"statistics\.every_n_steps: must be integer or null, got a string 'ten'"),
    ("statistics:\n  output_dir: o\n  run_on_cpu: 1\n", r"statistics\.run_on_cpu: must be boolean, got an integer 1"),
    ("statistics:\n  output_dir: o\n  modules: ['re:(']\n", r"statistics: modules pattern 're:\(' is not a valid"),
    ("statistics:\n  output_dir: o\n  phases: sideways\n", r"statistics: .*sideways"),
    ("statistics:\n  output_dir: o\n  on_anomaly: stop\n", r"statistics\.on_anomaly: must be \"warn\" or \"raise\""),
    ("statistics:\n  every_n_steps: 2\n", r"statistics\.output_dir: is required by StatisticsSubscriber"),
    ("statistics:\n  output_dir: o\n  on_step_written: f\n", r"statistics\.on_step_written: cannot be set here"),
    ("statistics:\n  - output_dir: o\n  - output_dir: p\n    steps: [1, x]\n", r"statistics\[1\]\.steps: must be"),
    ("sentinel:\n  - action: raise\n", r"sentinel: must be a mapping of AnomalySentinel options, got a list"),
    ("enabled: yes please\n", r"enabled: must be a boolean"),
    ("- statistics\n", r"must hold a mapping with the keys enabled, statistics, sentinel, got a list"),
    ("enabled: true\n", r"names no subscriber"),
    ("statistics: [output_dir: o\n", r"is not valid YAML"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[m.split(":")[0][:40] for _, m in BAD])
def test_every_bad_file_is_one_error_naming_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ": " + message):
        load_config(path)
    assert not (tmp_path / "o").exists()


def test_files_that_cannot_be_read_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.yaml: no such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"must end in \.yaml, \.yml or \.json"):
        load_config(write(tmp_path, "{}", "probes.toml"))
    with pytest.raises(ConfigError, match=r"probes\.json: is not valid JSON"):
        load_config(write(tmp_path, "{statistics: 1}", "probes.json"))


def test_options_in_code_are_checked_the_same_way_and_may_pass_a_callable(tmp_path):
    with pytest.raises(ConfigError, match=r"^Caller: every_n_step: unknown option"):
        options_config({"output_dir": "o", "every_n_step": 2}, source="Caller")
    config = options_config({"output_dir": tmp_path / "o", "on_step_written": print}, source="Caller")
    (subscriber,) = config.build()
    assert subscriber.output_dir == tmp_path / "o"
    subscriber.close()


def test_constructor_errors_name_the_section(tmp_path):
    path = write(tmp_path, f"statistics:\n  output_dir: {tmp_path / 'o'}\n  max_abs: 10\n")
    with pytest.raises(ConfigError, match=r"statistics: max_abs needs on_anomaly"):
        from_config(path)


def schema_tables(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    for section, body in re.findall(r"### `(\w+)`: \w+\n\n\| key .*?\n\| --- .*?\n((?:\|.*\n)+)", text):
        rows = [line.strip("|").split("|") for line in body.strip().splitlines()]
        tables[section] = {key.strip().strip("`"): (kind.strip(), default.strip()) for key, kind, default in rows}
    return tables


def test_the_documented_schema_is_the_subscribers_signatures():
    documented = schema_tables((ROOT / "docs" / "config.md").read_text())
    assert set(documented) == set(SECTIONS)
    for section, (cls, _) in SECTIONS.items():
        parameters = inspect.signature(cls.__init__).parameters
        expected = {}
        for name, hint in option_types(cls).items():
            default = parameters[name].default
            if default is inspect.Parameter.empty:
                shown = "required"
            elif default is None:
                shown = "null"
            else:
                shown = f"`{json.dumps(default) if isinstance(default, bool) else default}`"
            expected[name] = (type_name(hint), shown)
        assert documented[section] == expected, section
