"""The zoo's ``clip_tiny_init`` (CLIP with weights 100x smaller than its default, issue 47) eager against
torch.compile with inductor, float32, 3 SGD steps, at the default tolerances (docs/compare.md, Gradients that
cancel): a weight scaled by 1.01 in the compiled run is the first divergence, at step 0, at that module; the clean
pair compares clean (expected to fail today, see ``test_clean_pair_agrees``). Skipped where inductor fails on the
model without probes too (torch 2.4.1: its ``mul_softmax_pattern`` pass raises on CLIP's attention).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from probes.compare import compare_dumps

pytest.importorskip("transformers")

from test_zoo import train  # noqa: E402
from zoo import ARCHITECTURES  # noqa: E402

ARCH = ARCHITECTURES["clip_tiny_init"]
ATTENTION = "text_model.encoder.layers.1.self_attn"
BUGGY = f"{ATTENTION}.q_proj"


def _scaled(make):
    def make_scaled(t):
        model = make(t)
        with torch.no_grad():
            model.get_submodule(BUGGY).weight.mul_(1.01)
        return model
    return make_scaled


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cancelling")
    try:
        train(ARCH, "compile", root / "inductor", compile_backend="inductor")
    except Exception as error:
        try:
            train(ARCH, "compile", None, compile_backend="inductor")
        except Exception as plain:  # not ours to prove: the backend fails on the model without probes too
            lines = str(plain).splitlines() or [""]
            cause = next((line for line in lines if "Error:" in line), lines[0])
            pytest.skip(f"inductor fails on clip_tiny_init without probes too: {type(plain).__name__}: {cause}"[:300])
        raise error
    train(ARCH, "eager", root / "eager")
    train(dataclasses.replace(ARCH, make=_scaled(ARCH.make)), "compile", root / "bug", compile_backend="inductor")
    return {name: root / name for name in ("eager", "inductor", "bug")}


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "measured on the modern lane (torch 2.13, sdpa): step 0 agrees (worst ratio 0.053, also without the "
    "entering-gradient floor); by step 1 the loss is at its floor ln 2 (the embeddings collapse) and the cosine "
    "logits and the gradient of the text/image embeddings cancel inside CLIPModel.forward's own code, where no "
    "record holds the terms: <root>.output.1 forward ratio 1.71 at step 1, text_projection.output.0 backward 15 at "
    "step 2 (eager attention)"))
def test_clean_pair_agrees(runs):
    report = compare_dumps(runs["eager"], runs["inductor"])
    assert report.agrees, report.first_divergence


@pytest.mark.slow
def test_a_scaled_weight_is_the_first_divergence_at_step_0_at_its_module(runs):
    report = compare_dumps(runs["eager"], runs["bug"])
    first = report.first_divergence
    assert first is not None, "the 1.01 weight was not found"
    # The attention's op records (the zoo records them) hold q_proj's own linear first: the same tensor.
    assert (first.step, first.phase, first.name) == (0, "forward", f"{ATTENTION}/linear:0.output.0"), first
    own = next(r for r in report.records if (r.step, r.phase, r.name) == (0, "forward", f"{BUGGY}.output.0"))
    assert own.diverged and own.ratio > 10, own
