"""Training-step cost of the StatisticsSubscriber vs no probes vs the original onnxruntime hooks.

    python -m benchmarks.step_overhead [--quick] [--ort-default-threads]

Eager PyTorch and ORTModule on the CPU, one thread: the 4-layer transformer of shared/ENVIRONMENT.md
(d_model 256, seq 128, batch 8) and a narrower one (d_model 128). Every case trains its own copy of
the same model; the cases are timed round-robin and reported as the median step time relative to
the unprobed step of the same backend and of eager PyTorch (with the median and quartiles of the per-round ratios),
with the dump volume per step.

One thread means one for ORT too: ORTModule's sessions get one intra-op thread that does not spin
(``ortmodule_budget``), as PyTorch gets ``torch.set_num_threads(1)``. ORT's default, one spinning
thread per core, makes its idle threads compete with the one running the graph and its PythonOps on a
machine whose cores are busy (``--ort-default-threads`` measures it that way).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # a failed export must not time PyTorch

import torch

from benchmarks.common import environment, interleaved, median, ratio_spread, table
import exporters
from exporters.adapters import ort_internals
from probes.dump.live import flush_writers
from probes import StatisticsSubscriber, SubscriberManager
from probes.models import TinyTransformer, TransformerConfig, make_batch

FULL = TransformerConfig(vocab_size=1024, d_model=256, n_heads=8, n_layers=4, d_ff=1024, seq_len=128)
SMALL = TransformerConfig(vocab_size=1024, d_model=128, n_heads=4, n_layers=4, d_ff=512, seq_len=128)
QUICK = TransformerConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=256, seq_len=32)


def _original_subscribe(model: torch.nn.Module, output_dir: Path) -> object | None:
    """Subscribes onnxruntime's own StatisticsSubscriber; None where it is not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from onnxruntime.training.utils.hooks import StatisticsSubscriber as Original
            from onnxruntime.training.utils.hooks._subscriber_manager import SubscriberManager as OriginalManager
    except Exception:
        return None
    manager = OriginalManager()
    manager.subscribe(model, [Original(str(output_dir), override_output_dir=True)])
    return manager


@contextlib.contextmanager
def ortmodule_budget(default_threads: bool = False) -> Iterator[str]:
    """ORTModule sessions built inside get one intra-op thread, not spinning (unless ``default_threads``);
    yields the description for the benchmark's header."""
    if default_threads or not ort_internals.is_onnxruntime_installed():
        yield "ORT intra-op threads: ORT's default (one per core, spinning)"
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import onnxruntime.training.ortmodule  # noqa: F401
    with exporters.ortmodule_threads(1):
        yield "ORT intra-op threads 1, no spinning"


def _ortmodule(model: torch.nn.Module) -> torch.nn.Module | None:
    try:
        from onnxruntime.training.ortmodule import ORTModule
    except Exception:
        return None
    return ORTModule(model)


def _bytes_per_step(directory: Path, steps: int) -> str:
    total = sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
    return f"{total / steps / 1024:.0f}"


def _measure(config: TransformerConfig, repeats: int, work: Path) -> list[list[object]]:
    torch.manual_seed(0)
    base = TinyTransformer(config)
    batch = make_batch(config, batch_size=8, seed=0)
    managers = []
    cases: dict[tuple[str, str], torch.nn.Module] = {}
    dumps: dict[tuple[str, str], Path] = {}
    for backend in ("eager", "ortmodule"):
        for case in ("no probes", "probes StatisticsSubscriber", "original onnxruntime StatisticsSubscriber"):
            model = copy.deepcopy(base)
            dump = work / f"d{config.d_model}-{backend}-{case.split()[0]}"
            if case.startswith("probes"):
                managers.append(SubscriberManager())
                managers[-1].subscribe(model, [StatisticsSubscriber(dump)])
            elif case.startswith("original") and _original_subscribe(model, dump) is None:
                continue
            if backend == "ortmodule":
                model = _ortmodule(model)
                if model is None:
                    continue
            cases[(backend, case)] = model
            dumps[(backend, case)] = dump

    def step(model: torch.nn.Module, dump: Path | None):
        def run_step() -> None:
            model.zero_grad(set_to_none=True)
            model(batch["tokens"], labels=batch["labels"]).backward()
            if dump is not None:  # the dump writer's work for this step is counted here, not in the next case
                flush_writers(dump)
        return run_step

    warmup = 2
    times = interleaved({key: step(model, dumps[key] if key[1].startswith("probes") else None)
                         for key, model in cases.items()}, repeats=repeats, warmup=warmup)
    for manager in managers:
        manager.unsubscribe()
    rows = []
    eager_base = median(times[("eager", "no probes")])
    for (backend, case), samples in times.items():
        baseline = times[(backend, "no probes")]
        dump = dumps[(backend, case)]
        rows.append([f"d_model {config.d_model}", backend, case, f"{median(samples) * 1e3:.1f}",
                     f"{median(samples) / median(baseline):.2f}x", ratio_spread(samples, baseline),
                     f"{median(samples) / eager_base:.2f}x",
                     _bytes_per_step(dump, warmup + repeats) if dump.exists() else ""])
    return rows


def run(quick: bool = False, ort_default_threads: bool = False) -> str:
    torch.set_num_threads(1)
    configs = (QUICK,) if quick else (SMALL, FULL)
    repeats = 3 if quick else 15
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    with ortmodule_budget(ort_default_threads) as threads:
        rows = [row for config in configs for row in _measure(config, repeats, work)]
    modules = len(list(TinyTransformer(configs[-1]).modules()))
    return (f"### Training step, eager and ORTModule ({'quick' if quick else 'full'}: layers {configs[-1].n_layers}, "
            f"seq {configs[-1].seq_len}, batch 8, {modules} modules probed, {repeats} interleaved repeats)\n\n"
            f"{environment()}, {threads}\n\n"
            + table(["model", "backend", "case", "median ms", "/ no probes (same backend)", "per-round ratio: median (quartiles)",
                     "/ eager no probes", "dump KiB / step"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ort-default-threads", action="store_true",
                        help="ORTModule with ORT's default threads (one per core, spinning) instead of one")
    arguments = parser.parse_args()
    print(run(arguments.quick, arguments.ort_default_threads))
