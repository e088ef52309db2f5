"""ZeRO-3 with probes' hooks trains exactly like DeepSpeed's own hooks (1 and 2 ranks, gloo, CPU).

Each training case runs in fresh processes (torch.multiprocessing spawn): one per rank, each
training the same model with stock DeepSpeed hooks and with probes' (and probes' + statistics),
so the process group and DeepSpeed's globals never leak into the pytest process.
"""

from __future__ import annotations

import copy
import math
import os
import socket
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers import hook_count

deepspeed = pytest.importorskip("deepspeed")

from exporters.adapters import deepspeed_internals as _deepspeed  # noqa: E402
from exporters.handles import Handle  # noqa: E402
from probes import SubscriberBase, SubscriberManager  # noqa: E402
from probes.testing import assert_parity  # noqa: E402
from probes.models import TinyTransformer, TransformerConfig, make_batch  # noqa: E402
from probes.core.interface import ProbeSite  # noqa: E402
from probes.zero3.gathering import ModuleBinding  # noqa: E402
from probes.zero3 import (
    DeepCopiedModuleError, ZeROOffloadSubscriber, configure_ort_compatible_zero_stage3, restore_zero_stage3_hooks,
)  # noqa: E402
from probes.zero3.patch import is_configured  # noqa: E402

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
STEPS = 5
BATCH = 4
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


# API: patching, restoring, errors (no process group needed) ------------------------------------

def _setup_hooks():
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    return DeepSpeedZeRoOffload.__dict__["setup_zero_stage3_hooks"]


def test_configure_replaces_and_restore_puts_back_deepspeeds_setup():
    original = _setup_hooks()
    patch = configure_ort_compatible_zero_stage3()
    try:
        assert is_configured() and patch.active
        assert _setup_hooks() is not original
        configure_ort_compatible_zero_stage3(debug=True)  # again: new settings, still one patch
        assert not patch.active
    finally:
        assert restore_zero_stage3_hooks()
    assert _setup_hooks() is original and not is_configured()
    assert not restore_zero_stage3_hooks()


def test_context_manager_restores():
    original = _setup_hooks()
    with configure_ort_compatible_zero_stage3() as patch:
        assert patch.active and _setup_hooks() is not original
    assert _setup_hooks() is original


def test_missing_deepspeed_raises_importerror_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match="'deepspeed' package"):
        configure_ort_compatible_zero_stage3()


