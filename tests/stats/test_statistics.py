"""StatisticsSubscriber end to end: records against numpy, no observer effect, crash safety, errors."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from helpers import train_run
from probes import StatisticsSubscriber, SubscriberManager, inspect_activation, load_dump
from probes.dump.reader import list_steps
from probes.models import TinyTransformer, TransformerConfig, make_batch
from probes.testing import assert_parity

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
ROOT = Path(__file__).resolve().parents[2]


def reference(array: np.ndarray) -> dict:
    """Statistics of ``array`` computed independently in numpy float64."""
    values = array.astype(np.float64).ravel()
    finite = values[np.isfinite(values)]
    return {
        "numel": values.size,
        "min": finite.min(),
        "max": finite.max(),
        "mean": finite.mean(),
        "std": finite.std(ddof=1),
        "nan": int(np.isnan(values).sum()),
        "inf": int(np.isinf(values).sum()),
        "neg": int((values < 0).sum()),
        "pos": int((values > 0).sum()),
        "zero": int((values == 0).sum()),
    }


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        h = inspect_activation("hidden", self.act(self.fc1(x)))
        return self.fc2(h)


def test_records_match_numpy_for_activations_and_gradients(tmp_path):
    torch.manual_seed(0)
    model = TwoLayer()
    x = torch.randn(4, 6)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / "out")]):
        out = model(x)
        (out * torch.arange(3.0)).sum().backward()
    records = {(r["phase"], r["name"]): r for r in load_dump(tmp_path / "out")}

    # Independent values: recompute the activations and gradients with plain autograd.
    fc1 = model.fc1(x).detach().requires_grad_()
    act = torch.relu(fc1)
    out_ref = model.fc2(act)
    grad_out = torch.arange(3.0).expand(4, 3)
    (grad_act,) = torch.autograd.grad(out_ref, act, grad_out)
    expected = {
        ("forward", "fc1.output.0"): fc1.detach(),
        ("forward", "act.output.0"): act.detach(),
        ("forward", "hidden"): act.detach(),
        ("forward", "<root>.output.0"): out_ref.detach(),
        ("backward", "<root>.output.0"): grad_out,
        ("backward", "act.output.0"): grad_act,
    }
    for key, tensor in expected.items():
        record, ref = records[key], reference(tensor.numpy())
        for stat in ("numel", "nan", "inf", "neg", "pos", "zero", "min", "max"):
            assert record[stat] == ref[stat], (key, stat)
        for stat in ("mean", "std"):
            assert record[stat] == pytest.approx(ref[stat], rel=1e-12, abs=1e-15), (key, stat)
        assert record["shape"] == list(tensor.shape) and record["dtype"] == "float32"
        flat = tensor.reshape(-1).numpy()
        assert record["samples"] == [float(flat[i]) for i in record["sample_indices"]]
    assert records[("forward", "fc1.output.0")]["legacy_name"] == "Linear_1_0th_output"
    assert [r["seq"] for r in load_dump(tmp_path / "out")] == list(range(len(records)))


def test_subscriber_does_not_change_loss_or_gradients(tmp_path):
    torch.manual_seed(0)
    probed = TinyTransformer(CONFIG)
    plain = copy.deepcopy(probed)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (probed, plain)]
    with SubscriberManager().subscribe(probed, [StatisticsSubscriber(tmp_path / "out")]):
        for step in range(4):
            batch = make_batch(CONFIG, batch_size=4, seed=step)
            losses = []
            for model, optimizer in zip((probed, plain), optimizers):
                optimizer.zero_grad()
                loss = model(batch["tokens"], labels=batch["labels"])
                loss.backward()
                losses.append(loss)
            assert torch.equal(losses[0], losses[1])
            for a, b in zip(probed.parameters(), plain.parameters()):
                assert torch.equal(a.grad, b.grad)
            for optimizer in optimizers:
                optimizer.step()
    assert list_steps(tmp_path / "out")[0]["finished"] == [0, 1, 2, 3]


def test_existing_output_dir_needs_override(tmp_path):
    StatisticsSubscriber(tmp_path / "out").close()
    with pytest.raises(FileExistsError, match="override_output_dir=True"):
        StatisticsSubscriber(tmp_path / "out")
    StatisticsSubscriber(tmp_path / "out", override_output_dir=True).close()


def test_unwritable_output_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="a_file"):
        StatisticsSubscriber(blocker / "out")


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="bucket_size"):
        StatisticsSubscriber(tmp_path / "a", bucket_size=0)
    with pytest.raises(ValueError, match="start_step"):
        StatisticsSubscriber(tmp_path / "b", start_step=3, end_step=1)


CRASHING_RUN = textwrap.dedent(
    """
    import os, signal, sys, torch
    from probes import StatisticsSubscriber, SubscriberManager
    from probes.models import TinyTransformer, TransformerConfig, make_batch
    config = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
    model = TinyTransformer(config)
    subscriber = StatisticsSubscriber(sys.argv[1])
    SubscriberManager.subscribe(model, [subscriber])
    for step in range(4):
        batch = make_batch(config, batch_size=2, seed=step)
        loss = model(batch["tokens"], labels=batch["labels"])
        if step == 3:
            subscriber.flush()               # steps 0-2 are finished and step 3 is half written
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
    """
)


def test_a_killed_run_leaves_finished_steps_readable(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", CRASHING_RUN, str(out)], env=env, capture_output=True, timeout=600)
    assert result.returncode == -9, result.stderr.decode()
    assert list_steps(out)[0] == {"finished": [0, 1, 2], "unfinished": [3]}
    records = load_dump(out)
    assert sorted({r["step"] for r in records}) == [0, 1, 2]
    per_step = [sum(r["step"] == s for r in records) for s in range(3)]
    assert per_step[0] == per_step[1] == per_step[2] > 0
    partial = load_dump(out, include_partial=True)
    assert {r["step"] for r in partial} == {0, 1, 2, 3}


@pytest.mark.ort
@pytest.mark.slow
def test_eager_and_ortmodule_dumps_agree(tmp_path):
    from onnxruntime.training.ortmodule import ORTModule

    torch.manual_seed(0)
    eager = TinyTransformer(CONFIG)
    ort_inner = copy.deepcopy(eager)
    train_run(tmp_path / "eager", config=CONFIG, steps=3, model=eager)
    train_run(tmp_path / "ort", config=CONFIG, steps=3, model=ort_inner, wrap=ORTModule)
    runs = {label: load_dump(tmp_path / label) for label in ("eager", "ort")}
    keys = {label: sorted((r["step"], r["phase"], r["name"]) for r in records) for label, records in runs.items()}
    assert keys["eager"] == keys["ort"]
    assert {k[0] for k in keys["ort"]} == {0, 1, 2}  # step 0 is the first training step, export never dumped
    report = assert_parity(tmp_path / "eager", tmp_path / "ort", rtol=1e-4, atol=1e-6)
    assert report.matched == len(keys["eager"])
