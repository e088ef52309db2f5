"""Real training set-ups: activation checkpointing, offloading, accumulation, repeated and higher-order
backward, and the end of a step. Each case trains with and without the feature and compares the runs.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from helpers import Recorder, tiny_gpt2, gpt2_batch
from probes import StatisticsSubscriber, SubscriberManager, load_dump
from probes.compare import compare_dumps
from probes.dump.reader import list_steps


class Block(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.act = torch.nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class Net(torch.nn.Module):
    """Blocks, optionally each run under ``checkpoint(..., use_reentrant=mode)``; loss inside."""

    def __init__(self, blocks: int = 3, checkpointed: bool | None = None) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(8, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointed is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointed)
        return self.head(x).square().mean()


def _batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=generator, requires_grad=True)


def _keys(recorder: Recorder) -> list[tuple[int, str, str]]:
    return sorted((call.step, call.phase, call.name) for call in recorder.calls)


def _train(model: torch.nn.Module, steps: int, step_fn=None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = step_fn(model, step) if step_fn else model(_batch(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


# Activation checkpointing --------------------------------------------------------------------

CHECKPOINT_MODES = {
    "reentrant": lambda: Net(checkpointed=True),
    "non-reentrant": lambda: Net(checkpointed=False),
}


@pytest.mark.parametrize("mode", sorted(CHECKPOINT_MODES))
def test_checkpointed_run_has_the_same_records_steps_and_numbers_as_a_plain_one(tmp_path, mode):
    torch.manual_seed(0)
    plain = Net()
    checkpointed = CHECKPOINT_MODES[mode]()
    checkpointed.load_state_dict(plain.state_dict())
    reference = copy.deepcopy(plain)
    runs = {}
    for label, model in (("plain", plain), ("checkpointed", checkpointed)):
        recorder = Recorder()
        with SubscriberManager().subscribe(model, [recorder, StatisticsSubscriber(tmp_path / label)]) as handle:
            losses = _train(model, 3)
            assert handle.manager.step == 3
        runs[label] = (recorder, losses, _grads(model))
    assert runs["checkpointed"][0].step_ends == [0, 1, 2]
    assert _keys(runs["checkpointed"][0]) == _keys(runs["plain"][0])
    assert not any(call.phase == "recompute" for call in runs["checkpointed"][0].calls)
    assert not any("#" in call.name for call in runs["checkpointed"][0].calls), "a recomputation counted as a call"
    report = compare_dumps(tmp_path / "plain", tmp_path / "checkpointed")
    assert report.agrees and report.matched == len(load_dump(tmp_path / "plain")) > 0
    # An observer: the same losses and gradients as the model trained without probes.
    assert runs["checkpointed"][1] == _train(reference, 3)
    for name, grad in _grads(reference).items():
        torch.testing.assert_close(runs["checkpointed"][2][name], grad, rtol=0, atol=0)


def test_checkpoint_sequential_records_like_the_plain_sequential(tmp_path):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*(Block() for _ in range(4)))
    chunked = copy.deepcopy(plain)

    def step_plain(model, step):
        return model(_batch(step)).square().mean()

    def step_chunked(model, step):  # the Sequential's own forward never runs: only its children's
        return checkpoint_sequential(model, 2, _batch(step), use_reentrant=True).square().mean()

    recorders = {}
    for label, model, step_fn in (("plain", plain, step_plain), ("chunked", chunked, step_chunked)):
        recorder = recorders[label] = Recorder()
        with SubscriberManager().subscribe(model, [recorder, StatisticsSubscriber(tmp_path / label)]):
            _train(model, 2, step_fn)
    chunked_keys = _keys(recorders["chunked"])
    assert recorders["chunked"].step_ends == [0, 1]
    assert chunked_keys == [key for key in _keys(recorders["plain"]) if not key[2].startswith("<root>")]
    report = compare_dumps(tmp_path / "plain", tmp_path / "chunked")
    assert report.matched == len(chunked_keys) and not report.divergences
    assert all(key[3].startswith("<root>") for key in report.only_in_base)


def test_recomputation_is_recorded_under_its_own_phase_only_on_request():
    torch.manual_seed(0)
    model = Net(checkpointed=True)
    recorder = Recorder()
    recorder.observe_recompute = True
    with SubscriberManager().subscribe(model, [recorder]):
        _train(model, 2)
    recomputed = {(call.step, call.name) for call in recorder.calls if call.phase == "recompute"}
    expected = {(step, f"blocks.{i}{part}.output.0") for step in range(2) for i in range(3)
                for part in ("", ".fc", ".act")}
    assert recomputed == expected
    forward = {(call.step, call.name) for call in recorder.calls if call.phase == "forward"}
    assert expected <= forward and recorder.step_ends == [0, 1]


def test_hugging_face_gradient_checkpointing_compares_clean_with_the_plain_model(tmp_path):
    plain = tiny_gpt2()
    checkpointed = tiny_gpt2()
    checkpointed.gradient_checkpointing_enable()
    assert checkpointed.is_gradient_checkpointing

    def step_fn(model, step):
        return model(**gpt2_batch(step)).loss

    recorders = {}
    for label, model in (("plain", plain), ("checkpointed", checkpointed)):
        model.train()
        recorder = recorders[label] = Recorder()
        with SubscriberManager().subscribe(model, [recorder, StatisticsSubscriber(tmp_path / label)]):
            _train(model, 2, step_fn)
    assert recorders["checkpointed"].step_ends == [0, 1]
    assert _keys(recorders["checkpointed"]) == _keys(recorders["plain"])
    report = compare_dumps(tmp_path / "plain", tmp_path / "checkpointed")
    assert report.agrees and report.matched > 100


def test_activation_offloading_does_not_change_records(tmp_path):
    torch.manual_seed(0)
    plain = Net()
    offloaded = copy.deepcopy(plain)

    def step_offloaded(model, step):
        with torch.autograd.graph.save_on_cpu():
            return model(_batch(step))

    for label, model, step_fn in (("plain", plain, None), ("offloaded", offloaded, step_offloaded)):
        with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / label)]):
            _train(model, 2, step_fn)
    report = compare_dumps(tmp_path / "plain", tmp_path / "offloaded")
    assert report.agrees and report.matched == len(load_dump(tmp_path / "plain"))


# When a step closes, and how repeated backward passes are numbered ---------------------------

def test_each_step_is_on_disk_when_its_backward_returns(tmp_path):
    torch.manual_seed(0)
    model = Net()
    SubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "dump", override_output_dir=True)])
    try:
        for step in range(3):
            model(_batch(step)).backward()
            assert list_steps(tmp_path / "dump")[0]["finished"] == list(range(step + 1))
            assert {record["step"] for record in load_dump(tmp_path / "dump")} == set(range(step + 1))
    finally:
        SubscriberManager.unsubscribe()


def test_forward_only_steps_close_at_the_next_forward_or_on_flush():
    model = Net()
    recorder = Recorder()
    manager = SubscriberManager()
    with manager.subscribe(model, [recorder]), torch.no_grad():
        model(_batch(0))
        assert recorder.step_ends == []
        model(_batch(1))
        assert recorder.step_ends == [0]
        manager.flush()
        assert recorder.step_ends == [0, 1]


def _assert_unique(recorder: Recorder) -> None:
    keys = [(call.step, call.phase, call.name) for call in recorder.calls]
    assert len(keys) == len(set(keys)), "two records of one step share (step, phase, name)"


def test_gradient_accumulation_gives_one_step_per_micro_batch():
    model = Net()
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder]) as handle:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for micro in range(4):
            (model(_batch(micro)) / 4).backward()
        optimizer.step()
        assert handle.manager.step == 4
    assert recorder.step_ends == [0, 1, 2, 3]
    _assert_unique(recorder)
    assert {call.step for call in recorder.calls if call.phase == "backward"} == {0, 1, 2, 3}


def test_a_second_backward_with_retain_graph_is_a_backward_only_step():
    model = Net()
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder]):
        loss = model(_batch(0))
        loss.backward(retain_graph=True)
        assert recorder.step_ends == [0]
        loss.backward()
        assert recorder.step_ends == [0, 1]
        model(_batch(1)).backward()
    _assert_unique(recorder)
    assert {call.phase for call in recorder.calls if call.step == 1} == {"backward"}
    assert recorder.names(1, "backward") == recorder.names(0, "backward")
    assert recorder.names(2, "forward") == recorder.names(0, "forward")


def test_autograd_grad_closes_the_step_like_backward():
    model = Net()
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder]):
        torch.autograd.grad(model(_batch(0)), list(model.parameters()))
        assert recorder.step_ends == [0]
    assert recorder.names(0, "backward")


def test_double_backward_numbers_the_second_order_pass_as_its_own_step():
    model = Net()
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder]):
        x = _batch(0)
        (grad_x,) = torch.autograd.grad(model(x), x, create_graph=True)
        assert recorder.step_ends == [0]
        grad_x.square().sum().backward()  # a gradient penalty: differentiates through the first backward
    _assert_unique(recorder)
    assert recorder.step_ends == [0, 1]
    assert recorder.names(1, "backward") and not recorder.names(1, "forward")


def test_backward_inside_forward_does_not_close_the_step():
    class GradientInForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Net()

        def forward(self, x):
            (grad,) = torch.autograd.grad(self.inner(x), x, create_graph=True)
            return grad.square().mean()

    model = GradientInForward()
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder]):
        model(_batch(0)).backward()
        assert recorder.step_ends == [0]
    _assert_unique(recorder)
    assert {call.step for call in recorder.calls} == {0}
    assert "inner.output.0" in recorder.names(0, "forward")


# Under ORTModule -----------------------------------------------------------------------------

def _ortmodule(model: torch.nn.Module) -> torch.nn.Module:
    from onnxruntime.training.ortmodule import ORTModule

    return ORTModule(model)


@pytest.mark.ort
@pytest.mark.slow
def test_ortmodule_steps_are_on_disk_when_backward_returns_and_made_by_ort(tmp_path):
    from helpers import called_by_ort_runtime

    torch.manual_seed(0)
    model = Net()
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder, StatisticsSubscriber(tmp_path / "ort")]):
        runner = _ortmodule(model)
        for step in range(3):
            runner(_batch(step)).backward()
            assert recorder.step_ends == list(range(step + 1))
            assert list_steps(tmp_path / "ort")[0]["finished"] == list(range(step + 1))
    assert recorder.calls and all(call.by_ort for call in recorder.calls)
    assert not called_by_ort_runtime()


@pytest.mark.ort
@pytest.mark.slow
def test_ortmodule_with_non_reentrant_checkpointing_records_like_eager(tmp_path):
    # A reentrant checkpoint (CheckpointFunction) does not export to ORT at all, with or without probes.
    torch.manual_seed(0)
    eager = Net()
    ort_inner = Net(checkpointed=False)
    ort_inner.load_state_dict(eager.state_dict())
    recorders = {}
    for label, model, wrap in (("eager", eager, None), ("ort", ort_inner, _ortmodule)):
        recorder = recorders[label] = Recorder()
        with SubscriberManager().subscribe(model, [recorder, StatisticsSubscriber(tmp_path / label)]):
            _train(wrap(model) if wrap else model, 2)
    assert recorders["ort"].step_ends == [0, 1]
    assert all(call.by_ort for call in recorders["ort"].calls)
    assert _keys(recorders["ort"]) == _keys(recorders["eager"])
    report = compare_dumps(tmp_path / "eager", tmp_path / "ort")
    assert report.agrees and report.matched == len(recorders["eager"].calls)
