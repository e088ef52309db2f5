"""In-place ops after a probe (a model's ``h += 1`` on a module output, a training loop's ``loss *= scale``) and
``transformers.Trainer``: probes change neither the values nor whether training runs, on every backend."""

from __future__ import annotations

import os

import pytest
import torch

from probes import StatisticsSubscriber, SubscriberManager, load_dump

LANE = os.environ.get("PROBES_LANE", "unknown")


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class _InPlace(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Inner(), _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h += 1  # in place on a probed module output
        h.mul_(2)
        y = self.b(h)
        return (y * y).mean()


def _run(backend: str, out=None) -> list[tuple[float, torch.Tensor]]:
    torch.manual_seed(0)
    model = _InPlace()
    manager = None
    if out is not None:
        manager = SubscriberManager()
        manager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True)])
    runner = model
    if backend == "compile":
        runner = torch.compile(model, backend="aot_eager", fullgraph=True)
    elif backend == "ort":
        from onnxruntime.training.ortmodule import ORTModule

        runner = ORTModule(model)
    results = []
    try:
        for step in range(2):
            loss = runner(torch.randn(3, 4, generator=torch.Generator().manual_seed(step)))
            loss *= 3.0  # the training loop scales the probed root output in place
            loss.backward()
            results.append((loss.item(), model.a.linear.weight.grad.clone()))
            model.zero_grad()
    finally:
        if manager is not None:
            manager.unsubscribe()
    return results


BACKENDS = ["eager", pytest.param("ort", marks=pytest.mark.ort), "compile"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_ops_after_probes_train_as_without_probes(backend, tmp_path):
    plain = _run(backend)
    probed = _run(backend, tmp_path / "out")
    for (loss, grad), (probed_loss, probed_grad) in zip(plain, probed):
        assert probed_loss == loss
        assert torch.equal(probed_grad, grad)
    names = {(r["phase"], r["name"]) for r in load_dump(tmp_path / "out")}
    for module in ("<root>", "a", "a.linear", "b", "b.linear"):
        assert ("forward", f"{module}.output.0") in names and ("backward", f"{module}.output.0") in names


@pytest.mark.slow
def test_hugging_face_trainer_trains_with_probes(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from zoo import ARCHITECTURES

    arch = ARCHITECTURES["gpt2"]
    data = [{key: value[0] for key, value in arch.batch(step).items()} for step in range(8)]

    def losses(probes: bool) -> list[float]:
        model = arch.build(seed=0)
        manager = SubscriberManager()
        if probes:
            manager.subscribe(model, [StatisticsSubscriber(tmp_path / "dump", override_output_dir=True)])
        args = transformers.TrainingArguments(output_dir=str(tmp_path / f"trainer-{probes}"), max_steps=3,
                                              per_device_train_batch_size=2, learning_rate=0.05, report_to=[],
                                              logging_steps=1, save_strategy="no", use_cpu=True, seed=0,
                                              dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        manager.unsubscribe()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    plain = losses(False)
    probed = losses(True)
    assert probed == plain and len(plain) == 3
    assert {r["step"] for r in load_dump(tmp_path / "dump")} == {0, 1, 2}
