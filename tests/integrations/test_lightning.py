"""The Lightning callback, on the real Lightning Trainer: one process and DDP with two gloo ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from lightning_run import Regressor, loader, trainer  # noqa: E402
from probes import AnomalyError, ConfigError, load_dump  # noqa: E402
from probes.compare import compare_dumps  # noqa: E402
from probes.dump.trainer_steps import read_trainer_steps  # noqa: E402
from probes.integrations.lightning import ProbesCallback  # noqa: E402
from trainers import plain_loop  # noqa: E402

HERE = Path(__file__).resolve().parent


def training_loss(module, batch):
    return module.training_step(batch, 0)


def mapping(out: Path, rank: int = 0) -> list[tuple[int, int | None, int]]:
    return [(m.step, m.trainer_step, m.micro_step) for m in read_trainer_steps(out)[rank].values()]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_records_what_a_plain_loop_records(tmp_path, accumulate):
    module = Regressor()
    callback = ProbesCallback(tmp_path / "lightning")
    trainer(callback, max_steps=3, accumulate_grad_batches=accumulate).fit(module, loader(48))
    assert callback.manager.step == 3 * accumulate and not callback.subscribers
    reference = Regressor()
    batches = list(loader(48))[:3 * accumulate]
    plain_loop(reference, tmp_path / "plain", batches, loss_of=training_loss, accumulate=accumulate, lr=1e-2)

    report = compare_dumps(tmp_path / "lightning", tmp_path / "plain")
    assert report.agrees, report.first_divergence
    assert not report.only_in_base and not report.only_in_other
    assert {r["step"] for r in load_dump(tmp_path / "lightning")} == set(range(3 * accumulate))
    for trained, by_hand in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(trained, by_hand, rtol=1e-5, atol=1e-6)
    assert mapping(tmp_path / "lightning") == [(step, step // accumulate + 1, step % accumulate)
                                               for step in range(3 * accumulate)]


def test_parameter_records_inside_lightnings_optimizer_closure_are_the_plain_loops(tmp_path):
    # Lightning runs forward and backward inside optimizer.step(closure): the update still belongs to that step.
    options = dict(parameters=True, optimizer_state=True)
    module = Regressor()
    callback = ProbesCallback(tmp_path / "lightning", **options)
    trainer(callback, max_steps=2, accumulate_grad_batches=2).fit(module, loader(48))
    reference = Regressor()
    plain_loop(reference, tmp_path / "plain", list(loader(48))[:4], loss_of=training_loss, accumulate=2, lr=1e-2,
               **options)
    report = compare_dumps(tmp_path / "lightning", tmp_path / "plain")
    assert report.agrees, report.first_divergence
    assert not report.only_in_base and not report.only_in_other
    records = load_dump(tmp_path / "lightning")
    assert {r["step"] for r in records if r["phase"] == "param"} == {1, 3}
    final = {r["name"]: r for r in records if r["phase"] == "param" and r["step"] == 3}
    assert set(final) == {name for name, _ in module.named_parameters()}
    for name, parameter in module.named_parameters():
        assert final[name]["max"] == pytest.approx(parameter.detach().double().max().item(), rel=1e-12, abs=1e-15)


def test_sanity_checks_and_validation_are_neither_recorded_nor_counted(tmp_path):
    module = Regressor()
    callback = ProbesCallback(tmp_path / "lightning")
    trainer(callback, max_steps=4, num_sanity_val_steps=2, limit_val_batches=2, val_check_interval=1).fit(
        module, loader(48), loader(8, seed=1))
    assert module.validated == 2 + 4 * 2  # the sanity check, then validation after every batch
    assert callback.manager.step == 4
    records = load_dump(tmp_path / "lightning")
    assert {r["step"] for r in records} == {0, 1, 2, 3}
    names = {(r["step"], r["phase"], r["name"]) for r in records}
    assert len(names) == len(records) == 4 * 2 * 4  # 4 modules (net, its 3 layers), both phases, no extra


def test_an_exception_in_training_ends_the_subscription_and_leaves_the_dump_readable(tmp_path):
    module = Regressor()
    calls = [0]

    def nan_from_the_third_batch(layer, args, output):
        calls[0] += layer.training
        return output * float("nan") if calls[0] > 2 else output

    module.net[2].register_forward_hook(nan_from_the_third_batch)
    callback = ProbesCallback(tmp_path / "lightning", on_anomaly="raise")
    with pytest.raises(AnomalyError) as raised:
        trainer(callback, max_steps=5).fit(module, loader(48))
    assert (raised.value.anomaly.step, raised.value.anomaly.module) == (2, "net.2")
    assert not callback.subscribers  # on_exception ended it
    assert {r["step"] for r in load_dump(tmp_path / "lightning", include_partial=True)} == {0, 1, 2}
    assert mapping(tmp_path / "lightning") == [(0, 1, 0), (1, 2, 0), (2, None, 0)]


def test_a_bad_config_fails_when_the_callback_is_made(tmp_path):
    bad = tmp_path / "probes.yaml"
    bad.write_text("statistics:\n  output_dir: out\n  phases: [forward, sideways]\n")
    with pytest.raises(ConfigError, match=r"probes\.yaml: statistics: .*sideways"):
        ProbesCallback(config=bad)


def test_the_callback_pickles_for_spawn_strategies(tmp_path):
    import pickle

    callback = ProbesCallback(tmp_path / "out", every_n_steps=2)
    assert pickle.loads(pickle.dumps(callback)).manager is None


@pytest.mark.slow
def test_ddp_with_two_gloo_ranks_records_each_rank(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    run = subprocess.run([sys.executable, str(HERE / "lightning_run.py"), str(tmp_path / "ddp"), "ddp", "2"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    weights = dict(re.findall(r"rank (\d) weights ([-+]?[0-9.]+e[-+][0-9]+)", run.stdout))
    assert set(weights) == {"0", "1"} and weights["0"] == weights["1"]  # DDP kept the ranks in step
    records = load_dump(tmp_path / "ddp")
    for rank in (0, 1):
        mine = [r for r in records if r["rank"] == rank]
        assert {r["step"] for r in mine} == set(range(6))
        assert mapping(tmp_path / "ddp", rank) == [(step, step // 2 + 1, step % 2) for step in range(6)]
    by_rank = [{(r["step"], r["phase"], r["name"]) for r in records if r["rank"] == rank} for rank in (0, 1)]
    assert by_rank[0] == by_rank[1]
    # The ranks saw different batches (a distributed sampler): their forward statistics differ.
    first = {r["rank"]: r["mean"] for r in records if (r["step"], r["phase"], r["name"]) == (0, "forward", "net.0.output.0")}
    assert first[0] != first[1]
