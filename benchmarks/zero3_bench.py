"""ZeRO-3 training-step time with probes' parameter hooks vs DeepSpeed's own hooks, in the same run.

    python -m benchmarks.zero3_bench [--quick] [--world-size N] [--repeats R] [--ort-defaults]

Each rank (spawned processes, gloo over loopback, CPU) builds two ZeRO-3 engines from the same
initial model: one with DeepSpeed's hooks and one created after ``configure_ort_compatible_zero_stage3()``
(plus, where ORTModule imports, one whose model is wrapped in ORTModule). Their training steps
(forward, backward, optimizer step) are timed round-robin, and the median step time of each is
reported relative to DeepSpeed's hooks, with the quartiles of the per-round ratios.

Every case gets the same thread budget per rank: the cores this process may use divided by the
ranks, for PyTorch (``torch.set_num_threads``) and for ORT's intra-op pool, whose workers sleep
instead of spinning (they share the cores with PyTorch's pool, which runs the PythonOps and the
optimizer). ``--ort-defaults`` leaves ORT's session as ORTModule builds it (one spinning worker per
physical core in every rank) to show what that costs.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch

from benchmarks.common import environment, interleaved, median, ratio_spread, table
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


def threads_per_rank(world_size: int) -> int:
    """The fair budget: the cores this process may use, shared out evenly among the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def _worker(rank: int, world_size: int, port: int, config: TransformerConfig, repeats: int, out: str,
            ort_defaults: bool) -> None:
    threads = threads_per_rank(world_size)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu", ORTMODULE_FALLBACK_POLICY="FALLBACK_DISABLE")
    import deepspeed
    from exporters.adapters import deepspeed_internals as _deepspeed

    _deepspeed.skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    cases = [STOCK, PROBES] + ([PROBES_ORT] if _ortmodule_class() is not None else [])
    if PROBES_ORT in cases and not ort_defaults:
        import exporters

        # Before the first step, which builds ORT's session. Held until the process ends.
        exporters.ortmodule_threads(threads)
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


def measure(config: TransformerConfig, world_size: int, repeats: int, ort_defaults: bool = False) -> dict[str, list[float]]:
    """Per-step times (seconds) of each case on rank 0."""
    with tempfile.TemporaryDirectory(prefix="probes-zero3-bench-") as work:
        out = str(Path(work) / "times.pt")
        torch.multiprocessing.start_processes(
            _worker, args=(world_size, _free_port(), config, repeats, out, ort_defaults),
            nprocs=world_size, join=True, start_method="spawn")
        return torch.load(out, weights_only=False)


def run(quick: bool = False, world_sizes: tuple[int, ...] | None = None, repeats: int | None = None,
        ort_defaults: bool = False) -> str:
    config = QUICK if quick else FULL
    repeats = repeats or (5 if quick else 15)
    world_sizes = world_sizes or ((1,) if quick else (1, 2))
    rows = []
    for world_size in world_sizes:
        times = measure(config, world_size, repeats, ort_defaults)
        baseline = times[STOCK]
        rows += [[world_size, threads_per_rank(world_size), case, f"{median(t) * 1e3:.1f}",
                  f"{median(t) / median(baseline):.2f}x", ratio_spread(t, baseline)]
                 for case, t in times.items()]
    modules = len(list(TinyTransformer(config).modules()))
    ort = ("ORT's intra-op pool as ORTModule builds it (one spinning worker per physical core in every rank)"
           if ort_defaults else "the same number of ORT intra-op threads, ORT spinning off")
    return (f"### DeepSpeed ZeRO-3 training step: probes' hooks vs DeepSpeed's ({'quick' if quick else 'full'}: "
            f"d_model {config.d_model}, layers {config.n_layers}, seq {config.seq_len}, batch {BATCH} per rank, "
            f"{modules} modules, stage3_param_persistence_threshold 0, Adam, gloo on CPU, {repeats} interleaved "
            f"repeats; thread budget per rank: cores // ranks torch threads, {ort})\n\n{environment()}\n\n"
            + table(["ranks", "threads per rank", "case", "median ms", "median / DeepSpeed hooks",
                     "per-round ratio: median (quartiles)"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero3_bench")
    parser.add_argument("--quick", action="store_true", help="small model, 5 repeats, one rank")
    parser.add_argument("--world-size", type=int, action="append", help="ranks (repeatable; default 1 and 2)")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--ort-defaults", action="store_true",
                        help="leave ORT's intra-op pool as ORTModule builds it (spinning, one thread per core)")
    arguments = parser.parse_args()
    print(run(arguments.quick, tuple(arguments.world_size) if arguments.world_size else None, arguments.repeats,
              arguments.ort_defaults))
