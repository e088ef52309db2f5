"""Comparing runs whose names differ: a renamed module aligned by the name map (YAML, JSON, in code) and by
fuzzy alignment, a refactored block aligned by fuzzy alignment, a bug still found under the new names, and
every bad map a clear error (one line and exit code 2 on the command line)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from probes.cli import main
from probes.compare import NameMap, NameMapError, compare_dumps, format_report, load_name_map
from probes.compare.html import render_html
from probes.models import Block, TinyTransformer, TransformerConfig, make_batch
from probes.testing import assert_parity

from helpers import train_run

CONFIG = TransformerConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
STEPS = 2
MAP_YAML = "- pattern: '\\.ffn\\.'\n  replace: '.mlp.'\n"


class FfnBlock(Block):
    """Block with its ``mlp`` renamed ``ffn``: the same modules and weights under another name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class FeedForward(nn.Module):
    """A refactored MLP: named layers instead of a Sequential."""

    def __init__(self, mlp: nn.Sequential) -> None:
        super().__init__()
        self.up, self.act, self.down, self.drop = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(self.act(self.up(x))))


def base_model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CONFIG)


def renamed_model(refactor: bool = False) -> TinyTransformer:
    model = base_model()
    for block in model.blocks:
        block.__class__ = FfnBlock
        mlp = block._modules.pop("mlp")
        block.ffn = FeedForward(mlp) if refactor else mlp
    return model


def train(model: nn.Module, out, bug: str | None = None) -> None:
    train_run(out, config=CONFIG, steps=STEPS, model=model, bug=(bug, 1, "forward") if bug else None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("align")
    train(base_model(), root / "base")
    train(renamed_model(), root / "renamed")
    train(renamed_model(refactor=True), root / "refactored")
    train(renamed_model(), root / "renamed_bug", bug="blocks.1.ffn.0")
    (root / "map.yaml").write_text(MAP_YAML)
    (root / "map.json").write_text(json.dumps({r"\.ffn\.": ".mlp."}))
    return root


def test_without_a_map_the_renamed_records_are_on_one_side_only(runs):
    report = compare_dumps(runs / "base", runs / "renamed")
    assert not report.agrees and not report.renamed
    assert {key[3] for key in report.only_in_base} >= {"blocks.0.mlp.0.output.0", "blocks.1.mlp.output.0"}
    assert {key[3] for key in report.only_in_other} >= {"blocks.0.ffn.0.output.0", "blocks.1.ffn.output.0"}


@pytest.mark.parametrize("name_map", ["map.yaml", "map.json", "rules"])
def test_the_name_map_aligns_a_renamed_module(runs, name_map):
    given = {r"\.ffn\.": ".mlp."} if name_map == "rules" else runs / name_map
    report = compare_dumps(runs / "base", runs / "renamed", name_map=given)
    assert report.agrees and not report.only_in_base and not report.only_in_other
    assert report.matched == len(compare_dumps(runs / "base", runs / "base").records)
    renamed = {(r.other, r.base) for r in report.renamed}
    assert ("blocks.0.ffn.0.output.0", "blocks.0.mlp.0.output.0") in renamed
    assert all(r.how == "map" and r.confidence == 1.0 and r.phase is None for r in report.renamed)
    assert len(renamed) == 2 * 5  # per block: mlp's 4 layers and mlp itself; a name, whatever its phase


def test_the_map_applies_before_the_name_filter(runs):
    report = compare_dumps(runs / "base", runs / "renamed", name_map=runs / "map.yaml", names=["blocks.1.mlp.*"])
    assert report.agrees and report.matched and all(r.name.startswith("blocks.1.mlp.") for r in report.records)


def test_a_bug_in_the_renamed_module_is_found_under_the_base_name(runs):
    report = compare_dumps(runs / "base", runs / "renamed_bug", name_map=runs / "map.yaml")
    first = report.first_divergence
    assert first is not None and (first.step, first.phase, first.name) == (1, "forward", "blocks.1.mlp.0.output.0")
    with pytest.raises(AssertionError, match="blocks.1.mlp.0.output.0"):
        assert_parity(runs / "base", runs / "renamed_bug", name_map=runs / "map.json")
    assert_parity(runs / "base", runs / "renamed", name_map=runs / "map.json")


def test_fuzzy_alignment_pairs_a_renamed_module_for_certain(runs):
    report = compare_dumps(runs / "base", runs / "renamed", fuzzy=True)
    assert report.agrees
    pairs = {(r.phase, r.other): r for r in report.renamed}
    assert len(pairs) == 2 * 2 * 5  # forward and backward
    for phase in ("forward", "backward"):
        pair = pairs[(phase, "blocks.1.ffn.2.output.0")]
        assert pair.base == "blocks.1.mlp.2.output.0" and pair.how == "fuzzy" and pair.confidence == 1.0
        assert "class Linear" in pair.reason
    text = format_report(report)
    assert "Renamed (other -> base):" in text and "confidence 1.00" in text
    assert "blocks.0.ffn.0.output.0" in render_html(report)
    assert report.to_json()["renamed"][0]["how"] == "fuzzy"


def test_fuzzy_alignment_pairs_a_refactored_block_and_says_how_sure_it_is(runs):
    without = compare_dumps(runs / "base", runs / "refactored")
    assert not without.agrees
    report = compare_dumps(runs / "base", runs / "refactored", fuzzy=True)
    assert report.agrees and not report.only_in_base and not report.only_in_other
    pairs = {(r.phase, r.other): r for r in report.renamed}
    up = pairs[("forward", "blocks.0.ffn.up.output.0")]
    assert up.base == "blocks.0.mlp.0.output.0" and up.confidence == 1.0
    container = pairs[("forward", "blocks.0.ffn.output.0")]
    # Sequential became FeedForward: paired by shape and order only, and less sure.
    assert container.base == "blocks.0.mlp.output.0" and container.confidence == 0.75
    assert "class FeedForward as Sequential" in container.reason


def test_fuzzy_alignment_leaves_records_it_cannot_pair(runs, tmp_path):
    model = base_model()
    model.blocks[1].mlp.append(nn.Identity())  # one more record in other, nothing like it in base
    model.blocks[0].mlp = nn.Sequential(*model.blocks[0].mlp, nn.Identity())
    train(model, tmp_path / "grown")
    report = compare_dumps(runs / "base", tmp_path / "grown", fuzzy=True)
    assert {key[3] for key in report.only_in_other} == {"blocks.1.mlp.4.output.0", "blocks.0.mlp.4.output.0"}
    assert not report.only_in_base and not report.renamed


def bad_map(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name, text, message", [
    ("m.yaml", "- pattern: [unclosed\n", "not valid YAML"),
    ("m.json", "{'single': 'quotes'}", "not valid JSON"),
    ("m.json", '["just", "strings"]', "entry 1 is 'just'"),
    ("m.json", '{"a(": "b"}', "not a valid regular expression"),
    ("m.json", '{"(a)": "\\\\2"}', "not a valid regular expression"),
    ("m.yaml", "42\n", "holds int"),
    ("m.json", "{}", "has no rule"),
    ("m.yaml", "1: x\n", "must be strings"),
])
def test_bad_map_files_are_clear_errors(tmp_path, name, text, message):
    with pytest.raises(NameMapError, match=message) as error:
        load_name_map(bad_map(tmp_path, name, text))
    assert str(tmp_path / name) in str(error.value)


