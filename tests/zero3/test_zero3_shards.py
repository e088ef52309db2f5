"""ZeRO-3 parameter, gradient and optimizer-state statistics from each rank's shards, merged without gathering.

Two ranks (torch.multiprocessing spawn, gloo, CPU) train a model whose parameters do not divide by 2 (35, 7, 21,
3 and 1 elements: padding on the last rank, and a parameter rank 1 holds none of) under a DeepSpeed ZeRO-3
engine with torch's Adam, for 2 steps: without clipping, with clipping, with two param groups split in 4
sub-groups (4 inner steps a step), and with the optimizer offloaded to host memory. In torch's global optimizer step hooks, which see DeepSpeed's inner
optimizer over flat fp32 partitions, the building blocks (``exporters.adapters.deepspeed_internals.zero3_stepping``,
``probes.stats.shards.ShardRows``) make a record per parameter of its gradient (pre-hook), master copy and Adam
state (post-hook). The test then gathers each full tensor itself with DeepSpeed's ``safe_get_full_*`` and checks
every statistic and sample against numpy float64; and it checks that the blocks gather no parameter (their
statuses stay NOT_AVAILABLE) and make exactly one collective per step (their own all_gather of the rows).
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

deepspeed = pytest.importorskip("deepspeed")

from helpers import assert_moments  # noqa: E402
from exporters.adapters import deepspeed_internals as _deepspeed  # noqa: E402
from probes.dump.columns import table_to_records
from probes.stats.numerics import sample_indices  # noqa: E402
from probes.stats.rows import StepRows  # noqa: E402
from probes.stats.shards import ShardRows  # noqa: E402

STEPS = 2
COUNT = 16  # samples per record: more than some parameters have
WORLD = 2
CLIP = 1e-3  # small enough that every step clips
STATE_KEYS = ("exp_avg", "exp_avg_sq")
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "broadcast",
               "all_reduce", "reduce_scatter_tensor")


class OddModel(torch.nn.Module):
    """Parameters of 35, 7, 21, 3 and 1 elements: none divides by 2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 7)
        self.fc2 = torch.nn.Linear(7, 3)
        self.scale = torch.nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))) * self.scale, y)


