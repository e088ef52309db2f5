"""``StatisticsSubscriber(parameters=True, optimizer_state=True)`` under a DeepSpeed ZeRO-3 engine, 2 ranks.

Two gloo ranks (spawn) train a model whose parameters do not divide by 2 (35, 7, 21, 3 elements) for 3 steps,
each rank on its own data, under ZeRO-3 with torch's Adam:
- "stock": DeepSpeed's own hooks, the model subscribed by hand;
- "probes": probes' ZeRO-3 hooks (``configure_ort_compatible_zero_stage3(debug=True, stats_options=...)``);
- "probes+ort" (ort lane): the same, the model in ORTModule.
The test gathers every full gradient (before ``engine.step()``), fp32 master parameter and Adam state (after it)
itself with DeepSpeed's ``safe_get_full_*`` and checks each rank's records against numpy float64 of them; the
two ranks' records are the same; and eager vs ORTModule compares clean.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from exporters.adapters import deepspeed_internals as _deepspeed  # noqa: E402
from probes import StatisticsSubscriber, SubscriberManager, load_dump  # noqa: E402
from probes.compare import compare_dumps  # noqa: E402
from probes.zero3 import configure_ort_compatible_zero_stage3  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 3
WORLD = 2
OPTIONS = {"parameters": True, "optimizer_state": True}
DS_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,  # the gradient used: safe_get_full_grad's
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _ort_available() -> bool:
    try:
        from onnxruntime.training.ortmodule import ORTModule  # noqa: F401
    except Exception:
        return False
    return True


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _train(mode: str, rank: int, out: Path) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    from helpers import called_by_ort_runtime

    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    fetched_by_ort: list[bool] = []
    fetch = _deepspeed.fetch_for_forward

    def spy(offload, module) -> None:
        fetched_by_ort.append(called_by_ort_runtime())
        fetch(offload, module)

    manager = None
    if mode == "stock":
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
        manager = SubscriberManager()
        manager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True, **OPTIONS)])
    else:
        wrapped = model
        if mode == "probes+ort":
            from onnxruntime.training.ortmodule import ORTModule

            wrapped = ORTModule(model)
        with configure_ort_compatible_zero_stage3(debug=True, stats_output_dir=out, stats_overwrite=True,
                                                  stats_options=OPTIONS):
            engine, *_ = deepspeed.initialize(model=wrapped, optimizer=optimizer, config=DS_CONFIG)
        _deepspeed.fetch_for_forward = spy
    seen: dict = {"grad": [], "param": [], "optim": []}
    try:
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(10 * step + rank)  # each rank its own data
            x, y = torch.randn(4, 5, generator=generator), torch.randn(4, 3, generator=generator)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            seen["grad"].append({name: safe_get_full_grad(p).detach().double().numpy().copy()
                                 for name, p in model.named_parameters()})
            engine.step()
            seen["param"].append({name: safe_get_full_fp32_param(p).detach().double().numpy().copy()
                                  for name, p in model.named_parameters()})
            seen["optim"].append({f"{name}.{key}": safe_get_full_optimizer_state(p, key).detach().double().numpy().copy()
                                  for name, p in model.named_parameters() for key in ("exp_avg", "exp_avg_sq")})
    finally:
        _deepspeed.fetch_for_forward = fetch
    seen["partitioned"] = all(p.data.numel() == 0 for p in model.parameters())
    seen["fetched_by_ort"] = fetched_by_ort
    if manager is not None:
        manager.unsubscribe()
    engine.destroy()
    return seen


def _worker(rank: int, port: int, out: str, modes: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    _deepspeed.skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.save({mode: _train(mode, rank, Path(out) / mode) for mode in modes}, Path(out) / f"seen_{rank}.pt")
    # Leaving with the group alive lets gloo's threads abort the exit now and then (SIGABRT, "terminate called").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[str], list[dict]]:
    out = tmp_path_factory.mktemp("zero3_parameters")
    modes = ["stock", "probes"] + (["probes+ort"] if _ort_available() else [])
    torch.multiprocessing.start_processes(_worker, args=(_free_port(), str(out), modes), nprocs=WORLD, join=True,
                                          start_method="spawn")
    return out, modes, [torch.load(out / f"seen_{rank}.pt", weights_only=False) for rank in range(WORLD)]


def _check(record: dict, values: np.ndarray, label: str) -> None:
    values = values.ravel()
    assert record["numel"] == values.size and record.get("unsupported") is None, label
    expected = {"min": values.min(), "max": values.max(), "mean": values.mean(), "std": values.std(ddof=1),
                "norm": np.sqrt((values * values).sum())}
    for key, value in expected.items():
        assert record[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (label, key)
    assert record["zero"] == int((values == 0).sum()), label


@pytest.mark.parametrize("mode", ["stock", "probes"])
def test_each_rank_records_the_whole_tensors_from_its_shards(runs, mode):
    out, _, seen = runs
    records = load_dump(out / mode)
    for rank in range(WORLD):
        assert seen[rank][mode]["partitioned"]  # nothing left gathered
        mine = {(r["step"], r["phase"], r["name"]): r for r in records if r["rank"] == rank}
        # Rank 0's references: the whole tensors are the same on every rank (gathered by the test).
        for step in range(STEPS):
            for phase in ("grad", "param", "optim"):
                expected = seen[0][mode][phase][step]
                assert {name for s, p, name in mine if (s, p) == (step, phase)} == set(expected), (rank, step, phase)
                for name, values in expected.items():
                    _check(mine[step, phase, name], values, f"{mode} rank {rank} step {step} {phase} {name}")
    assert compare_dumps(out / mode, ranks=True, rtol=0, atol=0).agrees  # the same merged records on every rank
    assert not compare_dumps(out / mode, ranks=True, phases=["forward"]).agrees  # but each rank its own data


def test_probes_zero3_hooks_record_what_deepspeeds_own_hooks_record(runs):
    out, _, _ = runs
    report = compare_dumps(out / "stock", out / "probes", rtol=0, atol=0)
    assert report.agrees, report.first_divergence
    assert not report.only_in_base and not report.only_in_other


@pytest.mark.ort
def test_ortmodule_under_zero3_records_what_eager_records(runs):
    out, modes, seen = runs
    assert "probes+ort" in modes
    assert os.environ["ORTMODULE_FALLBACK_POLICY"] == "FALLBACK_DISABLE"
    for rank in range(WORLD):
        # ORT's graph made every fetch of the training steps (4 modules a forward); the rest are export runs.
        assert sum(seen[rank]["probes+ort"]["fetched_by_ort"]) == STEPS * len(list(_model().modules())), rank
    report = compare_dumps(out / "probes", out / "probes+ort", rtol=1e-4, atol=1e-6)
    assert report.agrees, report.first_divergence
    assert {r["phase"] for r in load_dump(out / "probes+ort")} >= {"grad", "param", "optim"}
