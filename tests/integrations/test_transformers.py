"""The Hugging Face Trainer callback, on the real Trainer: what it records, how its steps map, what stops it."""

from __future__ import annotations

import json
import math
import re
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers import tiny_gpt2  # noqa: E402
from probes import AnomalyError, ConfigError, load_dump  # noqa: E402
from probes.compare import compare_dumps  # noqa: E402
from probes.core.steps import StepTracker  # noqa: E402
from probes.dump.trainer_steps import read_trainer_steps  # noqa: E402
from probes.integrations.transformers import ProbesCallback  # noqa: E402
from trainers import batches, examples, plain_loop  # noqa: E402

LR = 1e-3


class InOrderTrainer(transformers.Trainer):
    """The Trainer, reading its dataset in order (so a plain loop can feed the same batches), with the loss
    of a plain loop: each micro-batch's mean, divided by the accumulation. (The Trainer's own convention
    for that division differs between transformers 4.46 and 5.x; this one holds in both.)"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = False  # no token-count normalisation across micro-batches
        self.loss_is_scaled_for_ga = True  # 5.x: compute_loss below divides; 4.46 never does

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        outputs = model(**inputs)
        loss = outputs.loss / self.args.gradient_accumulation_steps if model.training else outputs.loss
        return (loss, outputs) if return_outputs else loss


def trainer_args(tmp_path: Path, **overrides) -> "transformers.TrainingArguments":
    options = dict(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, learning_rate=LR,
                   lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to=[],
                   save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                   dataloader_num_workers=0, optim="adamw_torch")  # the plain loop's AdamW (5.x: fused by default)
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def train(tmp_path: Path, callback, *, steps: int = 3, model=None, trainer_class=InOrderTrainer, **overrides):
    model = tiny_gpt2() if model is None else model
    accumulate = overrides.get("gradient_accumulation_steps", 1)
    args = trainer_args(tmp_path, max_steps=steps, **overrides)
    trainer = trainer_class(model=model, args=args, train_dataset=examples(2 * steps * accumulate),
                            eval_dataset=examples(4, seed=1), callbacks=[callback])
    trainer.train()
    return trainer


def gpt2_loss(model, batch):
    return model(**batch).loss


def test_the_trainer_records_what_a_plain_loop_records(tmp_path):
    callback = ProbesCallback(tmp_path / "trainer")
    trainer = train(tmp_path, callback, steps=3)
    assert callback.manager.step == 3 and not callback.subscribers  # unsubscribed at train end
    reference = tiny_gpt2()
    plain_loop(reference, tmp_path / "plain", batches(3), loss_of=gpt2_loss, lr=LR)

    report = compare_dumps(tmp_path / "trainer", tmp_path / "plain")
    assert report.agrees, report.first_divergence
    assert not report.only_in_base and not report.only_in_other
    assert {r["step"] for r in load_dump(tmp_path / "trainer")} == {0, 1, 2}
    for trained, by_hand in zip(trainer.model.parameters(), reference.parameters()):  # the same training
        torch.testing.assert_close(trained, by_hand, rtol=1e-5, atol=1e-6)
    mapping = read_trainer_steps(tmp_path / "trainer")[0]
    assert [(m.step, m.trainer_step, m.micro_step) for m in mapping.values()] == [(0, 1, 0), (1, 2, 0), (2, 3, 0)]


def test_gradient_accumulation_gives_a_step_per_micro_batch_and_maps_them_to_updates(tmp_path):
    callback = ProbesCallback(tmp_path / "trainer")
    train(tmp_path, callback, steps=2, gradient_accumulation_steps=2)
    mapping = read_trainer_steps(tmp_path / "trainer")[0]
    assert [(m.step, m.trainer_step, m.micro_step) for m in mapping.values()] == \
        [(0, 1, 0), (1, 1, 1), (2, 2, 0), (3, 2, 1)]
    plain_loop(tiny_gpt2(), tmp_path / "plain", batches(4), loss_of=gpt2_loss, accumulate=2, lr=LR)
    report = compare_dumps(tmp_path / "trainer", tmp_path / "plain")
    assert report.agrees, report.first_divergence
    assert {r["step"] for r in load_dump(tmp_path / "trainer")} == {0, 1, 2, 3}


def test_parameter_records_under_the_trainer_are_the_plain_loops_at_the_micro_steps_that_update(tmp_path):
    options = dict(parameters=True, optimizer_state=True)
    callback = ProbesCallback(tmp_path / "trainer", **options)
    trainer = train(tmp_path, callback, steps=2, gradient_accumulation_steps=2)
    reference = tiny_gpt2()
    plain_loop(reference, tmp_path / "plain", batches(4), loss_of=gpt2_loss, accumulate=2, lr=LR, **options)
    report = compare_dumps(tmp_path / "trainer", tmp_path / "plain")
    assert report.agrees, report.first_divergence
    assert not report.only_in_base and not report.only_in_other
    records = load_dump(tmp_path / "trainer")
    assert {r["step"] for r in records if r["phase"] == "param"} == {1, 3}  # the micro-steps whose update ran
    assert {r["step"] for r in records if r["phase"] == "optim"} == {1, 3}
    final = {r["name"]: r for r in records if r["phase"] == "param" and r["step"] == 3}
    for name, parameter in trainer.model.named_parameters():
        if name in final:  # the tied lm_head.weight is transformer.wte.weight's record
            assert final[name]["mean"] == pytest.approx(parameter.detach().double().mean().item(), rel=1e-12, abs=1e-15)
    assert "lm_head.weight" not in final and "transformer.wte.weight" in final


def test_evaluation_forwards_are_neither_recorded_nor_counted(tmp_path):
    evaluated = []

    class Evaluated(transformers.TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            evaluated.append(state.global_step)

    callback = ProbesCallback(tmp_path / "trainer")
    model = tiny_gpt2()
    args = trainer_args(tmp_path, max_steps=3, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2)
    trainer = InOrderTrainer(model=model, args=args, train_dataset=examples(6), eval_dataset=examples(4, seed=1),
                             callbacks=[callback, Evaluated()])
    trainer.train()
    assert evaluated == [1, 2, 3]  # evaluation ran after each step ...
    assert callback.manager.step == 3  # ... and added no step
    records = load_dump(tmp_path / "trainer")
    assert {r["step"] for r in records} == {0, 1, 2}
    assert {r["phase"] for r in records} == {"forward", "backward"}
    for step in range(3):  # every recorded forward has its backward: no evaluation forward slipped in
        forward = {r["name"] for r in records if r["step"] == step and r["phase"] == "forward"}
        assert len(forward) == len({r["name"] for r in records if r["step"] == 0 and r["phase"] == "forward"})


def test_options_select_as_the_subscriber_does(tmp_path):
    callback = ProbesCallback(tmp_path / "trainer", every_n_steps=2, modules="transformer.h.*.mlp",
                              phases="forward")
    train(tmp_path, callback, steps=4)
    records = load_dump(tmp_path / "trainer")
    assert {r["step"] for r in records} == {0, 2}
    assert {r["module"] for r in records} == {"transformer.h.0.mlp", "transformer.h.1.mlp"}
    assert {r["phase"] for r in records} == {"forward"}


def nan_from(module: torch.nn.Module, *, call: int):
    """A forward hook that makes ``module``'s output nan from its ``call``-th training call on (0-based)."""
    calls = [0]

    def hook(module, args, output):
        if not module.training:
            return output
        calls[0] += 1
        return output * float("nan") if calls[0] > call else output

    return module.register_forward_hook(hook)