class _Collectives:
    """Counts calls of torch.distributed's collectives (DeepSpeed's go through them) while active."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved = {name: getattr(torch.distributed, name) for name in COLLECTIVES}

    def __enter__(self) -> _Collectives:
        for name, function in self._saved.items():
            setattr(torch.distributed, name, self._counting(name, function))
        return self

    def _counting(self, name, function):
        def call(*args, **kwargs):
            self.calls.append(name)
            return function(*args, **kwargs)
        return call

    def __exit__(self, *exc) -> None:
        for name, function in self._saved.items():
            setattr(torch.distributed, name, function)


def _names(name: str) -> tuple:
    module, _, _ = name.rpartition(".")
    return (name, 0, module or "<root>", "Linear" if module else "OddModel", "parameter", name.count("."), name, None)


def _train(rank: int, clip: float, *, sub_groups: bool = False, offload: bool = False) -> dict:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    torch.manual_seed(0)
    model = OddModel()
    params: list = list(model.parameters())
    # DeepSpeed clips at 1.0 unless told otherwise: 0 turns clipping off (then safe_get_full_grad is the gradient used).
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": clip,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if sub_groups:  # two param groups, split in sub-groups of ~10 elements a rank: several inner steps per step
        params = [{"params": list(model.fc1.parameters())},
                  {"params": [*model.fc2.parameters(), model.scale], "weight_decay": 0.1}]
        config["zero_optimization"]["sub_group_size"] = 10
    if offload:  # the fp32 master copy, its gradient and Adam's state in host memory, stepped by torch's Adam
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    optimizer = torch.optim.Adam(params, lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    name_of = {id(param): name for name, param in model.named_parameters()}
    step_rows = StepRows(rank=rank, sample_count=COUNT)
    shards = ShardRows(step_rows)
    result: dict = {"records": [], "reference": [], "pre": [], "post": [], "state_keys_before": [], "owners": 0}
    step = 0

    def partitioned() -> bool:
        return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.data.numel() == 0 for p in model.parameters())

    def blocks(optimizer, phases: tuple[str, ...]) -> tuple:
        """What the parameter recorder would do in a hook: (stepping, collectives, partitioned before, after)."""
        before = partitioned()
        with _Collectives() as seen:
            owner = _deepspeed.zero3_optimizer_of(optimizer, model.parameters())
            assert owner is not None
            stepping = _deepspeed.zero3_stepping(owner, optimizer)
            for seq, shard in enumerate(stepping.shards):
                name = name_of[id(shard.param)]
                tensors = {"grad": [(name, shard.grad)], "param": [(name, shard.master)],
                           "optim": [(f"{name}.{key}", shard.state[key]) for key in sorted(shard.state)]}
                for phase in phases:
                    for record_name, tensor in tensors[phase]:
                        assert shards.add(_names(record_name), step, phase, seq, tensor, full_shape=shard.full_shape,
                                          bounds=shard.bounds, rank=shard.rank) is None
            if "param" in phases and stepping.last:
                shards.flush()
        return stepping, seen.calls, before, partitioned()

    def pre(optimizer, args, kwargs) -> None:
        if _deepspeed.zero3_optimizer_of(optimizer, model.parameters()) is None:
            return
        stepping, calls, before, after = blocks(optimizer, ("grad",))
        result["pre"].append((calls, before, after))
        result["state_keys_before"].append(sorted(stepping.shards[0].state))
        if len(result["reference"]) == step:
            # The test's own reference: each gradient gathered whole (DeepSpeed's full-tensor API, collectives).
            result["reference"].append({"grad": {name: safe_get_full_grad(p).detach().double().numpy().copy()
                                                 for name, p in model.named_parameters()}})

    def post(optimizer, args, kwargs) -> None:
        if _deepspeed.zero3_optimizer_of(optimizer, model.parameters()) is None:
            return
        stepping, calls, before, after = blocks(optimizer, ("param", "optim"))
        result["post"].append((calls, before, after))
        if stepping.last:  # every sub-group updated: the whole parameters and states
            reference = result["reference"][step]
            reference["param"] = {name: safe_get_full_fp32_param(p).detach().double().numpy().copy()
                                  for name, p in model.named_parameters()}
            reference["optim"] = {f"{name}.{key}": safe_get_full_optimizer_state(p, key).detach().double().numpy().copy()
                                  for name, p in model.named_parameters() for key in STATE_KEYS}

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(10 * step + rank)
            loss = engine(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g))
            engine.backward(loss)
            engine.step()
            (block,) = step_rows.take()
            result["records"].append(table_to_records(block.to_table()))
    finally:
        for handle in handles:
            handle.remove()
    result["offloaded"] = bool(engine.optimizer.offload_optimizer)
    result["shapes"] = {name: tuple(p.ds_shape) for name, p in model.named_parameters()}
    result["shard_sizes"] = {name: p.ds_tensor.numel() for name, p in model.named_parameters()}
    engine.destroy()
    return result


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    _deepspeed.skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {"plain": _train(rank, 0.0), "clipped": _train(rank, CLIP), "sub-groups": _train(rank, 0.0, sub_groups=True),
               "offload": _train(rank, 0.0, offload=True)}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # leaving with it alive lets gloo abort the exit now and then


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("zero3_shards")
    torch.multiprocessing.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True,
                                          start_method="spawn")
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def _expected(values: np.ndarray) -> dict:
    """numpy float64 statistics of a whole tensor, written out here."""
    f = values.reshape(-1)
    good = f[np.isfinite(f)]
    mean = good.mean()
    return {"numel": f.size, "finite": good.size, "nan": int(np.isnan(f).sum()), "inf": int(np.isinf(f).sum()),
            "neg": int((f < 0).sum()), "pos": int((f > 0).sum()), "zero": int((f == 0).sum()),
            "min": float(good.min()), "max": float(good.max()), "mean": float(mean),
            "m2": float(((good - mean) ** 2).sum()),
            "std": float(np.sqrt(((good - mean) ** 2).sum() / (good.size - 1))) if good.size > 1 else None,
            "norm": float(np.sqrt((good * good).sum())),
            "sample_indices": sample_indices(f.size, COUNT), "samples": [float(f[i]) for i in sample_indices(f.size, COUNT)]}


def _check_record(record: dict, values: np.ndarray, shape: tuple, label: str) -> None:
    expected = _expected(values)
    assert record["shape"] == list(shape) and record["dtype"] == "float32", label
    for key in ("numel", "finite", "nan", "inf", "neg", "pos", "zero", "min", "max", "sample_indices", "samples"):
        assert record[key] == expected[key], (label, key, record[key], expected[key])
    assert_moments(record, expected, label, ("mean", "m2", "std", "norm"))


@pytest.mark.slow
@pytest.mark.parametrize("run", ["plain", "clipped", "sub-groups", "offload"])
def test_shard_statistics_equal_numpy_on_the_gathered_tensors(runs, run):
    zero, one = (ranks[run] for ranks in runs)
    names = list(zero["shapes"])
    assert zero["offloaded"] == (run == "offload")
    assert zero["shard_sizes"] == {"fc1.weight": 18, "fc1.bias": 4, "fc2.weight": 11, "fc2.bias": 2, "scale": 1}
    inner_steps = len(zero["state_keys_before"]) // STEPS
    assert zero["state_keys_before"] == [[]] * inner_steps + [list(STATE_KEYS)] * inner_steps  # Adam's, from its first step
    for step in range(STEPS):
        records, reference = zero["records"][step], zero["reference"][step]
        # Every rank makes the same merged records (both ranks' dumps hold the whole tensors' statistics).
        assert records == [dict(record, rank=0) for record in one["records"][step]], step
        got = {(record["phase"], record["name"]): record for record in records}
        expected = [("grad", name) for name in names] + [("param", name) for name in names] + \
            [("optim", f"{name}.{key}") for name in names for key in STATE_KEYS]
        assert sorted(got) == sorted(expected), step
        assert all(record["step"] == step for record in records)
        for (phase, name), record in got.items():
            if run == "clipped" and phase == "grad":
                continue  # safe_get_full_grad is the gradient before clipping: the next test
            values = reference[phase][name]
            _check_record(record, values, zero["shapes"][name.rsplit(".", 1)[0] if phase == "optim" else name],
                          f"{run} step {step} {phase} {name}")


@pytest.mark.slow
def test_the_grad_records_are_the_gradients_after_clipping(runs):
    # DeepSpeed clips the fp32 gradient partitions in place before the inner step: the records see the clipped
    # gradient (global norm CLIP), while safe_get_full_grad gives the one before clipping (checked above, plain).
    for step in range(STEPS):
        records = runs[0]["clipped"]["records"][step]
        reference = runs[0]["clipped"]["reference"][step]["grad"]
        unclipped = math.sqrt(sum(float((values ** 2).sum()) for values in reference.values()))
        grads = [record for record in records if record["phase"] == "grad"]
        clipped = math.sqrt(sum(record["norm"] ** 2 for record in grads))
        assert len(grads) == len(reference) and unclipped > 10 * CLIP
        factor = CLIP / (unclipped + 1e-6)
        assert clipped == pytest.approx(factor * unclipped, rel=1e-5), step
        for record in grads:  # each gradient scaled by the one factor (float32 rounding of each element aside)
            values = reference[record["name"]].reshape(-1)
            assert record["samples"] == pytest.approx([factor * values[i] for i in record["sample_indices"]], rel=1e-5)
            assert record["mean"] == pytest.approx(factor * values.mean(), rel=1e-5, abs=1e-12)


@pytest.mark.slow
def test_the_blocks_gather_no_parameter_and_make_one_collective_per_step(runs):
    for rank, ranks in enumerate(runs):
        for run, inner_steps in (("plain", 1), ("clipped", 1), ("sub-groups", 4), ("offload", 1)):
            result = ranks[run]
            assert len(result["pre"]) == len(result["post"]) == STEPS * inner_steps, run  # an inner step a sub-group
            for calls, before, after in result["pre"]:
                assert calls == [] and before and after, (rank, run)
            for index, (calls, before, after) in enumerate(result["post"]):
                last = index % inner_steps == inner_steps - 1  # the step's last sub-group: the one flush
                assert calls == (["all_gather"] if last else []) and before and after, (rank, run, index)


def test_a_plain_optimizer_is_no_zero3_inner_optimizer():
    model = OddModel()
    optimizer = torch.optim.Adam(model.parameters())
    assert _deepspeed.zero3_optimizer_of(optimizer, model.parameters()) is None


def test_a_zero3_optimizer_without_the_expected_internals_is_named_with_what_it_lacks():
    class Stage3Elsewhere:  # stands in for a DeepSpeed release whose ZeRO-3 optimizer was reorganised
        def __init__(self, optimizer):
            self.optimizer = optimizer
            self.fp16_groups = []

    model = OddModel()
    optimizer = torch.optim.Adam(model.parameters())
    model.fc1.weight._z3_optimizer = Stage3Elsewhere(optimizer)
    with pytest.raises(_deepspeed.DeepSpeedInternalsError, match="lacks .*fp32_partitioned_groups_flat.*deepspeed_internals"):
        _deepspeed.zero3_optimizer_of(optimizer, model.parameters())
