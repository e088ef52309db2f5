"""``StatisticsSubscriber(parameters=True, optimizer_state=True)`` on a model sharded with FSDP2, 2 gloo ranks.

Two ranks (spawn) train a model whose parameters split unevenly along dim 0 (7 rows: 4 + 3; 3 rows: 2 + 1;
1 row: 1 + 0, an empty shard on rank 1) under ``torch.distributed.fsdp.fully_shard`` with Adam, 3 steps, each
rank on its own data. The test gathers every full gradient (before ``step()``), parameter and Adam state
(after it) itself (``DTensor.full_tensor()``) and checks both ranks' records against numpy float64 of them:
records of the whole tensors, the same on both ranks. The same training with probes off gives the same losses
and weights, bit for bit. Other placements: a ``Replicate()`` DTensor is recorded whole (its local tensor);
a ``Shard(1)`` one is an "unsupported" record naming its placement, with a warning, and training goes on.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from probes import StatisticsSubscriber, SubscriberManager, load_dump
from probes.stats import UnsupportedTensorWarning
from probes.compare import compare_dumps
from test_parameters import _free_port, assert_matches  # numpy float64 statistics of the tensor, rel 1e-12

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip(f"torch {torch.__version__} has no public FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)",
                allow_module_level=True)

pytestmark = pytest.mark.slow

STEPS = 3
WORLD = 2
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]
STATE = ("step", "exp_avg", "exp_avg_sq")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3), torch.nn.Linear(3, 1))
    for index in (0, 2, 3):
        fsdp.fully_shard(model[index])
    fsdp.fully_shard(model)
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor), as a plain copy."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _train(out: Path | None, rank: int) -> dict:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    named = dict(model.named_parameters())
    manager = SubscriberManager()
    if out is not None:
        manager.subscribe(model, [StatisticsSubscriber(out, parameters=True, optimizer_state=True)])
    seen: dict = {"grad": {}, "param": {}, "optim": {}, "losses": []}
    for step in range(STEPS):
        data = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))  # each rank its own
        loss = model(data).pow(2).mean()
        loss.backward()
        seen["losses"].append(loss.detach().clone())
        seen["grad"][step] = {name: _full(p.grad) for name, p in named.items()}
        optimizer.step()
        seen["param"][step] = {name: _full(p) for name, p in named.items()}
        seen["optim"][step] = {f"{name}.{key}": _full(optimizer.state[p][key]) for name, p in named.items()
                               for key in STATE}
        optimizer.zero_grad()
    manager.unsubscribe()
    seen["weights"] = {name: _full(p) for name, p in named.items()}
    seen["placements"] = {name: str(p.placements) for name, p in named.items()}
    return seen


class _Placed(torch.nn.Module):
    """A Linear sharded on dim 1 (``shard_placement_fn``) and a Replicate() DTensor scale."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 7)  # 6 columns: FSDP shards dim 1 only evenly
        fsdp.fully_shard(self.fc, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
        mesh = self.fc.weight.device_mesh
        self.scale = torch.nn.Parameter(distribute_tensor(torch.tensor([1.5, -0.5, 2.0, 0.25, 1.0, -1.0, 0.5]), mesh,
                                                          [Replicate()]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.scale.to_local()).pow(2).mean()


def _other_placements(out: Path, rank: int) -> dict:
    model = _Placed()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SubscriberManager().subscribe(model, [StatisticsSubscriber(out, parameters=True, optimizer_state=True)]):
            for step in range(2):
                model(torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))).backward()
                seen[step] = {"grad": model.scale.grad.to_local().clone()}
                optimizer.step()
                seen[step]["param"] = model.scale.to_local().detach().clone()
                optimizer.zero_grad()
    seen["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UnsupportedTensorWarning)]
    seen["placements"] = {name: str(p.placements) for name, p in model.named_parameters()}
    return seen


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        probed = _train(Path(out, "dump"), rank)
        plain = _train(None, rank)
        placed = _other_placements(Path(out, "placed"), rank)
        torch.save({"probed": probed, "plain": plain, "placed": placed}, Path(out, f"seen_{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("fsdp")
    torch.multiprocessing.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True,
                                          start_method="spawn")
    return out, [torch.load(out / f"seen_{rank}.pt", weights_only=False) for rank in range(WORLD)]


def test_records_are_of_the_whole_tensors_and_equal_numpy_on_every_rank(fsdp_run):
    out, seen = fsdp_run
    assert set(seen[0]["probed"]["placements"].values()) == {"(Shard(dim=0),)"}  # FSDP2 sharded every parameter
    for rank in range(WORLD):
        records = [r for r in load_dump(out / "dump" / f"rank_{rank}") if r["kind"] == "parameter"]
        assert not [r for r in records if r.get("unsupported")], rank
        for step in range(STEPS):
            for phase in ("grad", "param", "optim"):
                tensors = seen[rank]["probed"][phase][step]
                found = {r["name"]: r for r in records if r["step"] == step and r["phase"] == phase}
                assert sorted(found) == sorted(tensors), (rank, step, phase)
                for name, tensor in tensors.items():
                    assert_matches(found[name], tensor)
                    assert found[name].get("stats_of") is None, name  # not "local_shard": the whole tensor


def test_every_rank_has_the_same_records(fsdp_run):
    out, _ = fsdp_run
    assert compare_dumps(out / "dump", ranks=True, rtol=0, atol=0).agrees
    assert not compare_dumps(out / "dump", ranks=True, phases=["forward"]).agrees  # but each rank its own data


def test_probes_leave_losses_and_weights_bit_identical(fsdp_run):
    _, seen = fsdp_run
    for rank in range(WORLD):
        probed, plain = seen[rank]["probed"], seen[rank]["plain"]
        assert [loss.item() for loss in probed["losses"]] == [loss.item() for loss in plain["losses"]]
        for name in NAMES:
            assert torch.equal(probed["weights"][name], plain["weights"][name]), name


def test_replicate_is_recorded_whole_and_other_placements_say_unsupported(fsdp_run):
    out, seen = fsdp_run
    for rank in range(WORLD):
        placed = seen[rank]["placed"]
        assert placed["placements"] == {"scale": "(Replicate(),)", "fc.weight": "(Shard(dim=1),)",
                                        "fc.bias": "(Shard(dim=0),)"}
        records = {(r["step"], r["phase"], r["name"]): r for r in load_dump(out / "placed" / f"rank_{rank}")
                   if r["kind"] == "parameter"}
        for step in range(2):
            for phase in ("grad", "param"):
                assert_matches(records[step, phase, "scale"], placed[step][phase])  # each rank's own gradient
                assert not records[step, phase, "fc.bias"].get("unsupported")
                assert "(Shard(dim=1),) on a 1-D mesh" in records[step, phase, "fc.weight"]["unsupported"]
            assert "Shard(dim=1)" in records[step, "optim", "fc.weight.exp_avg"]["unsupported"]
        assert placed["warnings"] and all("Shard(dim=1)" in message for message in placed["warnings"])
