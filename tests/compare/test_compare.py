"""python -m probes compare: injected divergences found exactly, noise calibration, ranks, bad input, reports."""

from __future__ import annotations

import copy
import functools
import html
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from probes.compare.options import MOMENTS
import torch
from torch import nn

import helpers
from exporters.handles import Handle
from probes import StatisticsSubscriber, SubscriberManager
from probes.__main__ import main as probes_main
from probes.compare import compare_dumps, format_report
from probes.compare.html import render_html
from probes.compare.terminal import verdict
from probes.dump import load_dump
from probes.dump.writer import DumpWriter
from dump_records import write_record
from probes.models import TinyTransformer, TransformerConfig
from probes.stats.recorder import tensor_record
from probes.testing import assert_parity, inject_bug, parity, parity_message  # noqa: F401  (parity: fixture)

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
STEPS = 3
ROOT = Path(__file__).resolve().parents[2]


train_run = functools.partial(helpers.train_run, config=CONFIG, steps=STEPS)


def where(divergence) -> tuple:
    return divergence.rank, divergence.step, divergence.phase, divergence.name


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("base") / "dump"
    train_run(out)
    return out


def run_cli(*args, capsys) -> tuple[int, str, str]:
    code = probes_main(["compare", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------------------------- exact location


@pytest.mark.parametrize("layer,step,phase", [
    ("blocks.0.mlp.0", 1, "forward"),
    ("blocks.1.attn.qkv", 2, "forward"),
    ("blocks.1.mlp.2", 1, "backward"),
])
def test_injected_bug_is_found_exactly(base_run, tmp_path, capsys, layer, step, phase):
    train_run(tmp_path / "other", bug=(layer, step, phase))
    report = compare_dumps(base_run, tmp_path / "other")
    expected = (0, step, phase, f"{layer}.output.0")
    assert report.first_divergence is not None and where(report.first_divergence) == expected
    # Everything earlier in execution order agrees; the bug shows in its own record, not only downstream.
    first = report.first_divergence
    earlier = [r for r in report.records if (r.step, r.phase == "backward", r.seq) <
               (first.step, first.phase == "backward", first.seq)]
    assert earlier and not any(r.diverged for r in earlier)
    assert first.metric in (*MOMENTS, "samples")
    assert not report.only_in_base and not report.only_in_other

    code, out, _ = run_cli(base_run, tmp_path / "other", capsys=capsys)
    assert code == 1
    assert f"FIRST DIVERGENCE  rank 0  step {step}  {phase}  {layer}.output.0" in out
    assert f">>     {step}  {phase}" in out  # the table around it marks it


def test_identical_runs_agree(base_run, tmp_path, capsys):
    train_run(tmp_path / "again")
    report = compare_dumps(base_run, tmp_path / "again", rtol=0, atol=0)
    assert report.agrees and report.first_divergence is None
    assert report.matched == len(load_dump(base_run)) > 0
    code, out, _ = run_cli(base_run, tmp_path / "again", "--rtol", 0, "--atol", 0, "--json", tmp_path / "r.json",
                           capsys=capsys)
    assert code == 0 and "verdict: AGREE" in out
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["verdict"] == "agree" and document["first_divergence"] is None
    assert document["only_in_base"] == [] and document["only_in_other"] == []
    assert [s["step"] for s in document["per_step"]] == list(range(STEPS))


def test_json_report_follows_the_documented_schema(base_run, tmp_path, capsys):
    train_run(tmp_path / "other", bug=("blocks.0.mlp.0", 1, "forward"))
    code, _, _ = run_cli(base_run, tmp_path / "other", "--json", tmp_path / "r.json", capsys=capsys)
    assert code == 1
    text = (tmp_path / "r.json").read_text()
    document = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert document["format"] == "probes-compare" and document["version"] == 1
    assert document["verdict"] == "diverged"
    first = document["first_divergence"]
    assert {k: first[k] for k in ("rank", "step", "phase", "name")} == {
        "rank": 0, "step": 1, "phase": "forward", "name": "blocks.0.mlp.0.output.0"}
    assert first["metric"] in (*MOMENTS, "samples") and isinstance(first["base"], (int, float))
    assert first["abs_diff"] > first["tolerance"]
    assert set(document) >= {"first_divergence", "only_in_base", "only_in_other", "per_step", "divergences",
                             "counts", "steps", "tolerance", "filters"}
    per_step = {s["step"]: s for s in document["per_step"]}
    assert per_step[0]["diverged"] == 0 and per_step[1]["diverged"] > 0
    assert per_step[1]["worst"]["ratio"] > 1
    assert document["divergences"][0]["name"] == "blocks.0.mlp.0.output.0"
    assert document["counts"]["diverged"] == len(document["divergences"])


def test_step_and_name_filters(base_run, tmp_path, capsys):
    # A gradient bug: in step 1 only the layer's own gradient and what flows back from it change.
    train_run(tmp_path / "other", bug=("blocks.1.mlp.0", 1, "backward"))
    assert run_cli(base_run, tmp_path / "other", "--step", "0", capsys=capsys)[0] == 0
    assert run_cli(base_run, tmp_path / "other", "--name", "head.*", "--name", "norm.*", "--step", "0-1",
                   capsys=capsys)[0] == 0
    assert run_cli(base_run, tmp_path / "other", "--name", "blocks.0.*", "--step", "1", capsys=capsys)[0] == 1
    code, out, _ = run_cli(base_run, tmp_path / "other", "--name", "blocks.1.mlp.*", "--step", "1,2", capsys=capsys)
    assert code == 1 and "FIRST DIVERGENCE  rank 0  step 1  backward  blocks.1.mlp.0.output.0" in out
    report = compare_dumps(base_run, tmp_path / "other", names=["blocks.1.mlp.*"], steps=[2])
    assert {r.step for r in report.records} == {2}
    assert all(r.name.startswith("blocks.1.mlp.") for r in report.records)


# --------------------------------------------------------------------------------------------- noise calibration


class SplitLinear(nn.Module):
    """A Linear layer computed as two partial matmuls split at ``split``: the split changes only the
    order in which the products are summed, i.e. the rounding."""

    def __init__(self, width: int, split: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.split = split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, s = self.fc.weight, self.split
        return x[..., :s] @ w[:, :s].T + x[..., s:] @ w[:, s:].T + self.fc.bias


class SplitMLP(nn.Module):
    def __init__(self, split: int) -> None:
        super().__init__()
        self.a = SplitLinear(64, split)
        self.act = nn.Tanh()
        self.b = SplitLinear(64, split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


def train_split(out: Path, split: int, bug_step: int | None = None) -> None:
    torch.manual_seed(0)
    model = SplitMLP(split)
    bug = inject_bug(model, "a", step=bug_step, factor=1.001) if bug_step is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(out)]):
        for step in range(3):
            if bug is not None:
                bug.step = step
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            (model(x) ** 2).mean().backward()
            optimizer.step()


def test_noise_calibration_suppresses_reduction_order_differences(tmp_path, capsys):
    train_split(tmp_path / "base", split=16)
    train_split(tmp_path / "base2", split=40)  # a second baseline: same math, another summation order
    train_split(tmp_path / "other", split=28)
    fixed = compare_dumps(tmp_path / "base", tmp_path / "other", rtol=1e-7, atol=1e-9)
    assert fixed.first_divergence is not None, "the summation order should change the rounding"
    calibrated = compare_dumps(tmp_path / "base", tmp_path / "other", rtol=1e-7, atol=1e-9, noise=tmp_path / "base2")
    assert calibrated.agrees, str(calibrated.first_divergence)
    assert calibrated.noise_unmatched == 0 and all(r.noise is not None for r in calibrated.records)
    code, out, _ = run_cli(tmp_path / "base", tmp_path / "other", "--rtol", 1e-7, "--atol", 1e-9,
                           "--noise", tmp_path / "base2", capsys=capsys)
    assert code == 0 and "k*noise" in out

    # The calibrated tolerance still catches a small real bug (0.1%) at its exact place.
    train_split(tmp_path / "buggy", split=28, bug_step=1)
    buggy = compare_dumps(tmp_path / "base", tmp_path / "buggy", rtol=1e-7, atol=1e-9, noise=tmp_path / "base2")
    assert buggy.first_divergence is not None and where(buggy.first_divergence) == (0, 1, "forward", "a.output.0")


# --------------------------------------------------------------------------------------------- ranks, presence


def synthetic_records(step: int, rank: int, layers: int = 4, bump: dict | None = None) -> list[dict]:
    """Forward then backward records of ``layers`` layers; ``bump[(phase, layer)]`` scales that tensor."""
    records = []
    seq = 0
    for phase in ("forward", "backward"):
        order = range(layers) if phase == "forward" else reversed(range(layers))
        for layer in order:
            values = torch.linspace(-1, 1, 50, dtype=torch.float64).reshape(5, 10) * (layer + 1) + step * 0.1
            values = values * (bump or {}).get((phase, layer), 1.0)
            record = {"name": f"l{layer}.output.0", "phase": phase, "seq": seq, "step": step, "rank": rank}
            record.update(tensor_record(values.float(), sample_count=8))
            records.append(record)
            seq += 1
    return records


def write_dump(root: Path, rank: int, steps: dict[int, list[dict]], *, format: str = "parquet") -> None:
    with DumpWriter(root, rank=rank, format=format) as writer:
        for step, records in steps.items():
            for record in records:
                write_record(writer, step, record)
            writer.finish_step(step)


def test_multi_rank_first_divergence_follows_execution_order(tmp_path, capsys):
    for rank in (0, 1):
        write_dump(tmp_path / "base", rank, {s: synthetic_records(s, rank) for s in range(3)})
    bumps = {  # rank -> step -> {(phase, layer): factor}
        0: {1: {("backward", 3): 1.5}, 2: {("forward", 0): 1.5}},  # rank 0 breaks later in step 1 (backward)
        1: {1: {("forward", 2): 1.5}},                              # rank 1 breaks in step 1's forward: first
    }
    for rank in (0, 1):
        write_dump(tmp_path / "other", rank,
                   {s: synthetic_records(s, rank, bump=bumps[rank].get(s)) for s in range(3)})
    report = compare_dumps(tmp_path / "base", tmp_path / "other")
    assert where(report.first_divergence) == (1, 1, "forward", "l2.output.0")
    assert {(d.rank, d.step, d.phase, d.name) for d in report.divergences} == {
        (1, 1, "forward", "l2.output.0"), (0, 1, "backward", "l3.output.0"), (0, 2, "forward", "l0.output.0")}
    assert report.base_steps == {0: [0, 1, 2], 1: [0, 1, 2]}
    code, out, _ = run_cli(tmp_path / "base", tmp_path / "other", capsys=capsys)
    assert code == 1 and "FIRST DIVERGENCE  rank 1  step 1  forward  l2.output.0" in out
    assert "rank 0: 0-2 (3); rank 1: 0-2 (3)" in out

    # Same step, phase and seq on both ranks: the lower rank is first.
    write_dump(tmp_path / "tie", 0, {0: synthetic_records(0, 0, bump={("forward", 1): 2.0})})
    write_dump(tmp_path / "tie", 1, {0: synthetic_records(0, 1, bump={("forward", 1): 2.0})})
    tie = compare_dumps(tmp_path / "base", tmp_path / "tie", steps=[0])
    assert where(tie.first_divergence) == (0, 0, "forward", "l1.output.0")


def test_records_and_steps_on_one_side_are_listed(tmp_path, capsys):
    write_dump(tmp_path / "base", 0, {s: synthetic_records(s, 0) for s in range(4)})
    other = {s: synthetic_records(s, 0) for s in range(2)}  # the other run stopped after step 1
    other[1] = [r for r in other[1] if not (r["name"] == "l2.output.0" and r["phase"] == "backward")]
    extra = dict(other[1][0], name="extra.output.0", seq=99)
    other[1].append(extra)
    write_dump(tmp_path / "other", 0, other)

    report = compare_dumps(tmp_path / "base", tmp_path / "other")
    assert report.steps_only_in_base == [2, 3] and report.steps_only_in_other == []
    assert (0, 1, "backward", "l2.output.0") in report.only_in_base
    assert sum(k[1] in (2, 3) for k in report.only_in_base) == 16  # every record of the missing steps, listed
    assert report.only_in_other == [(0, 1, "forward", "extra.output.0")]
    assert not any(r.diverged for r in report.records) and not report.agrees
    # The extra forward record (seq 99) precedes the missing backward one (seq 5): forward comes first.
    assert where(report.first_divergence) == (0, 1, "forward", "extra.output.0")
    assert (report.first_divergence.metric, report.first_divergence.base) == ("record", "missing")

    code, out, _ = run_cli(tmp_path / "base", tmp_path / "other", "--json", tmp_path / "r.json", capsys=capsys)
    assert code == 1
    assert "different step counts: steps only in base 2-3 (2)" in out
    assert "records only in base" in out and "records only in other" in out
    document = json.loads((tmp_path / "r.json").read_text())
    assert {"rank": 0, "step": 1, "phase": "backward", "name": "l2.output.0"} in document["only_in_base"]
    assert document["only_in_other"] == [{"rank": 0, "step": 1, "phase": "forward", "name": "extra.output.0"}]
    assert document["steps"]["only_in_base"] == [2, 3]


def test_nan_appearing_is_a_count_divergence(tmp_path):
    write_dump(tmp_path / "base", 0, {0: synthetic_records(0, 0)})
    records = synthetic_records(0, 0)
    broken = torch.linspace(-1, 1, 50).reshape(5, 10) * 3
    broken[2, 3] = float("nan")
    records[2].update(tensor_record(broken, sample_count=8))
    write_dump(tmp_path / "other", 0, {0: records})
    first = compare_dumps(tmp_path / "base", tmp_path / "other").first_divergence
    assert where(first) == (0, 0, "forward", "l2.output.0")
    assert (first.metric, first.base, first.other) == ("nan", 0, 1)


def test_samples_catch_a_permutation_that_the_moments_miss(tmp_path):
    write_dump(tmp_path / "base", 0, {0: synthetic_records(0, 0)})
    records = synthetic_records(0, 0)
    values = (torch.linspace(-1, 1, 50, dtype=torch.float64).reshape(5, 10) * 2).float()  # l1, step 0
    records[1].update(tensor_record(values.reshape(-1).flip(0).reshape(5, 10), sample_count=8))
    write_dump(tmp_path / "other", 0, {0: records})
    report = compare_dumps(tmp_path / "base", tmp_path / "other")
    first = report.first_divergence
    assert where(first) == (0, 0, "forward", "l1.output.0") and first.metric == "samples"
    record = next(r for r in report.records if r.name == "l1.output.0" and r.phase == "forward")
    assert all(m.ok for m in record.metrics if m.metric != "samples")  # same values, other places
    assert record.samples_compared == 8 and record.samples_cosine == pytest.approx(-1.0)
    assert record.samples_max_abs == pytest.approx(4.0)


# --------------------------------------------------------------------------------------------- assert_parity


def test_assert_parity_names_the_first_divergence(base_run, tmp_path, parity):
    train_run(tmp_path / "same")
    assert assert_parity(base_run, tmp_path / "same").agrees
    train_run(tmp_path / "other", bug=("blocks.0.attn.proj", 2, "forward"))
    with pytest.raises(AssertionError) as caught:
        assert_parity(base_run, tmp_path / "other", rtol=1e-4, atol=1e-6)
    message = str(caught.value)
    assert "first divergence: rank 0 step 2 forward blocks.0.attn.proj.output.0:" in message
    assert "(base) vs" in message and "> tolerance" in message

    with pytest.raises(AssertionError, match="HTML report: .*parity.html"):
        parity(base_run, tmp_path / "other")
    assert (tmp_path / "parity.html").stat().st_size > 0


def test_the_verdict_is_one_sentence_in_every_report(tmp_path):
    write_dump(tmp_path / "base", 0, {s: synthetic_records(s, 0) for s in range(2)})
    write_dump(tmp_path / "same", 0, {s: synthetic_records(s, 0) for s in range(2)})
    write_dump(tmp_path / "bumped", 0, {0: synthetic_records(0, 0),
                                        1: synthetic_records(1, 0, bump={("forward", 2): 1.5})})
    write_dump(tmp_path / "shorter", 0, {0: synthetic_records(0, 0)})  # a run stopped after step 0
    agree = compare_dumps(tmp_path / "base", tmp_path / "same")
    diverged = compare_dumps(tmp_path / "base", tmp_path / "bumped")
    different = compare_dumps(tmp_path / "base", tmp_path / "shorter")
    assert verdict(agree) == "AGREE (16 records within tolerance)"
    assert verdict(diverged).startswith("DIVERGED at rank 0, step 1, forward, l2.output.0 (")
    assert verdict(different) == "DIFFERENT RECORDS (8 only in base, 0 only in other; matched records agree)"
    for report in (agree, diverged, different):
        sentence = verdict(report)
        assert format_report(report).endswith(f"\nverdict: {sentence}")
        assert f">{html.escape(sentence)}</p>" in render_html(report)
    for report in (diverged, different):
        assert f"\nverdict: {verdict(report)}\n" in parity_message(report)


def test_an_injected_bug_is_a_handle():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3))
    x = torch.ones(1, 3)
    clean = model(x).detach()
    with inject_bug(model, "0", step=1, factor=2.0) as bug:
        assert isinstance(bug, Handle) and bug.handle is not None
        assert not bug.active and torch.equal(model(x), clean)  # before its step
        bug.step = 1
        assert bug.active and torch.allclose(model(x), clean * 2)
    assert not bug.active and bug.handle is None and torch.equal(model(x), clean)
    bug.remove()  # a second remove does nothing
    assert (bug.layer, bug.from_step, bug.factor, bug.phase, bug.record_name) == ("0", 1, 2.0, "forward",
                                                                                 "0.output.0")


