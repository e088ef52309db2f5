"""Op-level causes on a real model (issue 47, item 7): GPT-2 (tiny config) with op records in every attention, and a
1% scale of the attention scores in one run only (the scale of the scores' scaling op changed: the ort lane's
transformers divides by ``torch.full(sqrt(head_dim))``, the modern lane's multiplies by ``module.scaling``). The
first divergence is the scaling op (on the ort lane the divisor constant before it: its read record); the masked scores after it (mask fills of ``finfo.min``: ``where`` on the ort
lane, an added mask on the modern lane) do not agree; the softmax after them is not ``local``; and the next layer's
``c_attn`` reads the previous layer's output that the bug already changed: ``propagated``.
"""

from __future__ import annotations

import types

import pytest
import torch

from probes import StatisticsSubscriber, SubscriberManager
from probes.compare import compare_dumps, format_report
from helpers import gpt2_batch

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2 import modeling_gpt2  # noqa: E402

SCALE = 1.01
SHARPEN = 4.0
LEGACY = hasattr(modeling_gpt2.GPT2Attention, "_attn")  # transformers 4.x: _attn divides, then torch.where
SCALING_OP, MASK_OP = ("div:0", "where:0") if LEGACY else ("mul:0", "add:0")


def _model() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    config._attn_implementation = "eager"  # the scores as operations (sdpa is one)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # query and key weights x SHARPEN: attention attends, as in a trained model
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, :2 * config.n_embd] *= SHARPEN
    return model


def _scaled_torch(head_dim: int) -> types.SimpleNamespace:
    """``torch`` as modeling_gpt2 (4.x) sees it, with the scores' divisor 1% smaller: the scores 1% larger."""
    def full(size, value, *args, **kwargs):
        if value == head_dim ** 0.5:
            value = value / SCALE
        return torch.full(size, value, *args, **kwargs)

    return types.SimpleNamespace(**{**{name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")},
                                    "full": full})


def _train(out, monkeypatch, scaled: bool) -> None:
    model = _model()
    if scaled:
        if LEGACY:
            monkeypatch.setattr(modeling_gpt2, "torch", _scaled_torch(32 // 2))
        else:
            for block in model.transformer.h:
                block.attn.scaling *= SCALE
    subscriber = StatisticsSubscriber(out, override_output_dir=True, ops="transformer.h.*.attn*")
    with SubscriberManager().subscribe(model, [subscriber]):
        model(**gpt2_batch(0)).loss.backward()
    monkeypatch.undo()


def test_a_scale_of_the_attention_scores_is_found_at_the_scaling_op_and_carried_by_the_ops_after_it(
        tmp_path, monkeypatch):
    _train(tmp_path / "base", monkeypatch, scaled=False)
    _train(tmp_path / "again", monkeypatch, scaled=False)
    assert compare_dumps(tmp_path / "base", tmp_path / "again").agrees
    _train(tmp_path / "scaled", monkeypatch, scaled=True)
    report = compare_dumps(tmp_path / "base", tmp_path / "scaled")
    text = format_report(report)
    first = report.first_divergence
    attn = "transformer.h.0.attn"
    # On the ort lane the bug is a constant (the divisor ``torch.full`` makes): its read record is the first
    # divergence, made where the constant is made (issue 47, read records), then the scaling op.
    first_name = f"{attn}/full:0.output.0" if LEGACY else f"{attn}/{SCALING_OP}.output.0"
    assert first is not None and (first.step, first.phase, first.name) == (0, "forward", first_name), text
    records = {(r.phase, r.name): r for r in report.records if r.step == 0}
    scaling = records["forward", f"{attn}/{SCALING_OP}.output.0"]
    assert scaling.ratio > 10, scaling  # a 1% change of values of scale 1: far beyond rounding
    assert records["forward", f"{attn}/matmul:0.output.0"].ratio < 1  # the scores before the scale agree
    masked = records["forward", f"{attn}/{MASK_OP}.output.0"]
    assert masked.diverged and masked.ratio > 1, masked  # the fills do not hide the 1% of the values beside them
    findings = {(op.phase, op.name): op for group in report.operations.modules for op in group.ops}
    assert report.first_operation.name == first.name and report.first_operation.cause == "local", text
    # On the ort lane the division reads the divisor that differs: the same 1% relative to their magnitudes (the
    # scalar divisor's tolerance makes it ratio ~99, the division's ~1000), so the division is propagated.
    scaling_cause = findings["forward", f"{attn}/{SCALING_OP}.output.0"]
    assert scaling_cause.cause == ("propagated" if LEGACY else "local"), scaling_cause.explained()
    softmax = findings["forward", f"{attn}/softmax:0.output.0"]
    assert softmax.cause != "local", softmax.explained()
    c_attn = findings["forward", "transformer.h.1.attn.c_attn/addmm:0.output.0"]
    assert c_attn.cause == "propagated", c_attn.explained()
