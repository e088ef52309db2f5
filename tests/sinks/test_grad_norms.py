"""Gradient norms where people look: ``probes show``'s global grad norm per step, TensorBoard's ``grad_norm/<param>``
and ``grad_norm/global`` (written from a dump and live), all one definition (``global_grad_norms``), checked
against numpy float64 on the gradients themselves; norms are over finite elements."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from param_runs import global_grad_norm, train_dump
from probes.cli import main
from probes.dump import DumpReader
from probes.dump.statistics import global_grad_norms
from probes.sinks import LiveTensorBoard, write_tensorboard

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

NAN_AT = (2, "blocks.1.fc.weight")  # one nan element in this gradient: left out of its norm and the global one


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_dump(tmp_path_factory.mktemp("norms") / "run", nan_grad=NAN_AT)


def scalars(logdir):
    accumulator = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def as_float32(value):
    return float(torch.tensor(value, dtype=torch.float32))  # event files hold float32 scalars


def parameter_norm(grad):
    finite = grad[np.isfinite(grad)].astype(np.float64)
    return float(np.sqrt(np.sum(finite * finite)))


def test_the_global_norm_is_the_norm_of_every_finite_gradient_element(run):
    norms = global_grad_norms(DumpReader(run.path).records())
    assert sorted(norms) == [(0, step) for step in run.grads]
    for step, grads in run.grads.items():
        assert norms[(0, step)] == pytest.approx(global_grad_norm(grads), rel=1e-12)
    assert math.isfinite(norms[(0, NAN_AT[0])])
    assert global_grad_norms([{"phase": "grad", "rank": 0, "step": 0, "norm": None}]) == {}  # no finite element


def test_show_prints_each_steps_global_grad_norm(run, capsys):
    assert main(["show", str(run.path)]) == 0
    found = {int(step): float(value) for step, value in
             re.findall(r"^global grad norm step (\d+): (\S+)$", capsys.readouterr().out, re.MULTILINE)}
    assert sorted(found) == sorted(run.grads)
    for step, grads in run.grads.items():
        assert found[step] == pytest.approx(global_grad_norm(grads), rel=1e-5)  # printed with 6 digits
    assert main(["show", str(run.path), "--anomalies"]) == 0
    assert "global grad norm" not in capsys.readouterr().out


def test_tensorboard_has_grad_norm_per_parameter_and_global(run, tmp_path):
    write_tensorboard(run.path, tmp_path / "tb")
    read = scalars(tmp_path / "tb" / "rank_0")
    for step, grads in run.grads.items():
        assert read["grad_norm/global"][step] == pytest.approx(as_float32(global_grad_norm(grads)), rel=1e-6)
        for name, grad in grads.items():
            assert read[f"grad_norm/{name}"][step] == pytest.approx(as_float32(parameter_norm(grad)), rel=1e-6)
    write_tensorboard(run.path, tmp_path / "only_forward", phases=["forward"])
    assert not [tag for tag in scalars(tmp_path / "only_forward" / "rank_0") if tag.startswith("grad_norm/")]
    write_tensorboard(run.path, tmp_path / "head", modules=["head"])
    read = scalars(tmp_path / "head" / "rank_0")  # the global norm stays the whole model's
    assert {tag for tag in read if tag.startswith("grad_norm/")} == {"grad_norm/global", "grad_norm/head.weight",
                                                                      "grad_norm/head.bias"}
    assert read["grad_norm/global"][0] == pytest.approx(as_float32(global_grad_norm(run.grads[0])), rel=1e-6)


def test_live_tensorboard_writes_the_same_grad_norms(run, tmp_path):
    with LiveTensorBoard(tmp_path / "live") as live:
        train_dump(tmp_path / "again", nan_grad=NAN_AT, on_step_written=live)  # the same run, live
    assert live.steps == len(run.grads)
    write_tensorboard(run.path, tmp_path / "tb")
    read, written = scalars(tmp_path / "live" / "rank_0"), scalars(tmp_path / "tb" / "rank_0")
    tags = {tag for tag in written if tag.startswith("grad_norm/")}
    assert len(tags) == 7 and {tag: read[tag] for tag in tags} == {tag: written[tag] for tag in tags}


def test_show_names_the_rank_when_the_records_span_ranks(tmp_path, capsys):
    runs = [train_dump(tmp_path / "run", steps=2, rank=rank, clip=None if rank == 0 else 0.05) for rank in (0, 1)]
    assert main(["show", str(tmp_path / "run")]) == 0
    found = {(int(rank), int(step)): float(value) for rank, step, value in
             re.findall(r"^global grad norm rank (\d) step (\d+): (\S+)$", capsys.readouterr().out, re.MULTILINE)}
    assert sorted(found) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, run in enumerate(runs):
        for step, grads in run.grads.items():
            assert found[(rank, step)] == pytest.approx(global_grad_norm(grads), rel=1e-5)
    assert found[(1, 0)] == pytest.approx(0.05, rel=1e-5)
