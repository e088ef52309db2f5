"""ZeRO-3 training-step time with probes' parameter hooks vs DeepSpeed's own hooks, in the same run.

    python -m benchmarks.zero3_bench [--quick] [--world-size N] [--repeats R]

Each rank (spawned processes, gloo over loopback, CPU, one thread each) builds two ZeRO-3 engines
from the same initial model: one with DeepSpeed's hooks and one created after
``configure_ort_compatible_zero_stage3()`` (plus, where ORTModule imports, one whose model is wrapped
in ORTModule). Their training steps (forward, backward, optimizer step) are timed round-robin, and
the median step time of each is reported relative to DeepSpeed's hooks.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch

from benchmarks.common import environment, interleaved, median, table
from probes.models import TinyTransformer, TransformerConfig, make_batch

FULL = TransformerConfig(vocab_size=1024, d_model=256, n_heads=8, n_layers=4, d_ff=1024, seq_len=128)
QUICK = TransformerConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=256, seq_len=32)
BATCH = 8
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
STOCK = "DeepSpeed hooks"
PROBES = "probes hooks"
PROBES_ORT = "probes hooks + ORTModule"


def _ortmodule_class() -> type | None:
    try:
        from onnxruntime.training.ortmodule import ORTModule
    except Exception:  # not installed, or not runnable on this torch
        return None
    return ORTModule


def _engine(config: TransformerConfig, case: str):
    import deepspeed

    from probes.zero3 import configure_ort_compatible_zero_stage3

    torch.manual_seed(0)
    model = TinyTransformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    wrapped = _ortmodule_class()(model) if case == PROBES_ORT else model
    if case == STOCK:
        engine, *_ = deepspeed.initialize(model=wrapped, optimizer=optimizer, config=DS_CONFIG)
    else:
        with configure_ort_compatible_zero_stage3():
            engine, *_ = deepspeed.initialize(model=wrapped, optimizer=optimizer, config=DS_CONFIG)
    return engine


def _step(engine, batch: dict[str, torch.Tensor]):
    def run() -> None:
        loss = engine(batch["tokens"], labels=batch["labels"])
        engine.backward(loss)
        engine.step()
    return run


def _worker(rank: int, world_size: int, port: int, config: TransformerConfig, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu", ORTMODULE_FALLBACK_POLICY="FALLBACK_DISABLE")
    import deepspeed
    from exporters import _deepspeed_compat as _deepspeed

    _deepspeed.skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    cases = [STOCK, PROBES] + ([PROBES_ORT] if _ortmodule_class() is not None else [])
    batch = make_batch(config, batch_size=BATCH, seed=rank)
    steps = {case: _step(_engine(config, case), batch) for case in cases}
    # The warm-up steps include ORTModule's export and session build.
    times = interleaved(steps, repeats=repeats, warmup=2)
    if rank == 0:
        torch.save(times, out)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(config: TransformerConfig, world_size: int, repeats: int) -> dict[str, list[float]]:
    """Per-step times (seconds) of each case on rank 0."""
    with tempfile.TemporaryDirectory(prefix="probes-zero3-bench-") as work:
        out = str(Path(work) / "times.pt")
        torch.multiprocessing.start_processes(_worker, args=(world_size, _free_port(), config, repeats, out),
                                              nprocs=world_size, join=True, start_method="spawn")
        return torch.load(out, weights_only=False)


def run(quick: bool = False, world_sizes: tuple[int, ...] | None = None, repeats: int | None = None) -> str:
    torch.set_num_threads(1)  # as in the ranks (the environment line reports this process)
    config = QUICK if quick else FULL
    repeats = repeats or (5 if quick else 15)
    world_sizes = world_sizes or ((1,) if quick else (1, 2))
    rows = []
    for world_size in world_sizes:
        times = measure(config, world_size, repeats)
        baseline = median(times[STOCK])
        rows += [[world_size, case, f"{median(t) * 1e3:.1f}", f"{min(t) * 1e3:.1f}", f"{median(t) / baseline:.2f}x"]
                 for case, t in times.items()]
    modules = len(list(TinyTransformer(config).modules()))
    return (f"### DeepSpeed ZeRO-3 training step: probes' hooks vs DeepSpeed's ({'quick' if quick else 'full'}: "
            f"d_model {config.d_model}, layers {config.n_layers}, seq {config.seq_len}, batch {BATCH} per rank, "
            f"{modules} modules, stage3_param_persistence_threshold 0, Adam, gloo on CPU, {repeats} interleaved "
            f"repeats)\n\n{environment()}\n\n"
            + table(["ranks", "case", "median ms", "min ms", "median / DeepSpeed hooks"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero3_bench")
    parser.add_argument("--quick", action="store_true", help="small model, 5 repeats, one rank")
    parser.add_argument("--world-size", type=int, action="append", help="ranks (repeatable; default 1 and 2)")
    parser.add_argument("--repeats", type=int)
    arguments = parser.parse_args()
    print(run(arguments.quick, tuple(arguments.world_size) if arguments.world_size else None, arguments.repeats))