@pytest.mark.parametrize("version", ["0.18.9", "0.20.0", "1.0.0"])
def test_unsupported_version_names_version_and_range(monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    monkeypatch.setattr(_deepspeed._DEEPSPEED, "checked", False)
    with pytest.raises(_deepspeed.DeepSpeedVersionError) as error:
        configure_ort_compatible_zero_stage3()
    assert version in str(error.value) and _deepspeed.SUPPORTED_RANGE in str(error.value)
    assert not is_configured()


class _Offload:
    """Stands in for an engine's DeepSpeedZeRoOffload where no forward runs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model

    def get_param_coordinator(self):
        return None


def test_hooks_refuse_a_copy_of_the_model():
    # ORTModule deep-copies the model before export unless told not to; a copy cannot be gathered.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    subscriber = ZeROOffloadSubscriber(_Offload(model))
    site = ProbeSite("<root>", "input", 0, 0, "Sequential")
    with pytest.raises(DeepCopiedModuleError, match="ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT=0"):
        subscriber.pre_forward_module_apply(site, copy.deepcopy(model), (torch.zeros(1, 2),), {})


def test_a_copy_of_a_subscribed_model_shares_the_bindings_and_its_hooks_refuse_it():
    # ORTModule's deep copy reaches the hooks, not what they act on: no binding (module, offload) is copied,
    # and the copy's hooks, being the original's, find the copy's modules are not DeepSpeed's.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    subscriber = ZeROOffloadSubscriber(_Offload(model))
    with SubscriberManager().subscribe(model, [subscriber]):
        memo: dict = {}
        twin = copy.deepcopy(model, memo)
        assert not [value for key, value in memo.items() if key != id(memo) and isinstance(value, ModuleBinding)]
        assert memo[id(model)] is twin
        with pytest.raises(DeepCopiedModuleError):
            twin(torch.zeros(1, 2))


def test_closing_warns_only_when_a_live_engine_loses_its_hooks():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Made by hand (no engine holds it): removing the subscription is its owner's business.
        SubscriberManager().subscribe(model, [ZeROOffloadSubscriber(_Offload(model))]).remove()
        # Held by an engine, removed by the engine (as engine.destroy() does): no warning either.
        hooks = ZeROOffloadSubscriber(_Offload(model))
        hooks.engine_handle = Handle(SubscriberManager().subscribe(model, [hooks]).remove)
        hooks.engine_handle.remove()
    assert hooks.closed
    # Held by an engine and replaced by subscribing the model again: the engine no longer gathers.
    hooks = ZeROOffloadSubscriber(_Offload(model))
    hooks.engine_handle = Handle(SubscriberManager().subscribe(model, [hooks]).remove)
    with pytest.warns(RuntimeWarning, match="were unsubscribed"):
        replacement = SubscriberManager().subscribe(model, [SubscriberBase()])
    replacement.remove()
    hooks.engine_handle.remove()  # the engine's later destroy finds nothing left to remove


def test_supported_version_accepted():
    _deepspeed.check_version("0.19.8")
    _deepspeed.check_version("0.19.10+abc")


# Training equivalence -------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _FetchSpy:
    """Records, for every ZeRO-3 forward fetch, whether ORT's runtime made the call; and, for every
    backward fetch, whether it had to gather (some of the module's parameters were partitioned)."""

    def __init__(self) -> None:
        from helpers import called_by_ort_runtime

        self.by_ort: list[bool] = []
        self.backward_gathers = 0
        self._called_by_ort = called_by_ort_runtime
        self._fetch, self._fetch_backward = _deepspeed.fetch_for_forward, _deepspeed.fetch_for_backward
        _deepspeed.fetch_for_forward, _deepspeed.fetch_for_backward = self, self.backward

    def __call__(self, offload, module) -> None:
        self.by_ort.append(self._called_by_ort())
        self._fetch(offload, module)

    def backward(self, offload, module) -> None:
        self.backward_gathers += any(_deepspeed.is_partitioned(p) for p in _deepspeed.module_params(module))
        self._fetch_backward(offload, module)

    def take_backward_gathers(self) -> int:
        count, self.backward_gathers = self.backward_gathers, 0
        return count

    def remove(self) -> None:
        _deepspeed.fetch_for_forward, _deepspeed.fetch_for_backward = self._fetch, self._fetch_backward


def _train(mode: str, rank: int, world_size: int, stats_dir: Path, adam_eps: float) -> dict:
    """Train CONFIG's model for STEPS steps with ``mode`` hooks; record what the tests compare.

    Modes: "stock" (DeepSpeed's hooks), "probes", "probes+stats" (debug=True, dumping to
    ``stats_dir``), "probes+ort" (the model wrapped in ORTModule before deepspeed.initialize),
    "probes+ort+stats".
    """
    from deepspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=adam_eps)
    patch = None
    if mode != "stock":
        patch = configure_ort_compatible_zero_stage3(debug=mode.endswith("+stats"), stats_output_dir=stats_dir,
                                                     stats_overwrite=True)
    spy = _FetchSpy()
    try:
        wrapped = model
        if mode.startswith("probes+ort"):
            from onnxruntime.training.ortmodule import ORTModule

            wrapped = ORTModule(model)
        engine, *_ = deepspeed.initialize(model=wrapped, optimizer=optimizer, config=DS_CONFIG)
    finally:
        if patch is not None:
            patch.restore()

    names = [name for name, _ in model.named_parameters()]
    hook_calls = {name: 0 for name in names}

    def count_call(name: str):
        def hook(param: torch.Tensor) -> None:
            hook_calls[name] += 1
        return hook

    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(count_call(name))

    record = {"losses": [], "grads": [], "hook_calls": [], "partitioned": [], "shards": {}, "backward_gathers": []}
    for step in range(STEPS):
        batch = make_batch(CONFIG, batch_size=BATCH, seed=step * world_size + rank)
        loss = engine(batch["tokens"], labels=batch["labels"])
        spy.take_backward_gathers()
        engine.backward(loss)
        record["backward_gathers"].append(spy.take_backward_gathers())
        record["grads"].append({name: safe_get_full_grad(param).clone() for name, param in model.named_parameters()})
        record["hook_calls"].append(dict(hook_calls))
        hook_calls.update({name: 0 for name in names})
        engine.step()
        record["losses"].append(loss.item())
        record["partitioned"].append(all(param.data.numel() == 0 for param in model.parameters()))
    record["shards"] = {name: (p.ds_tensor.numel(), p.ds_numel) for name, p in model.named_parameters()}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        record["params"] = {name: param.detach().clone() for name, param in model.named_parameters()}
    record["fetches_by_ort"] = spy.by_ort
    spy.remove()
    record["hooks_before_destroy"] = hook_count(model)
    engine.destroy()
    record["hooks_after_destroy"] = hook_count(model)
    return record


def _worker(rank: int, world_size: int, port: int, out_dir: str, modes: list[str], adam_eps: float) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    _deepspeed.skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {mode: _train(mode, rank, world_size, Path(out_dir) / mode, adam_eps) for mode in modes}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(world_size: int, out_dir: Path, modes: list[str], adam_eps: float = 1e-8) -> list[dict]:
    """Spawn ``world_size`` ranks that each train every mode; return each rank's records."""
    torch.multiprocessing.start_processes(_worker, args=(world_size, _free_port(), str(out_dir), modes, adam_eps),
                                          nprocs=world_size, join=True, start_method="spawn")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def check_zero3_invariants(run: dict, world_size: int, label: str) -> None:
    """Partitioned outside forward (one numel / world_size shard per rank); every parameter got a
    non-zero gradient through autograd in every step; destroying the engine removed our hooks."""
    assert all(run["partitioned"]), label
    for name, (shard, numel) in run["shards"].items():
        assert shard == math.ceil(numel / world_size), (label, name)
    for step in range(STEPS):
        assert all(calls >= 1 for calls in run["hook_calls"][step].values()), (label, step, run["hook_calls"][step])
        assert all(grad.norm() > 0 for grad in run["grads"][step].values()), (label, step)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_probes_hooks_train_exactly_like_deepspeeds(tmp_path, world_size):
    modes = ["stock", "probes", "probes+stats"]
    for rank, results in enumerate(run_ranks(world_size, tmp_path, modes)):
        stock = results["stock"]
        assert len(stock["losses"]) == STEPS and len(set(stock["losses"])) > 1
        for mode in modes:
            run = results[mode]
            check_zero3_invariants(run, world_size, f"{mode} rank {rank}")
            assert not any(run["fetches_by_ort"]), mode
            assert run["hooks_after_destroy"] == stock["hooks_after_destroy"], mode  # DeepSpeed's engine keeps 2
            if mode == "stock":
                continue
            assert run["losses"] == stock["losses"], (mode, rank)
            for step in range(STEPS):
                for name, grad in stock["grads"][step].items():
                    assert torch.equal(run["grads"][step][name], grad), (mode, rank, step, name)
            for name, param in stock["params"].items():
                assert torch.equal(run["params"][name], param), (mode, rank, name)
    check_dumps(tmp_path / "probes+stats", world_size)


def check_dumps(stats_dir: Path, world_size: int) -> None:
    """debug=True dumped every step of every rank, each rank in its own directory."""
    for rank in range(world_size):
        steps = sorted((stats_dir / f"rank_{rank}").glob("step_*.parquet"))
        assert len(steps) == STEPS, (rank, steps)
        assert all(step.stat().st_size > 0 for step in steps)


_CLOSE_SCRIPT = """
import os, sys, warnings
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
import torch, deepspeed
from exporters.adapters import deepspeed_internals
from probes import SubscriberBase, SubscriberManager
from probes.zero3 import configure_ort_compatible_zero_stage3
deepspeed_internals.skip_shm_comm_build()
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
with configure_ort_compatible_zero_stage3():
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
loss = engine(torch.randn(2, 4)).sum()
engine.backward(loss)
engine.step()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if sys.argv[1] == "replace":
        SubscriberManager().subscribe(model, [SubscriberBase()])
    elif sys.argv[1] == "destroy":
        engine.destroy()
print("WARNINGS", sum("were unsubscribed" in str(w.message) for w in caught))
"""


@pytest.mark.slow
@pytest.mark.parametrize("case, expected", [("replace", 1), ("destroy", 0), ("exit", 0)])
def test_unsubscribing_a_live_engines_hooks_warns_but_destroy_and_exit_do_not(case, expected):
    import subprocess

    result = subprocess.run([sys.executable, "-c", _CLOSE_SCRIPT, case, str(_free_port())], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"WARNINGS {expected}" in result.stdout, (result.stdout[-2000:], result.stderr[-2000:])
    assert "were unsubscribed" not in result.stderr  # nothing more at exit
    assert "Traceback" not in result.stderr


# ZeRO-3 with probes' hooks under ORTModule trains like eager PyTorch with the same hooks: ORT runs the
# exported graph, including the gather/release PythonOps, on every step (FALLBACK_DISABLE, inherited by the
# spawned ranks, turns an export failure into an error), and every fetch of a training step comes from ORT.

# Adam's update m / (sqrt(v) + eps) turns gradients that are rounding noise (the key bias of
# attention has an exactly-zero true gradient) into full-size steps of random sign; a larger eps
# keeps that noise from dominating, so that eager and ORT kernels (equal to ~1e-7) stay comparable.
ADAM_EPS = 1e-4
MODULES = 28  # modules of the test transformer, each fetched once per forward


@pytest.mark.ort
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_ortmodule_trains_like_eager_with_probes_zero3_hooks(tmp_path, world_size):
    # Both runs also have debug=True: statistics probes next to the ZeRO-3 ones, dumped per rank.
    eager_mode, ort_mode = "probes+stats", "probes+ort+stats"
    for rank, results in enumerate(run_ranks(world_size, tmp_path, [eager_mode, ort_mode], ADAM_EPS)):
        eager, ort = results[eager_mode], results[ort_mode]
        check_zero3_invariants(eager, world_size, f"eager rank {rank}")
        check_zero3_invariants(ort, world_size, f"ort rank {rank}")
        # ORT's runtime made every fetch of the training steps; the rest are its export runs.
        assert not any(eager["fetches_by_ort"])
        assert sum(ort["fetches_by_ort"]) == STEPS * MODULES, len(ort["fetches_by_ort"])
        # Once DeepSpeed's trace is recorded (step 1 in eager; ORT's export runs spend step 0), parameters stay
        # gathered from forward to backward, as in eager: no module is gathered again in the backward.
        assert eager["backward_gathers"][0] > 0 and ort["backward_gathers"][0] > 0
        assert eager["backward_gathers"][1:] == [0] * (STEPS - 1), eager["backward_gathers"]
        assert ort["backward_gathers"][2:] == [0] * (STEPS - 2), ort["backward_gathers"]
        assert ort["losses"] == pytest.approx(eager["losses"], rel=1e-5), rank
        for step in range(STEPS):
            for name, grad in eager["grads"][step].items():
                torch.testing.assert_close(ort["grads"][step][name], grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")
        for name, param in eager["params"].items():
            torch.testing.assert_close(ort["params"][name], param, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        # Our hooks are gone (eager keeps 2 of DeepSpeed's engine on the model; with ORT they are on the wrapper).
        assert ort["hooks_after_destroy"] <= eager["hooks_after_destroy"] < eager["hooks_before_destroy"]
    for mode in (eager_mode, ort_mode):
        check_dumps(tmp_path / mode, world_size)
    # Every rank's statistics agree between eager and ORT (records are matched per rank).
    assert_parity(tmp_path / eager_mode, tmp_path / ort_mode, rtol=1e-3, atol=1e-5)
