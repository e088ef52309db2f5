"""The zoo's ``clip_tiny_init`` (CLIP with weights 100x smaller than its default, issue 47) eager against
torch.compile with inductor, float32, 3 SGD steps (docs/compare.md, Gradients that cancel): a weight scaled by 1.01
in the compiled run is the first divergence, at step 0, at that module, at the default tolerances and with the
noise floor; the clean pair compares clean with the noise floor, and not at the defaults (a cancellation inside
``CLIPModel.forward``'s own code, where no record holds the terms: ``test_clean_pair_agrees_at_the_defaults``).
Skipped where inductor fails on the model without probes too (torch 2.4.1: its ``mul_softmax_pattern`` pass raises
on CLIP's attention).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from probes.compare import compare_dumps
from probes.rounding import perturbed_rounding

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
    for seed in (1, 2):  # calibration runs: the eager run again under perturbed rounding (docs/compare.md)
        with perturbed_rounding(seed=seed):
            train(ARCH, "eager", root / f"noise_{seed}")
    train(dataclasses.replace(ARCH, make=_scaled(ARCH.make)), "compile", root / "bug", compile_backend="inductor")
    return {name: root / name for name in ("eager", "inductor", "bug", "noise_1", "noise_2")}


def _noise(runs: dict[str, Path]) -> list[Path]:
    return [runs["noise_1"], runs["noise_2"]]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "measured on the modern lane (torch 2.13, sdpa): step 0 agrees (worst ratio 0.053, also without the "
    "entering-gradient floor); by step 1 the loss is at ln 2 (the embeddings coincide) and the cosine logits and "
    "the embeddings' gradients cancel inside CLIPModel.forward's own code, where no record holds the terms: "
    "<root>.output.1 forward ratio 1.71 at step 1, 5.9x what the step carried (drift allows 4x); the noise floor "
    "measures it (test_clean_pair_agrees_with_the_noise_floor)"))
def test_clean_pair_agrees_at_the_defaults(runs):
    report = compare_dumps(runs["eager"], runs["inductor"])
    assert report.agrees, report.first_divergence


@pytest.mark.slow
def test_clean_pair_agrees_with_the_noise_floor(runs):
    report = compare_dumps(runs["eager"], runs["inductor"], noise=_noise(runs))
    assert report.agrees, report.first_divergence
    assert report.noise_floor.beyond == 0 and report.noise_floor.within > 0.9 * report.matched, report.noise_floor


@pytest.mark.slow
@pytest.mark.parametrize("noise", [False, True], ids=["defaults", "noise_floor"])
def test_a_scaled_weight_is_the_first_divergence_at_step_0_at_its_module(runs, noise):
    report = compare_dumps(runs["eager"], runs["bug"], noise=_noise(runs) if noise else None)
    first = report.first_divergence
    assert first is not None, "the 1.01 weight was not found"
    # The attention's op records (the zoo records them) hold q_proj's own linear first: the same tensor.
    assert (first.step, first.phase, first.name) == (0, "forward", f"{ATTENTION}/linear:0.output.0"), first
    own = next(r for r in report.records if (r.step, r.phase, r.name) == (0, "forward", f"{BUGGY}.output.0"))
    assert own.diverged and own.ratio > 10, own