def test_a_nan_stops_the_trainer_with_our_error_and_leaves_a_readable_dump(tmp_path):
    model = tiny_gpt2()
    nan_from(model.transformer.h[1].mlp, call=2)
    callback = ProbesCallback(tmp_path / "trainer", on_anomaly="raise")
    with pytest.raises(AnomalyError) as raised:
        train(tmp_path, callback, steps=5, model=model)
    # The Trainer calls no callback when train() raises: the subscription lasts until the next train(), or
    # until it is ended by hand (docs/transformers.md).
    assert callback.manager.subscribers
    callback.manager.unsubscribe()
    anomaly = raised.value.anomaly
    assert (anomaly.step, anomaly.phase, anomaly.module) == (2, "forward", "transformer.h.1.mlp")
    records = load_dump(tmp_path / "trainer", include_partial=True)
    assert {r["step"] for r in records} == {0, 1, 2}
    assert any(math.isnan(r["mean"] if r["mean"] is not None else math.nan) for r in records if r["step"] == 2)
    shown = subprocess.run([sys.executable, "-m", "probes", "show", str(tmp_path / "trainer"), "--step", "1"],
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr


def test_a_bad_config_fails_when_the_callback_is_made(tmp_path, monkeypatch):
    bad = tmp_path / "probes.yaml"
    bad.write_text("statistics:\n  output_dir: out\n  every_n_step: 5\n")
    with pytest.raises(ConfigError, match=r"probes\.yaml: statistics\.every_n_step: unknown option.*'every_n_steps'"):
        ProbesCallback(config=bad)
    monkeypatch.setenv("PROBES_CONFIG", str(bad))
    with pytest.raises(ConfigError, match="every_n_step"):
        ProbesCallback()
    with pytest.raises(ConfigError, match=r"ProbesCallback: every_n_step: unknown option"):
        ProbesCallback(tmp_path / "out", every_n_step=5)
    with pytest.raises(ConfigError, match="either config= or the options"):
        ProbesCallback(tmp_path / "out", config=bad)
    assert not (tmp_path / "out").exists()


def test_probes_config_switches_recording_without_touching_the_script(tmp_path, monkeypatch):
    config = tmp_path / "probes.json"
    config.write_text(json.dumps({"statistics": {"output_dir": str(tmp_path / "narrow"), "phases": "backward",
                                                 "modules": ["lm_head"]}}))
    monkeypatch.setenv("PROBES_CONFIG", str(config))
    train(tmp_path, ProbesCallback(), steps=2)
    records = load_dump(tmp_path / "narrow")
    assert {(r["module"], r["phase"]) for r in records} == {("lm_head", "backward")}

    config.write_text(json.dumps({"enabled": False, "statistics": {"output_dir": str(tmp_path / "off")}}))
    callback = ProbesCallback()
    train(tmp_path, callback, steps=2)
    assert callback.manager is None and not (tmp_path / "off").exists()

    monkeypatch.delenv("PROBES_CONFIG")
    with pytest.warns(UserWarning, match="PROBES_CONFIG is not set: nothing is recorded"):
        train(tmp_path, ProbesCallback(), steps=1)


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5),
                    reason="torch 2.4's compile of Hugging Face models fails without probes (docs/support.md)")
