"""Compare knows a step's order (forward, backward, grad, param, optim), says what kind of divergence the first one
is, and shows each step's global gradient norm; on dumps of a real AdamW training (tests/param_runs.py)."""

from __future__ import annotations

import json
import math

import pytest

from param_runs import global_grad_norm, train_dump
from probes.cli import main
from probes.compare import compare_dumps, format_report
from probes.compare.html import render_html
from probes.compare.results import KINDS, divergence_kind
from probes.compare.results import Divergence


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("phases")
    return {"base": train_dump(root / "base"),
            "rerun": train_dump(root / "rerun"),
            "decay": train_dump(root / "decay", decay={"blocks.1.fc.weight": 0.5}),
            "clip": train_dump(root / "clip", clip=0.05),
            "beta2": train_dump(root / "beta2", beta2=0.5)}


def where(report):
    first = report.first_divergence
    return first.step, first.phase, first.name


def test_a_rerun_agrees_and_every_step_has_its_global_grad_norm(runs):
    report = compare_dumps(runs["base"].path, runs["rerun"].path)
    assert report.agrees and report.first_divergence_kind() is None
    assert report.to_json()["first_divergence_kind"] is None
    for summary in report.per_step():
        expected = global_grad_norm(runs["base"].grads[summary.step])
        assert summary.grad_norm.rank == 0
        assert summary.grad_norm.base == pytest.approx(expected, rel=1e-12)
        assert summary.grad_norm.other == summary.grad_norm.base


def test_a_weight_decay_of_one_parameter_shows_at_that_steps_param_record(runs):
    report = compare_dumps(runs["base"].path, runs["decay"].path)
    # The step's forward, backward and grad records agree; the next step's forward differs, but the update came first.
    assert where(report) == (0, "param", "blocks.1.fc.weight")
    assert any(d.step == 1 and d.phase == "forward" for d in report.divergences)
    kind = report.first_divergence_kind()
    assert (kind.code, kind.sentence) == ("update", "gradients agree, the update differs")
    assert kind.recorded == ("forward", "backward", "grad", "param", "optim") and kind.differing[0] == "param"
    document = report.to_json()
    assert document["first_divergence_kind"] == kind.to_json()
    assert document["first_divergence"]["phase"] == "param"
    text = format_report(report)
    assert "FIRST DIVERGENCE  step 0  param  blocks.1.fc.weight" in text.replace("rank 0  ", "")
    assert "kind: gradients agree, the update differs [update]" in text
    assert "What differs: gradients agree, the update differs [update]" in render_html(report)


def test_a_clipping_change_shows_at_grad_with_the_activations_agreeing(runs):
    report = compare_dumps(runs["base"].path, runs["clip"].path)
    assert where(report) == (0, "grad", "blocks.0.fc.weight")  # every gradient is scaled: the first in model order
    assert not [d for d in report.divergences if d.step == 0 and d.phase in ("forward", "backward")]
    kind = report.first_divergence_kind()
    assert kind.code == "gradients"
    assert kind.sentence == "activations agree, the parameter gradients differ (accumulation, clipping, all-reduce)"
    base, other = (report.per_step()[0].grad_norm.base, report.per_step()[0].grad_norm.other)
    assert base == pytest.approx(global_grad_norm(runs["base"].grads[0]), rel=1e-12)
    assert other == pytest.approx(global_grad_norm(runs["clip"].grads[0]), rel=1e-12)
    assert other == pytest.approx(0.05, rel=1e-5)  # clip_grad_norm_'s target: the same definition of the norm


def test_an_optimizer_state_change_shows_at_optim_with_the_parameters_agreeing(runs):
    report = compare_dumps(runs["base"].path, runs["beta2"].path)
    assert where(report) == (0, "optim", "blocks.0.fc.weight.exp_avg_sq")
    assert report.first_divergence_kind().sentence == "parameters agree, the optimizer state differs"


def test_phases_not_recorded_are_named_not_said_to_agree(runs):
    report = compare_dumps(runs["base"].path, runs["decay"].path, names=["*.weight", "*.bias"])
    kind = report.first_divergence_kind()
    assert where(report) == (0, "param", "blocks.1.fc.weight") and kind.recorded == ("grad", "param")
    assert kind.sentence == "gradients agree, the update differs (forward, backward not recorded)"
    report = compare_dumps(runs["base"].path, runs["decay"].path, names=["*.weight"], steps=[1])
    assert where(report) == (1, "grad", "blocks.0.fc.weight")  # the decayed weight changed the step-1 gradients
    assert report.first_divergence_kind().sentence == (
        "the parameter gradients differ (accumulation, clipping, all-reduce) (forward, backward not recorded)")


def test_the_kind_sentences_follow_the_recorded_phases():
    def sentence(phase, recorded):
        return divergence_kind(Divergence(0, 0, phase, "x", "mean", 1.0, 2.0), recorded=recorded, differing=()).sentence

    assert [kind.phase for kind in KINDS] == ["forward", "backward", "recompute", "grad", "param", "optim"]
    assert len({kind.code for kind in KINDS}) == len(KINDS)
    everything = {"forward", "backward", "grad", "param", "optim"}
    assert sentence("forward", everything) == "the forward differs (activations)"
    assert sentence("backward", everything) == "the forward agrees, the gradients flowing back differ"
    assert sentence("grad", {"forward"}) == ("the forward agrees, the parameter gradients differ (accumulation, "
                                             "clipping, all-reduce) (backward not recorded)")
    assert sentence("param", {"forward", "backward"}) == ("the forward and the backward agree, the update differs "
                                                          "(grad not recorded)")
    assert sentence("optim", {"param"}) == "parameters agree, the optimizer state differs (forward, backward, grad not recorded)"


def test_windows_report_the_kind_and_norms_as_one_read_does(runs):
    for other in ("decay", "clip"):
        whole = compare_dumps(runs["base"].path, runs[other].path, window=None)
        windowed = compare_dumps(runs["base"].path, runs[other].path, window=10, jobs=2)
        assert windowed.to_json() == whole.to_json()
        assert format_report(windowed) == format_report(whole)
        assert render_html(windowed) == render_html(whole)
        assert whole.to_json()["first_divergence_kind"] is not None


def test_the_command_line_says_the_kind_and_the_norms(runs, tmp_path, capsys):
    code = main(["compare", str(runs["base"].path), str(runs["decay"].path), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 1 and "kind: gradients agree, the update differs [update]" in out
    assert "grad norm base" in out and "grad norm other" in out
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["first_divergence_kind"]["code"] == "update"
    norms = {s["step"]: s["global_grad_norm"] for s in document["per_step"]}
    for step, grads in runs["base"].grads.items():
        assert norms[step]["base"] == pytest.approx(global_grad_norm(grads), rel=1e-12)
        assert norms[step]["other"] == pytest.approx(global_grad_norm(runs["decay"].grads[step]), rel=1e-12)
    assert norms[0]["base"] == norms[0]["other"] and not math.isclose(norms[2]["base"], norms[2]["other"], rel_tol=1e-6)
