"""Where a tensor's own rms is the wrong scale for its tolerance (issue 47, docs/compare.md, Tolerance: Fills and
Gradients that cancel): mask fills that dominate the rms, and a gradient that cancels to almost nothing in exact
arithmetic. Both sides: rounding agrees, a bug of a percent is found. Expected scales computed here in numpy float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probes.compare import compare_dumps
from probes.compare.engine import compare_records
from probes.dump.writer import DumpWriter
from probes.stats.one_tensor import tensor_record
from dump_records import write_record

EPS32 = 2.0 ** -23


def record(name: str, tensor: torch.Tensor, phase: str = "forward", seq: int = 0, **fields) -> dict:
    return {"rank": 0, "step": 0, "name": name, "phase": phase, "seq": seq, **tensor_record(tensor, sample_count=32),
            **fields}


def rounded(tensor: torch.Tensor, ulps: float, seed: int) -> torch.Tensor:
    """``tensor`` as another backend rounds it: each value moved by up to ``ulps`` float32 eps of itself."""
    noise = torch.rand(tensor.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1
    return (tensor.double() * (1 + ulps * EPS32 * noise)).float()


def masked_scores(fill: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(4, 16, 16, generator=generator)
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)
    return scores, mask


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e4, -1e9])
def test_mask_fills_do_not_set_the_scale_of_the_values_beside_them(fill):
    scores, mask = masked_scores(fill)
    base = scores.masked_fill(mask, fill)
    clean = compare_records(record("where:0", base), record("where:0", rounded(scores, 4, 1).masked_fill(mask, fill)))
    assert not clean.diverged, clean
    # Every unmasked value 1% off: the fills (almost half the tensor) dominate the rms, not the tolerance.
    bug = compare_records(record("where:0", base), record("where:0", (scores * 1.01).masked_fill(mask, fill)))
    assert bug.diverged, bug
    worst = bug.worst
    unmasked = scores[~mask.expand_as(scores)].double().numpy()
    scale = float(np.sqrt(np.mean(unmasked ** 2)))
    assert worst.metric in ("samples", "max") and worst.ratio > 10, bug
    # The tolerance of a value beside the fills: rtol * max(|x|, the unmasked values' rms), not the fills' rms.
    assert worst.tolerance <= 1e-4 * max(abs(worst.base), 2 * scale), (worst, scale)


def test_values_repeated_at_the_extremes_that_do_not_dominate_keep_the_rms():
    generator = torch.Generator().manual_seed(0)
    relu = torch.relu(torch.randn(64, 32, generator=generator))  # zeros at half the positions: the min, repeated
    clamped = torch.randn(64, 32, generator=generator).clamp(-1, 1)  # +-1 at a third of the positions
    for tensor in (relu, clamped):
        values = tensor.double().numpy()
        scale = float(np.sqrt(np.mean(values ** 2)))
        found = compare_records(record("x", tensor), record("x", tensor * (1 + 1e-6)))
        samples = found.metric("samples") if hasattr(found, "metric") else next(
            m for m in found.metrics if m.metric == "samples")
        assert samples.tolerance == pytest.approx(1e-4 * max(abs(samples.base), scale), rel=1e-3), (found, scale)


def write(path, records: list[dict]) -> None:
    with DumpWriter(path) as writer:
        for found in records:
            write_record(writer, 0, found)
        writer.finish_step(0)


def cancelling(seed: int, bug: float = 0.0) -> list[dict]:
    """The backward records of an attention whose query gradient cancels: the gradient entering the attention is
    about 0.04; the query projection's output gradient is a difference of terms of that size that cancel to ~1e-9
    (in float32 their rounding is ~4e-9). ``seed`` picks the rounding; ``bug``: a change of the terms' size (a
    softmax backward that leaves out part of the row sum)."""
    generator = torch.Generator().manual_seed(0)
    entering = 0.04 * torch.randn(2, 12, 32, generator=generator, dtype=torch.float64)
    terms = 0.04 * torch.randn(2, 12, 32, generator=generator, dtype=torch.float64)
    exact_q = 1e-9 * torch.randn(2, 12, 32, generator=generator, dtype=torch.float64)
    noise = torch.Generator().manual_seed(seed)
    # The computed gradient: (terms + exact) - terms, each part rounded to float32 another way per seed.
    part = (terms + exact_q).float() + (bug * terms).float()
    grad_q = rounded(part, 1, seed).double() - rounded(terms.float(), 1, seed + 100).double()
    fields = dict(phase="backward", kind="output", tensor_index=0)
    return [
        record("attn.output.0", rounded(entering.float(), 0.5, seed), seq=0, module="attn", **fields),
        record("attn.q_proj.output.0", grad_q.float(), seq=1, module="attn.q_proj", **fields),
        record("attn.k_proj.output.0", (torch.randn(2, 12, 8, generator=noise) * 1e-9), seq=2, module="attn.k_proj",
               **fields)]


def test_a_gradient_that_cancels_has_the_scale_of_the_gradient_entering_its_module(tmp_path):
    base, clean, buggy = cancelling(0), cancelling(1), cancelling(0, bug=0.01)
    q = 1
    rel = (base[q]["std"] - clean[q]["std"]) / base[q]["std"]
    assert abs(rel) > 1e-3  # the rounding of the terms is far beyond the gradient's own scale
    write(tmp_path / "base", base[:2])
    write(tmp_path / "clean", clean[:2])
    write(tmp_path / "bug", buggy[:2])
    assert compare_dumps(tmp_path / "base", tmp_path / "clean").agrees
    # On its own, with no module around it, the record would be a divergence: its own rms set the scale.
    write(tmp_path / "alone_base", [{**base[q], "module": "q_proj", "name": "q_proj.output.0"}])
    write(tmp_path / "alone_clean", [{**clean[q], "module": "q_proj", "name": "q_proj.output.0"}])
    assert not compare_dumps(tmp_path / "alone_base", tmp_path / "alone_clean").agrees
    # A change on the scale of the terms (1% of them) is a divergence of that record.
    report = compare_dumps(tmp_path / "base", tmp_path / "bug")
    assert report.first_divergence is not None and report.first_divergence.name == "attn.q_proj.output.0", report
    record_diff = next(r for r in report.records if r.name == "attn.q_proj.output.0")
    assert record_diff.ratio > 10


def test_the_gradient_floor_takes_only_gradients_of_the_same_shape(tmp_path):
    # k_proj's gradient has another shape than the attention's output: no floor, its own rms is its scale.
    base, clean = cancelling(0), cancelling(1)
    write(tmp_path / "base", [base[0], base[2]])
    write(tmp_path / "clean", [base[0], {**base[2], "samples": [v * 1.01 for v in base[2]["samples"]]}])
    report = compare_dumps(tmp_path / "base", tmp_path / "clean")
    assert report.first_divergence is not None and report.first_divergence.name == "attn.k_proj.output.0"


@pytest.mark.parametrize("bug", ["values", "mask"])
def test_a_masked_operation_that_goes_wrong_itself_is_local_although_its_input_carries_rounding(tmp_path, bug):
    """Mask fills set a masked record's magnitude, so its values 1% off are ~1e-40 of it: weighed by relative
    difference, any input with rounding noise would seem to carry that. A record whose fills set its magnitude is
    weighed by ratio alone: the masked operation that goes wrong itself (its values 1% off, or one position more
    masked) is local, although its input carries another backend's rounding."""
    fill = torch.finfo(torch.float32).min
    scores, mask = masked_scores(fill)
    wrong, values = mask.clone(), scores * 1.01
    if bug == "mask":
        wrong[3, 2] = True
        values = scores
    op = dict(kind="op", module="attn")

    def run(scores: torch.Tensor, masked: torch.Tensor) -> list[dict]:
        return [record("attn/matmul:0.output.0", scores, seq=0, inputs=[], **op),
                record("attn/where:0.output.0", masked, seq=1, inputs=["attn/matmul:0.output.0"], **op)]

    write(tmp_path / "base", run(scores, scores.masked_fill(mask, fill)))
    write(tmp_path / "bug", run(rounded(scores, 1, 1), values.masked_fill(wrong, fill)))
    report = compare_dumps(tmp_path / "base", tmp_path / "bug")
    first = report.first_operation
    assert first is not None and first.name == "attn/where:0.output.0", report.first_divergence
    assert first.inputs[0].status == "agrees" and first.inputs[0].ratio > 0  # rounding: not identical
    assert first.rel_error is None and first.cause == "local", first.explained()
