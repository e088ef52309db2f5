"""Parameter, gradient and optimizer-state records (``StatisticsSubscriber(parameters=True, optimizer_state=True)``).

Every number is checked against numpy float64 statistics of the tensors the test reads itself: the gradients
just before ``optimizer.step()``, the parameters and ``optimizer.state`` just after it.
"""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from helpers import Recorder, gpt2_batch, tiny_gpt2
from probes import ProbeFailureWarning, StatisticsSubscriber, SubscriberManager, load_dump
from probes.compare import compare_dumps
from probes.dump import DumpReader
from probes.stats import UnsupportedTensorWarning
from probes.utils.phases import phase_rank

OLD_DYNAMO = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 5)  # torch 2.4.1, the ort lane


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class Model(nn.Module):
    """Nested blocks, a head and a parameter of the root itself (``scale``); the loss inside."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(6, 1)
        self.scale = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (self.head(x) * self.scale).pow(2).mean()


NAMES = ["scale", "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.fc.weight", "blocks.1.fc.bias", "head.weight",
         "head.bias"]  # model order, as named_parameters() gives it: the root's own first
MODULES = {"blocks.0.fc.weight": "blocks.0.fc", "blocks.1.fc.bias": "blocks.1.fc", "head.weight": "head",
           "scale": "<root>"}


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def reference(tensor: torch.Tensor) -> dict:
    """numpy float64 statistics of ``tensor``."""
    values = tensor.detach().double().numpy().ravel()
    return {"numel": values.size, "min": values.min(), "max": values.max(), "mean": values.mean(),
            "std": values.std(ddof=1) if values.size > 1 else None, "norm": np.sqrt((values * values).sum()),
            "zero": int((values == 0).sum())}


def assert_matches(record: dict, tensor: torch.Tensor) -> None:
    expected = reference(tensor)
    assert record["numel"] == expected["numel"] and record["zero"] == expected["zero"], record["name"]
    assert record["shape"] == list(tensor.shape), record["name"]
    for key in ("min", "max", "mean", "std", "norm"):
        if expected[key] is None:
            assert record[key] is None, (record["name"], key)
        else:
            assert record[key] == pytest.approx(expected[key], rel=1e-12, abs=1e-15), (record["name"], key)


def train(out: Path | None, *, optimizer: str | None = "sgd", steps: int = 3, accumulate: int = 1,
          clip: float | None = None, wrap=None, seed: int = 0, param_groups=None, **options) -> dict:
    """Trains ``Model``; returns what the test read itself: gradients before each update, parameters and
    optimizer state after it (by probes step), the losses, the final weights. ``out`` None: no probes."""
    torch.manual_seed(seed)
    model = Model()
    runner = wrap(model) if wrap is not None else model
    groups = param_groups(model) if param_groups is not None else model.parameters()
    opt = {"sgd": lambda: torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01),
           "adam": lambda: torch.optim.Adam(groups, lr=0.01, weight_decay=0.01), None: lambda: None}[optimizer]()
    manager = SubscriberManager()
    if out is not None:
        manager.subscribe(runner, [StatisticsSubscriber(out, parameters=True, **options)])
    seen: dict = {"grad": {}, "param": {}, "optim": {}, "end_grad": {}, "losses": []}
    named = dict(model.named_parameters())
    for step in range(steps):
        loss = runner(batch(step)) / accumulate
        loss.backward()
        seen["losses"].append(loss.detach().clone())
        seen["end_grad"][step] = {name: p.grad.clone() for name, p in named.items()}
        if (step + 1) % accumulate:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if opt is None:
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
            continue
        seen["grad"][step] = {name: p.grad.clone() for name, p in named.items()}
        opt.step()
        seen["param"][step] = {name: p.detach().clone() for name, p in named.items()}
        seen["optim"][step] = {f"{name}.{key}": value.clone() for name, p in named.items()
                               for key, value in opt.state[p].items() if isinstance(value, torch.Tensor)}
        opt.zero_grad()
    manager.unsubscribe()
    seen["weights"] = {name: p.detach().clone() for name, p in named.items()}
    return seen


def by_phase(records: list[dict], step: int, phase: str) -> dict[str, dict]:
    return {r["name"]: r for r in records if r["step"] == step and r["phase"] == phase}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_grad_param_and_optim_records_equal_numpy_of_the_tensors_the_optimizer_used_and_made(tmp_path, optimizer):
    seen = train(tmp_path / "out", optimizer=optimizer, optimizer_state=True)
    records = load_dump(tmp_path / "out")
    for step in range(3):
        grads, params, states = (by_phase(records, step, phase) for phase in ("grad", "param", "optim"))
        assert list(grads) == NAMES and list(params) == NAMES
        for name in NAMES:
            assert_matches(grads[name], seen["grad"][step][name])
            assert_matches(params[name], seen["param"][step][name])
        assert list(states) == list(seen["optim"][step])
        keys = {"sgd": {"momentum_buffer"}, "adam": {"step", "exp_avg", "exp_avg_sq"}}[optimizer]
        assert {name.rsplit(".", 1)[1] for name in states} == keys
        for name, record in states.items():
            assert_matches(record, seen["optim"][step][name])
        for name, module in MODULES.items():
            assert grads[name]["module"] == module and grads[name]["kind"] == "parameter"
        assert grads["scale"]["depth"] == 0 and grads["blocks.0.fc.weight"]["depth"] == 3
        # Execution order within the step: forward, backward, grad, param, optim; seq follows it.
        in_step = [r for r in records if r["step"] == step]
        ranks = [phase_rank(r["phase"]) for r in in_step]
        assert ranks == sorted(ranks) and {r["phase"] for r in in_step} == {"forward", "backward", "grad", "param",
                                                                                 "optim"}
        seqs = [r["seq"] for r in in_step]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_gradient_accumulation_records_the_update_at_the_micro_step_the_optimizer_ran(tmp_path):
    seen = train(tmp_path / "out", steps=6, accumulate=2)
    records = load_dump(tmp_path / "out")
    # Before the first update nothing says an optimizer will come: micro-step 0 has the gradient so far.
    assert list(by_phase(records, 0, "grad")) == NAMES and not by_phase(records, 0, "param")
    for name in NAMES:
        assert_matches(by_phase(records, 0, "grad")[name], seen["end_grad"][0][name])
    for step in (1, 3, 5):
        grads, params = by_phase(records, step, "grad"), by_phase(records, step, "param")
        assert list(grads) == NAMES and list(params) == NAMES
        for name in NAMES:
            assert_matches(grads[name], seen["grad"][step][name])  # accumulated over the two micro-steps
            assert_matches(params[name], seen["param"][step][name])
    for step in (2, 4):  # after the first update: no update, no records
        assert not [r for r in records if r["step"] == step and r["kind"] == "parameter"]
        assert by_phase(records, step, "backward")


def test_clipping_before_step_gives_the_clipped_gradients(tmp_path):
    seen = train(tmp_path / "out", clip=0.05)
    records = load_dump(tmp_path / "out")
    for step in range(3):
        unclipped = np.sqrt(sum(float(g.double().pow(2).sum()) for g in seen["end_grad"][step].values()))
        assert unclipped > 0.05  # the clip did change them
        for name in NAMES:
            assert_matches(by_phase(records, step, "grad")[name], seen["grad"][step][name])


def test_without_an_optimizer_gradients_are_recorded_at_the_step_end_and_no_parameters(tmp_path):
    seen = train(tmp_path / "out", optimizer=None, optimizer_state=True)
    records = load_dump(tmp_path / "out")
    for step in range(3):
        grads = by_phase(records, step, "grad")
        assert list(grads) == NAMES
        for name in NAMES:
            assert_matches(grads[name], seen["end_grad"][step][name])
    assert not [r for r in records if r["phase"] in ("param", "optim")]


def test_selection_applies_to_parameters_by_their_module_phase_and_step(tmp_path):
    train(tmp_path / "modules", modules=["blocks.1.*", "head"])
    records = load_dump(tmp_path / "modules")
    assert sorted({r["name"] for r in records if r["phase"] == "param"}) == ["blocks.1.fc.bias", "blocks.1.fc.weight",
                                                                            "head.bias", "head.weight"]
    train(tmp_path / "grad", phases=["grad"], optimizer_state=True)
    records = load_dump(tmp_path / "grad")
    assert {r["phase"] for r in records} == {"grad"} and len(records) == 3 * len(NAMES)
    train(tmp_path / "every", steps=5, every_n_steps=2)
    records = load_dump(tmp_path / "every")
    assert sorted({r["step"] for r in records if r["phase"] == "param"}) == [0, 2, 4]
    assert sorted({r["step"] for r in records}) == [0, 2, 4]


def test_an_optimizer_change_is_found_at_its_step_phase_param_and_first_affected_parameter(tmp_path):
    def groups(weight_decay):
        def make(model):
            rest = [p for name, p in model.named_parameters() if not name.startswith("head.")]
            return [{"params": rest}, {"params": list(model.head.parameters()), "weight_decay": weight_decay}]
        return make

    train(tmp_path / "base", param_groups=groups(0.01))
    train(tmp_path / "other", param_groups=groups(0.02))
    report = compare_dumps(tmp_path / "base", tmp_path / "other", rtol=0, atol=0)
    first = report.first_divergence
    assert (first.step, first.phase, first.name) == (0, "param", "head.weight"), first
    kind = report.first_divergence_kind()
    assert kind.code == "update" and "gradients agree, the update differs" in kind.sentence, kind


def test_hook_failures_warn_give_unsupported_records_and_training_goes_on(tmp_path):
    class Broken(dict):
        def items(self):
            raise RuntimeError("state cannot be listed")

    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    manager = SubscriberManager()
    manager.subscribe(model, [StatisticsSubscriber(tmp_path / "out", parameters=True, optimizer_state=True)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            model(batch(step)).backward()
            optimizer.step()
            optimizer.state[model.head.weight]["odd"] = torch.empty(3, device="meta")  # a tensor without data
            if step == 1:
                optimizer.state[model.head.bias] = Broken(optimizer.state[model.head.bias])  # the last parameter
            optimizer.zero_grad()
    manager.unsubscribe()
    kinds = [type(w.message) for w in caught]
    assert kinds.count(UnsupportedTensorWarning) == 1 and kinds.count(ProbeFailureWarning) == 1
    records = load_dump(tmp_path / "out")
    odd = [r for r in records if r["name"] == "head.weight.odd"]
    assert [r["step"] for r in odd] == [1, 2] and all(r["unsupported"] for r in odd)
    failed = [r for r in records if r["name"] == "<parameters>"]
    assert [(r["step"], r["phase"]) for r in failed] == [(2, "optim")] and "state cannot be listed" in failed[0]["unsupported"]
    assert len(by_phase(records, 2, "param")) == len(NAMES)  # what was recorded before the failure stays
    assert sorted({r["step"] for r in records}) == [0, 1, 2]


def test_probes_with_parameters_leave_losses_gradients_and_weights_bit_identical(tmp_path):
    plain = train(None, optimizer="adam")
    probed = train(tmp_path / "out", optimizer="adam", optimizer_state=True)
    for step in range(3):
        assert torch.equal(plain["losses"][step], probed["losses"][step])
        for name in NAMES:
            assert torch.equal(plain["grad"][step][name], probed["grad"][step][name])
    for name in NAMES:
        assert torch.equal(plain["weights"][name], probed["weights"][name])


def test_a_tiny_gpt2_trains_the_same_with_parameter_records(tmp_path):
    def run(out):
        model = tiny_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        manager = SubscriberManager()
        if out is not None:
            manager.subscribe(model, [StatisticsSubscriber(out, parameters=True, optimizer_state=True)])
        losses = []
        for step in range(2):
            loss = model(**gpt2_batch(step)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        manager.unsubscribe()
        return losses, {name: p.detach().clone() for name, p in model.named_parameters()}

    plain_losses, plain_weights = run(None)
    losses, weights = run(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    assert all(torch.equal(plain_weights[name], weights[name]) for name in plain_weights)
    records = load_dump(tmp_path / "out")
    params = by_phase(records, 1, "param")
    # The tied embedding is one parameter, named as named_parameters() names it.
    assert list(params) == list(plain_weights) and "transformer.wte.weight" in params
    assert_matches(params["transformer.wte.weight"], weights["transformer.wte.weight"])
    assert "transformer.h.0.attn.c_attn.weight.exp_avg_sq" in by_phase(records, 1, "optim")


@pytest.mark.ort
def test_ortmodule_compares_clean_against_eager_with_parameter_records(tmp_path):
    from onnxruntime.training.ortmodule import ORTModule

    assert os.environ["ORTMODULE_FALLBACK_POLICY"] == "FALLBACK_DISABLE"
    eager = train(tmp_path / "eager", optimizer="adam", optimizer_state=True)
    recorder = Recorder()  # proves ORT's graph called the probes
    torch.manual_seed(0)
    model = Model()
    runner = ORTModule(model)
    optimizer = torch.optim.Adam(runner.parameters(), lr=0.01, weight_decay=0.01)
    manager = SubscriberManager()
    manager.subscribe(runner, [recorder, StatisticsSubscriber(tmp_path / "ort", parameters=True, optimizer_state=True)])
    for step in range(3):
        runner(batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    manager.unsubscribe()
    assert any(call.by_ort and call.step == 2 for call in recorder.calls)  # ORT's graph ran the probes
    report = compare_dumps(tmp_path / "eager", tmp_path / "ort", rtol=1e-5, atol=1e-7)
    assert report.agrees, [str(d) for d in report.divergences[:3]]
    ort_records = load_dump(tmp_path / "ort")
    assert len(by_phase(ort_records, 2, "optim")) == 3 * len(NAMES)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), eager["weights"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(OLD_DYNAMO, reason="torch.compile is the modern lane's (torch 2.4's dynamo is not tested here)")
def test_torch_compile_compares_clean_against_eager_with_parameter_records(tmp_path):
    train(tmp_path / "eager", optimizer="adam", optimizer_state=True)
    train(tmp_path / "compiled", optimizer="adam", optimizer_state=True, wrap=torch.compile)
    records = load_dump(tmp_path / "compiled")
    assert list(by_phase(records, 2, "param")) == NAMES
    report = compare_dumps(tmp_path / "eager", tmp_path / "compiled", rtol=1e-5, atol=1e-7)
    assert report.agrees, [str(d) for d in report.divergences[:3]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = Model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    seen = {}
    with SubscriberManager().subscribe(ddp, [StatisticsSubscriber(out_dir, parameters=True, optimizer_state=True)]):
        for step in range(2):
            ddp(batch(10 * step + rank)).backward()  # each rank its own data: the all-reduce makes the gradients equal
            seen[step] = {name: p.grad.clone() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
    torch.save(seen, Path(out_dir, f"grads_{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ddp_ranks_record_the_all_reduced_gradients_and_equal_parameters(tmp_path):
    out = tmp_path / "ddp"
    torch.multiprocessing.start_processes(_ddp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True,
                                          start_method="spawn")
    ranks = [load_dump(out / f"rank_{rank}") for rank in range(2)]
    for rank, records in enumerate(ranks):
        seen = torch.load(out / f"grads_{rank}.pt", weights_only=True)
        for step in range(2):
            grads = by_phase(records, step, "grad")
            assert list(grads) == NAMES  # the user's names: no "module." of the wrapper
            for name in NAMES:
                assert_matches(grads[name], seen[step][name])
    assert by_phase(ranks[0], 0, "forward")["blocks.0.output.0"]["mean"] != \
        by_phase(ranks[1], 0, "forward")["blocks.0.output.0"]["mean"]  # the ranks saw different data
    statistics = ("min", "max", "mean", "std", "norm", "samples")
    for step in range(2):
        for phase in ("grad", "param", "optim"):
            zero, one = by_phase(ranks[0], step, phase), by_phase(ranks[1], step, phase)
            assert list(zero) == list(one) and zero
            for name in zero:
                assert [zero[name][key] for key in statistics] == [one[name][key] for key in statistics], (phase, name)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_parameter_records_add_no_host_read_to_the_step(tmp_path, monkeypatch, backend):
    from benchmarks.host_reads import count_host_reads

    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", backend)

    def reads_of_a_step(out: Path | None) -> int:
        torch.manual_seed(0)
        model = Model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        manager = SubscriberManager()
        if out is not None:
            manager.subscribe(model, [StatisticsSubscriber(out, parameters=True, optimizer_state=True)])
        for step in range(3):
            with count_host_reads() as reads:  # the last step counts: warm, records of every phase
                model(batch(step)).backward()
                optimizer.step()
                optimizer.zero_grad()
        manager.unsubscribe()
        return reads.total

    assert reads_of_a_step(tmp_path / "out") == reads_of_a_step(None)  # Adam's own reads of its step count, if any
    assert len(by_phase(load_dump(tmp_path / "out"), 2, "optim")) == 3 * len(NAMES)


def test_a_step_gradscaler_skips_has_no_parameter_records(tmp_path):
    scaler_class = getattr(torch.amp, "GradScaler", None)
    if scaler_class is None:
        pytest.skip("torch.amp.GradScaler is missing")
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = scaler_class("cpu", init_scale=4.0)
    manager = SubscriberManager()
    manager.subscribe(model, [StatisticsSubscriber(tmp_path / "out", parameters=True)])
    for step in range(3):
        x = batch(step)
        if step == 1:
            x[0, 0] = float("inf")  # inf gradients: the scaler skips this update
        scaler.scale(model(x)).backward()
        scaler.unscale_(optimizer)
        unscaled = model.head.weight.grad.clone()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    manager.unsubscribe()
    records = load_dump(tmp_path / "out")
    assert not [r for r in records if r["step"] == 1 and r["kind"] == "parameter"]
    assert list(by_phase(records, 2, "param")) == NAMES
    assert_matches(by_phase(records, 2, "grad")["head.weight"], unscaled)  # unscaled by unscale_ before step()


def finished(out: Path) -> list[int]:
    return DumpReader(out).steps().get(0, {}).get("finished", [])  # a reader waits for this process's writer


def test_two_optimizers_fill_one_step_which_finishes_after_the_second(tmp_path):
    torch.manual_seed(0)
    model = Model()
    head = torch.optim.SGD(model.head.parameters(), lr=0.05)
    rest = torch.optim.Adam([p for name, p in model.named_parameters() if not name.startswith("head.")], lr=0.01)
    subscriber = StatisticsSubscriber(tmp_path / "out", parameters=True, optimizer_state=True)
    manager = SubscriberManager()
    manager.subscribe(model, [subscriber])
    for step in range(2):
        model(batch(step)).backward()
        head.step()
        assert step not in finished(tmp_path / "out")  # waits for the other parameters' update
        rest.step()
        assert step in finished(tmp_path / "out")  # every parameter updated: finished before the next forward
        head.zero_grad()
        rest.zero_grad()
    manager.unsubscribe()
    records = load_dump(tmp_path / "out")
    for step in range(2):
        in_step = sorted((r for r in records if r["step"] == step), key=lambda r: r["seq"])  # execution order
        assert len({r["seq"] for r in in_step}) == len(in_step)
        ranks = [phase_rank(r["phase"]) for r in in_step]
        assert ranks == sorted(ranks)  # seq orders the phases, whichever optimizer stepped first
        assert [r["name"] for r in in_step if r["phase"] == "param"] == NAMES  # and the parameters in model order
    assert "head.weight.momentum_buffer" not in by_phase(records, 1, "optim")  # SGD without momentum has none
    assert "blocks.0.fc.weight.exp_avg" in by_phase(records, 1, "optim")


def test_optimizer_state_without_parameters_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="optimizer_state=True needs parameters=True"):
        StatisticsSubscriber(tmp_path / "out", optimizer_state=True)
    assert not (tmp_path / "out").exists()  # checked before the dump directory is touched