def test_a_missing_map_and_a_map_that_merges_two_names(runs, tmp_path):
    with pytest.raises(NameMapError, match="cannot be read"):
        load_name_map(tmp_path / "nope.yaml")
    with pytest.raises(NameMapError, match="both to 'blocks.0.mlp.0.output.0'"):
        compare_dumps(runs / "base", runs / "renamed", name_map={r"blocks\.\d+\.ffn\.": "blocks.0.mlp."})
    assert NameMap.from_rules([{"pattern": r"^(\w+)\.ffn", "replace": r"\1.mlp"}]).apply("h.ffn.0") == "h.mlp.0"


def test_the_command_line_maps_and_aligns(runs, tmp_path, capsys):
    assert main(["compare", str(runs / "base"), str(runs / "renamed")]) == 1
    assert "--map FILE, --fuzzy" not in capsys.readouterr().err  # some records match: a report, not an error
    assert main(["compare", str(runs / "base"), str(runs / "renamed"), "--map", str(runs / "map.yaml"),
                 "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "10 names of other renamed by the name map" in out and "verdict: AGREE" in out
    assert len(json.loads((tmp_path / "r.json").read_text())["renamed"]) == 10
    assert main(["compare", str(runs / "base"), str(runs / "refactored"), "--fuzzy"]) == 0
    assert "confidence 0.75" in capsys.readouterr().out


@pytest.mark.parametrize("text", [None, "- [\n", '{"a(": "b"}'])
def test_a_bad_map_on_the_command_line_is_one_line_and_exit_2(runs, tmp_path, capsys, text):
    path = tmp_path / "m.yaml" if text is None else bad_map(tmp_path, "m.yaml", text)
    assert main(["compare", str(runs / "base"), str(runs / "renamed"), "--map", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("probes compare: error: name map ") and str(path) in err
