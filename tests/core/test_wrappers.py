"""Module names do not depend on wrappers: DDP (2 ranks), FSDP, fully_shard, a DeepSpeed engine,
torch.compile's OptimizedModule and activation-checkpoint wrappers give the user's own names, and a
wrapped run compares clean with a plain single-process one.

Distributed cases run in spawned processes (gloo, CPU), so no process group leaks into pytest.
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch

from helpers import Recorder
from probes import StatisticsSubscriber, SubscriberManager
from probes import load_dump
from probes.compare import compare_dumps
from probes.compare.engine import compare_records
from test_real_training import Block, Net, _batch

STEPS = 2
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _plain_run(out: Path) -> list[str]:
    torch.manual_seed(0)
    model = Net()
    recorder = Recorder()
    with SubscriberManager().subscribe(model, [recorder, StatisticsSubscriber(out)]):
        _train_steps(model, model)
    return sorted({call.name for call in recorder.calls})


def _train_steps(runner: torch.nn.Module, model: torch.nn.Module, backward=None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = runner(_batch(step))
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wrap(case: str, model: torch.nn.Module):
    """(the wrapper to subscribe and call, its backward, its step) for a distributed case."""
    if case == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), None
    if case == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True), None
    if case == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model), None
    if case == "deepspeed":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                          config={"train_micro_batch_size_per_gpu": 4})
        return engine, engine.backward
    raise ValueError(case)


def _worker(rank: int, world_size: int, port: int, case: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    if case == "deepspeed":
        import deepspeed

        from exporters.adapters import deepspeed_internals as _deepspeed

        _deepspeed.skip_shm_comm_build()
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = Net()
    wrapper, backward = _wrap(case, model)
    recorder = Recorder()
    with SubscriberManager().subscribe(wrapper, [recorder, StatisticsSubscriber(out_dir)]):
        _train_steps(wrapper, wrapper if case == "deepspeed" else model, backward)
    names = sorted({call.name for call in recorder.calls})
    Path(out_dir, f"names_{rank}.txt").write_text("\n".join(names))
    torch.distributed.destroy_process_group()


CASES = {
    "ddp": 2,
    "fsdp": 1,
    "fully_shard": 1,
    "deepspeed": 1,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_distributed_wrapper_gives_the_users_names_and_compares_with_a_plain_run(tmp_path, case):
    if case == "fully_shard" and TORCH_VERSION < (2, 6):
        pytest.skip(f"fully_shard on the CPU needs torch >= 2.6 (torch {torch.__version__}'s needs CUDA streams)")
    if case == "deepspeed":
        pytest.importorskip("deepspeed")
    world_size = CASES[case]
    plain_names = _plain_run(tmp_path / "plain")
    torch.multiprocessing.start_processes(_worker, args=(world_size, _free_port(), case, str(tmp_path / case)),
                                          nprocs=world_size, join=True, start_method="spawn")
    for rank in range(world_size):
        assert (tmp_path / case / f"names_{rank}.txt").read_text().splitlines() == plain_names, rank
    report = compare_dumps(tmp_path / "plain", tmp_path / case / "rank_0")
    assert report.matched == len(plain_names) * 2 * STEPS, report.matched
    assert report.agrees, [str(d) for d in report.divergences[:3]]
    # Every rank trained on the same batch: the other ranks' records equal rank 0's.
    by_key = {(r["step"], r["phase"], r["name"]): r for r in load_dump(tmp_path / case / "rank_0")}
    for rank in range(1, world_size):
        others = load_dump(tmp_path / case / f"rank_{rank}")
        assert sorted((r["step"], r["phase"], r["name"]) for r in others) == sorted(by_key)
        assert not [r["name"] for r in others if compare_records(by_key[r["step"], r["phase"], r["name"]], r).diverged]


def _names_of(subscribe_to: torch.nn.Module, runner: torch.nn.Module) -> list[str]:
    recorder = Recorder()
    with SubscriberManager().subscribe(subscribe_to, [recorder]):
        runner(_batch(0)).backward()
    return sorted({call.name for call in recorder.calls})


def test_torch_compile_wrapper_gives_the_same_names_subscribed_outside_or_inside():
    torch.manual_seed(0)
    model = Net()
    plain = _names_of(model, model)
    compiled = torch.compile(model, backend="eager")
    assert plain == _names_of(compiled, compiled) == _names_of(model, compiled)
    assert not any("_orig_mod" in name for name in plain)


def test_checkpoint_wrapper_is_invisible_in_names_and_records(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    torch.manual_seed(0)
    plain = Net()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, check_fn=lambda module: isinstance(module, Block))
    assert any("_checkpoint_wrapped_module" in name for name, _ in wrapped.named_modules())
    assert _names_of(plain, plain) == _names_of(wrapped, wrapped)
    for label, model in (("plain", plain), ("wrapped", wrapped)):
        with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / label)]):
            _train_steps(model, model)
    report = compare_dumps(tmp_path / "plain", tmp_path / "wrapped")
    assert report.agrees and report.matched > 0 and not report.only_in_base and not report.only_in_other