def test_torch_compile_records_what_eager_records(tmp_path, monkeypatch):
    eager = ProbesCallback(tmp_path / "eager")
    train(tmp_path, eager, steps=2)
    torch._dynamo.reset()
    from_graph = []  # the probe calls made by the custom op inside the compiled graph (never by eager code)
    compiled_forward = StepTracker.compiled_forward
    monkeypatch.setattr(StepTracker, "compiled_forward",
                        lambda self, *args, **kwargs: (from_graph.append(1), compiled_forward(self, *args, **kwargs))[1])
    compiled = ProbesCallback(tmp_path / "compiled")
    train(tmp_path, compiled, steps=2, torch_compile=True)
    forward_records = [r for r in load_dump(tmp_path / "compiled") if r["phase"] == "forward"]
    assert forward_records and len(from_graph) == len({(r["step"], r["name"].rsplit(".", 1)[0])
                                                        for r in forward_records})
    report = compare_dumps(tmp_path / "eager", tmp_path / "compiled")
    assert report.agrees, report.first_divergence
    assert not report.only_in_base and not report.only_in_other
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "deepspeed"])
def test_two_ranks_under_ddp_or_deepspeed_zero3_record_each_rank(tmp_path, backend):
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), *sys.path]),
           "OMP_NUM_THREADS": "1"}

    def launch() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--standalone", str(here / "hf_run.py"),  # a free port: the lanes' suites run at once
                               str(tmp_path / "out"), *(["deepspeed"] if backend == "deepspeed" else [])],
                              capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)

    run = launch()
    if (run.returncode != 0 and "terminate called without an active exception" in run.stderr
            and len(re.findall(r"rank \d of 2 wrapped", run.stdout)) == 2):
        # Both ranks trained and said so, then one aborted in the interpreter's shutdown: seen twice in about ten
        # loaded suites on the modern lane (DeepSpeed + gloo), never alone. Said, and run once more from nothing.
        warnings.warn(f"a rank aborted after training (exit teardown), run again: {run.stderr[-300:]}")
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        run = launch()
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-3000:]
    ranks = re.findall(r"rank (\d) of 2 wrapped (\w+) weights ([-+]?[0-9.]+e[-+][0-9]+)", run.stdout)
    assert sorted(rank for rank, _, _ in ranks) == ["0", "1"], run.stdout
    assert {wrapped for _, wrapped, _ in ranks} == {"DeepSpeedEngine" if backend == "deepspeed"
                                                     else "DistributedDataParallel"}
    assert len({weights for _, _, weights in ranks}) == 1  # the ranks stayed in step
    accumulate = 1 if backend == "deepspeed" else 2  # see hf_run.py
    expected = [(step, step // accumulate + 1, step % accumulate) for step in range(2 * accumulate)]
    records = load_dump(tmp_path / "out")
    for rank in (0, 1):
        assert {r["step"] for r in records if r["rank"] == rank} == set(range(2 * accumulate))
        mapping = read_trainer_steps(tmp_path / "out")[rank]
        assert [(m.step, m.trainer_step, m.micro_step) for m in mapping.values()] == expected
    names = [{(r["step"], r["phase"], r["name"]) for r in records if r["rank"] == rank} for rank in (0, 1)]
    assert names[0] == names[1] and (0, "forward", "transformer.h.0.mlp.output.0") in names[0]


@pytest.mark.ort
@pytest.mark.slow
def test_a_model_in_ortmodule_records_what_eager_records(tmp_path, monkeypatch):
    from onnxruntime.training.ortmodule import ORTModule

    from helpers import called_by_ort_runtime

    train(tmp_path, ProbesCallback(tmp_path / "eager"), steps=2)
    callers = []  # per probe call: whether ORT's runtime made it
    probe_forward = StepTracker.probe_forward
    monkeypatch.setattr(StepTracker, "probe_forward",
                        lambda self, *args: (callers.append(called_by_ort_runtime()), probe_forward(self, *args))[1])
    train(tmp_path, ProbesCallback(tmp_path / "ort"), steps=2, model=ORTModule(tiny_gpt2()))
    assert callers and all(callers)
    report = compare_dumps(tmp_path / "eager", tmp_path / "ort")
    assert report.agrees, report.first_divergence


def test_a_calibration_run_is_the_trainer_inside_perturbed_rounding(tmp_path):
    """The noise floor's calibration run with a Trainer: ``trainer.train()`` inside ``perturbed_rounding``, no model or
    loop change (docs/compare.md, Noise floor); it differs from the base by rounding only, and nothing of it leaks
    into a run made afterwards."""
    from probes.testing import perturbed_rounding

    train(tmp_path / "a", ProbesCallback(tmp_path / "base"))
    with perturbed_rounding(seed=1) as noise:
        train(tmp_path / "b", ProbesCallback(tmp_path / "noise"))
    train(tmp_path / "c", ProbesCallback(tmp_path / "rerun"))
    assert noise.perturbed > 100
    assert compare_dumps(tmp_path / "base", tmp_path / "rerun", rtol=0.0, atol=0.0).agrees  # bit-identical
    tight = compare_dumps(tmp_path / "base", tmp_path / "noise", rtol=1e-9, atol=0.0)
    assert tight.diverged_count > 0.5 * tight.matched and not tight.only_in_base and not tight.only_in_other
    assert compare_dumps(tmp_path / "base", tmp_path / "noise", rtol=1e-3, atol=1e-6).agrees  # rounding, nothing more
    report = compare_dumps(tmp_path / "base", tmp_path / "rerun", noise=tmp_path / "noise")
    assert report.noise_floor.silent < 0.1 * report.matched
