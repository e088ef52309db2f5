"""Bugs are still found with the noise floor on, at the right step, phase and module (issue 34).

The base is eager PyTorch; the calibration runs are the base again under ``perturbed_rounding`` (seeds 1 and 2);
the other run is torch.compile (inductor, whose kernels round differently) or ORTModule (fp32: ORT's CPU build has
no bfloat16 MatMul), in float32 and under bfloat16 autocast, with a bug from step 2:

- ``scale``: one layer's output scaled by 1.01 (``inject_bug``);
- ``softmax``: one attention layer's softmax computed from a wrongly scaled input (its scores divided by
  sqrt(d_model) instead of sqrt(head_dim), a factor 1/2 here).

Compared with the calibration runs as noise, the first divergence must be the bug's record at step 2 (forward),
beyond its noise floor, with every record of the steps before within it; the margin (the record's |diff| /
noise floor) is printed. In bfloat16 a 1% change is about 2.5 ulps of each value, as much as rounding moves single
values: the bug is found by the statistics of the whole tensor (std, norm), whose noise averages down.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch

from torch._dynamo.testing import CompileCounterWithBackend

from helpers import OrtWitness
from probes import StatisticsSubscriber, SubscriberManager
from probes.compare import compare_dumps
from probes.models import TinyTransformer, TransformerConfig, make_batch
from probes.testing import BugInjection, ScaleOutput, assert_parity, inject_bug, perturbed_rounding

LANE = os.environ.get("PROBES_LANE", "unknown")
CONFIG = TransformerConfig(vocab_size=128, d_model=32, n_heads=4, n_layers=2, d_ff=64, seq_len=16)
STEPS, BUG_STEP = 3, 2
BUGS = {"scale": ("blocks.1.mlp.0", "blocks.1.mlp.0.output.0"),
        "softmax": ("blocks.1.attn", "blocks.1.attn.dropout.output.0")}  # the dropout (p=0) returns the softmax


def misscaled_softmax(model: TinyTransformer, layer: str, step: int, factor: float) -> BugInjection:
    """From ``step`` on, the attention ``layer``'s scores are multiplied by ``factor`` before the softmax; the factor
    is read from a live object each step (``ScaleOutput``), so the bug works under ORTModule and torch.compile."""
    attn = dict(model.named_modules())[layer]
    bug = BugInjection(layer, step, factor, "forward")

    def forward(x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        head = width // attn.n_heads
        q, k, v = attn.qkv(x).split(width, dim=-1)
        q, k, v = (t.reshape(batch, seq, attn.n_heads, head).transpose(1, 2) for t in (q, k, v))
        scores = ScaleOutput.apply(bug, torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head))
        weights = attn.dropout(torch.softmax(scores, dim=-1))
        return attn.proj(torch.matmul(weights, v).transpose(1, 2).reshape(batch, seq, width))

    attn.forward = forward
    return bug


def train(out: Path, *, dtype: str, backend: str = "eager", bug: str | None = None) -> list[float]:
    """``STEPS`` SGD steps of the tiny transformer, statistics to ``out``; under torch.compile and ORTModule it
    proves that the compiled graph, or ORT's runtime, ran the model and its probes."""
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    injection = None
    if bug == "scale":
        injection = inject_bug(model, BUGS[bug][0], step=BUG_STEP, factor=1.01)
    elif bug == "softmax":
        # scores / sqrt(d_model) where sqrt(head_dim) was meant: sqrt(head_dim / d_model) = 1 / sqrt(n_heads)
        injection = misscaled_softmax(model, BUGS[bug][0], BUG_STEP, 1 / math.sqrt(CONFIG.n_heads))
    witness = OrtWitness()
    manager = SubscriberManager()
    manager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True), witness])
    runner = model
    counter = CompileCounterWithBackend("inductor")
    if backend == "compile":
        torch._dynamo.reset()
        runner = torch.compile(model, backend=counter)
    elif backend == "ort":
        from onnxruntime.training.ortmodule import ORTModule

        runner = ORTModule(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    try:
        for step in range(STEPS):
            if injection is not None:
                injection.step = step
            batch = make_batch(CONFIG, batch_size=4, seed=step)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = runner(batch["tokens"], labels=batch["labels"])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        manager.unsubscribe()
        if backend == "compile":
            torch._dynamo.reset()
    assert backend != "compile" or counter.frame_count >= 1, "the compiled graph never ran"
    assert backend != "ort" or witness.by_ort > 0, "ORT's runtime never called a probe"
    return losses


@pytest.fixture(scope="module")
def baselines(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per dtype: the eager base and two calibration runs."""
    root = tmp_path_factory.mktemp("noise_floor")
    found: dict[str, dict[str, Path]] = {}
    for dtype in ("fp32", "bf16"):
        paths = {name: root / f"{dtype}-{name}" for name in ("base", "noise_1", "noise_2")}
        train(paths["base"], dtype=dtype)
        for seed in (1, 2):
            with perturbed_rounding(seed=seed):
                train(paths[f"noise_{seed}"], dtype=dtype)
        found[dtype] = paths
    return found


CASES = [("fp32", "compile", "scale"), ("fp32", "compile", "softmax"), ("bf16", "compile", "scale"),
         ("bf16", "compile", "softmax"), ("fp32", "ort", "scale"), ("fp32", "ort", "softmax")]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,backend,bug", [pytest.param(*case, marks=[pytest.mark.ort] if case[1] == "ort" else [])
                                                for case in CASES])
def test_a_bug_is_the_first_divergence_beyond_the_noise_floor(baselines, tmp_path, dtype, backend, bug):
    runs = baselines[dtype]
    noise = [runs["noise_1"], runs["noise_2"]]
    started = time.perf_counter()
    train(tmp_path / "other", dtype=dtype, backend=backend, bug=bug)
    seconds = time.perf_counter() - started
    report = compare_dumps(runs["base"], tmp_path / "other", noise=noise)
    first = report.first_divergence
    assert first is not None, "the bug was not found"
    assert (first.step, first.phase, first.name) == (BUG_STEP, "forward", BUGS[bug][1]), str(first)
    assert first.noise_floor == "beyond"
    assert report.noise_floor.first_beyond == (0, BUG_STEP, "forward", BUGS[bug][1])
    before = [record for record in report.records if record.step < BUG_STEP]
    assert before and not any(record.diverged or record.beyond_noise for record in before)
    record = next(r for r in report.records if (r.step, r.phase, r.name) == (BUG_STEP, "forward", BUGS[bug][1]))
    largest_before = max((r.noise_ratio for r in before if r.noise_ratio is not None), default=0.0)
    print(f"\n{dtype} {backend} {bug}: first divergence {first}; |diff| / noise floor at the bug {record.noise_ratio:.3g} "
          f"({', '.join(f'{m.metric} {m.abs_diff / m.floor:.3g}' for m in record.metrics if m.floor)}); "
          f"largest before the bug {largest_before:.3g}; {seconds:.0f} s")
    assert record.noise_ratio > 2, "too close to the noise floor to trust"
    with pytest.raises(AssertionError, match=f"step {BUG_STEP}, forward, {BUGS[bug][1]}"):
        assert_parity(runs["base"], tmp_path / "other", noise=noise)