# --------------------------------------------------------------------------------------------- ORT and demo


@pytest.mark.ort
@pytest.mark.slow
def test_injected_bug_is_found_exactly_eager_vs_ortmodule(tmp_path):
    from onnxruntime.training.ortmodule import ORTModule

    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    ort_model = copy.deepcopy(model)
    train_run(tmp_path / "eager", model=model)
    train_run(tmp_path / "ort", model=ort_model, wrap=ORTModule, bug=("blocks.1.mlp.0", 1, "forward"))
    report = compare_dumps(tmp_path / "eager", tmp_path / "ort", rtol=1e-3, atol=1e-5)
    assert where(report.first_divergence) == (0, 1, "forward", "blocks.1.mlp.0.output.0")
    assert report.matched == len(load_dump(tmp_path / "eager"))


@pytest.mark.slow
@pytest.mark.parametrize("second", ["eager", "compile", pytest.param("ort", marks=pytest.mark.ort)])
def test_demo_pinpoints_the_injected_bug(tmp_path, second):
    # A subprocess, as users run it (ORT redirects the process's stdout file descriptor while exporting).
    command = [sys.executable, "-m", "probes.demo", "--inject-bug", "--steps", "3", "--bug-step", "1",
               "--bug-layer", "blocks.0.mlp.0", "--second", second, "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    label = "eager2" if second == "eager" else second
    assert (f"compare pinpointed the injected bug in the {label} run: step 1, forward, blocks.0.mlp.0.output.0"
            in result.stdout)
    html = tmp_path / f"compare_{label}.html"
    assert f"HTML report: {html.resolve()}" in result.stdout and html.stat().st_size > 0


def test_a_dump_written_before_norm_existed_compares_clean_with_one_that_has_it(base_run, tmp_path):
    from probes.compare.engine import compare_records

    records = load_dump(base_run)
    assert records and all("norm" in record for record in records if "unsupported" not in record)
    with DumpWriter(tmp_path / "old", rank=0) as writer:
        for record in records:
            write_record(writer, record["step"], {key: value for key, value in record.items() if key != "norm"})
        for step in sorted({record["step"] for record in records}):
            writer.finish_step(step)
    assert all("norm" not in record for record in load_dump(tmp_path / "old"))
    for base, other in ((base_run, tmp_path / "old"), (tmp_path / "old", base_run)):
        report = compare_dumps(base, other)
        assert report.first_divergence is None and report.matched == len(records), format_report(report)
    without = {key: value for key, value in records[0].items() if key != "norm"}
    assert not [m for m in compare_records(records[0], without).metrics if m.ratio > 1]
    # A norm that differs where both records have one is still a divergence.
    changed = {**records[0], "norm": records[0]["norm"] * 1.5 + 1.0}
    assert [m.metric for m in compare_records(records[0], changed).metrics if m.ratio > 1] == ["norm"]
