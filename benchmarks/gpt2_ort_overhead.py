"""Training-step cost of probes on a Hugging Face GPT-2 under ORTModule (CPU, one thread).

    python -m benchmarks.gpt2_ort_overhead [--quick] [--repeats N] [--ort-default-threads]

Stages: build ``transformers.GPT2LMHeadModel`` from a config in code (``benchmarks.gpt2_overhead``: no
download, dropout off), one copy per case, each wrapped in ORTModule (fallback disabled: a failed export
raises instead of timing PyTorch): no probes; probes with a no-op observing subscriber (the probes' own cost:
ORT's PythonOp calls); probes' StatisticsSubscriber recording every step, with its rows computed but not
written (the dump writer's share is the difference) and written; the
same subscriber with ``every_n_steps`` so large that no timed step is recorded (the cost of a step left
out: it runs on ORT's second graph, exported without probes, at its first left-out step, also timed); and the
eager model with and without probes for reference. Cases are timed round-robin; each
median is reported against the unprobed step of the same backend, with the spread (median and quartiles of the
per-round ratios against the baseline timed in the same round). ORT gets the thread budget PyTorch gets,
one intra-op thread, not spinning (``benchmarks.step_overhead.ortmodule_budget``).
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # a failed export must not time PyTorch

import torch

from benchmarks.common import environment, interleaved, median, ratio_spread, table
from benchmarks.gpt2_overhead import FULL, QUICK, STEPS_PER_TIMING, _model, rows_not_written
from benchmarks.probe_overhead import NoOp
from benchmarks.step_overhead import _ortmodule, ortmodule_budget
from probes import StatisticsSubscriber, SubscriberManager
from probes.dump.live import flush_writers

NEVER = 10**9  # every_n_steps: after step 0 (a warm-up step) no step is recorded
_CASES = ("no probes", "no-op subscriber", "StatisticsSubscriber, rows not written", "StatisticsSubscriber",
          "StatisticsSubscriber, step left out")


def run(quick: bool = False, repeats: int | None = None, ort_default_threads: bool = False) -> str:
    with ortmodule_budget(ort_default_threads) as threads:
        return _run(quick, repeats, threads)


def _run(quick: bool, repeats: int | None, threads: str) -> str:
    title = "### GPT-2 (Hugging Face) training step under ORTModule"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return f"{title}\n\ntransformers is not installed: not measured."
    torch.set_num_threads(1)
    shape = QUICK if quick else FULL
    repeats = repeats or (3 if quick else 9)
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    base = _model(shape)
    tokens = torch.randint(0, 256, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    cases: dict[tuple[str, str], torch.nn.Module] = {}
    dumps: dict[tuple[str, str], Path] = {}
    managers = []
    for backend in ("ortmodule", "eager"):
        for case in _CASES if backend == "ortmodule" else ("no probes", "StatisticsSubscriber"):
            model = copy.deepcopy(base)
            if case == "no-op subscriber":
                managers.append(SubscriberManager())
                managers[-1].subscribe(model, [NoOp()])
            elif case != "no probes":
                dump = work / f"{backend}-{len(managers)}"
                if case.endswith("not written"):
                    subscriber = rows_not_written(dump)
                else:
                    subscriber = StatisticsSubscriber(dump, every_n_steps=NEVER if case.endswith("left out") else None)
                    dumps[(backend, case)] = dump
                managers.append(SubscriberManager())
                managers[-1].subscribe(model, [subscriber])
            if backend == "ortmodule":
                model = _ortmodule(model)
                if model is None:
                    return f"{title}\n\nonnxruntime-training is not installed: not measured."
            cases[(backend, case)] = model

    def step(key: tuple[str, str], model: torch.nn.Module):
        dump = dumps.get(key)

        def run_step() -> None:
            for _ in range(STEPS_PER_TIMING):
                model.zero_grad(set_to_none=True)
                model(input_ids=tokens, labels=tokens).loss.backward()
            if dump is not None:  # the dump writer's work for these steps is counted here, not in the next case
                flush_writers(dump)
        return run_step

    def first_steps(model: torch.nn.Module) -> str:
        """The first two steps, timed one by one: each exports the graph it is the first to run."""
        seconds = []
        for _ in range(2):
            started = time.perf_counter()
            model.zero_grad(set_to_none=True)
            model(input_ids=tokens, labels=tokens).loss.backward()
            seconds.append(time.perf_counter() - started)
        return " / ".join(f"{value:.2f}" for value in seconds)

    first = {case: first_steps(model) for (backend, case), model in cases.items() if backend == "ortmodule"}
    times = interleaved({key: step(key, model) for key, model in cases.items()}, repeats=repeats)
    for manager in managers:
        manager.unsubscribe()
    rows = []
    for (backend, case), samples in times.items():
        baseline = times[(backend, "no probes")]
        rows.append([backend, case, f"{median(samples) / STEPS_PER_TIMING * 1e3:.2f}",
                     f"{median(samples) / median(baseline):.3f}x", ratio_spread(samples, baseline)])
    modules = len(list(base.modules()))
    return (f"{title} ({'quick' if quick else 'full'}: {shape['n_layer']} layers, n_embd {shape['n_embd']}, "
            f"seq {shape['seq']}, batch {shape['batch']}, {modules} modules probed, {repeats} interleaved repeats "
            f"of {STEPS_PER_TIMING} steps)\n\n{environment()}, {threads}\n\n"
            + table(["backend", "case", "median ms / step", "/ no probes (same backend)", "per-round ratio: median (quartiles)"],
                    rows)
            + "\n\nFirst two ORTModule steps of each case, in s (an export, then a step that reuses it; with steps "
            "left out, step 1 is the first left out and exports the graph without probes): "
            + "; ".join(f"{case}: {seconds}" for case, seconds in first.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--ort-default-threads", action="store_true",
                        help="ORTModule with ORT's default threads (one per core, spinning) instead of one")
    arguments = parser.parse_args()
    print(run(arguments.quick, arguments.repeats, arguments.ort_default_threads))
