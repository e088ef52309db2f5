"""Probes on every module and every step of a GPT-2-small-class model on CUDA: step time, peak memory, host syncs.

    python -m benchmarks.gpu_overhead [--quick] [--fp32]

Stages: build ``transformers.GPT2LMHeadModel`` with GPT-2 small's shape (12 layers, n_embd 768, 12 heads,
vocab 50257, n_positions 1024; dropout off, no download) on the GPU, a copy with a ``StatisticsSubscriber``
(every module, every step, into a temporary directory) and one without; time training steps
(zero_grad, forward under bf16 autocast (``--fp32``: none), ``loss.backward()``, ``torch.cuda.synchronize()``)
of the two round-robin (``benchmarks.common.interleaved``); then per case the peak device memory of one
step above the memory held before it (``torch.cuda.max_memory_allocated``, reset between), and the host
syncs of one step (``torch.cuda.set_sync_debug_mode("warn")``, each sync one warning). A third copy has a StatisticsSubscriber whose
selection leaves every step out: what an unrecorded step costs. Not in the default
``python -m benchmarks`` list (like ``benchmarks.gpu_step``): without CUDA it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import interleaved, median, table

FULL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq": 512, "batch": 4, "repeats": 20}
QUICK = {"n_layer": 2, "n_head": 12, "n_embd": 768, "seq": 128, "batch": 2, "repeats": 3}
TITLE = "### GPU overhead of probes on every module (CUDA, GPT-2 small class)"


def _model(shape: dict[str, int]) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                                     n_positions=1024, vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False, loss_type="ForCausalLM")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).cuda()


def _syncs(step: Callable[[], None]) -> int:
    """Host synchronisations one call of ``step`` makes (one warning each in "warn" mode; any thread)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _peak_mib(step: Callable[[], None]) -> float:
    """Peak device memory of one step above what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resting = torch.cuda.memory_allocated()
    step()
    return (torch.cuda.max_memory_allocated() - resting) / 2**20


def run(quick: bool = False, bf16: bool = True) -> str:
    if not torch.cuda.is_available():
        return f"{TITLE}\n\nnot measured: no CUDA device."
    from probes import StatisticsSubscriber, SubscriberManager, load_dump

    shape = QUICK if quick else FULL
    work = Path(tempfile.mkdtemp(prefix="probes-gpu-overhead-"))
    tokens = torch.randint(0, 50257, (shape["batch"], shape["seq"]), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    plain = _model(shape)
    probed = copy.deepcopy(plain)
    manager = SubscriberManager()
    manager.subscribe(probed, [StatisticsSubscriber(work / "dump", override_output_dir=True)])
    left_out = copy.deepcopy(plain)  # a step the statistics leave out: should cost nothing measurable
    left_out_manager = SubscriberManager()
    left_out_manager.subscribe(left_out, [StatisticsSubscriber(work / "left_out", steps=[10**12])])

    def step_of(model: torch.nn.Module, sync: bool = True) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            with autocast:
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if sync:
                torch.cuda.synchronize()
        return step

    steps = {"no probes": step_of(plain), "probes (StatisticsSubscriber, every module)": step_of(probed),
             "probes, a left-out step (StatisticsSubscriber(steps=[never]))": step_of(left_out)}
    try:
        times = interleaved(steps, repeats=shape["repeats"], warmup=3)
        peaks = {name: _peak_mib(step) for name, step in steps.items()}
        # without the step's own torch.cuda.synchronize(), so that only the model's and the probes' syncs count
        syncs = {name: _syncs(step_of(model, sync=False))
                 for name, model in zip(steps, (plain, probed, left_out))}
    finally:
        manager.unsubscribe()
        left_out_manager.unsubscribe()
    records = load_dump(work / "dump")
    per_step = len(records) / max(1, len({record["step"] for record in records}))
    base = median(times["no probes"])
    rows = [[name, f"{median(values) * 1e3:.1f}", f"{median(values) / base:.2f}x", f"{peaks[name]:.0f}", syncs[name]]
            for name, values in times.items()]
    return (f"{TITLE}\n\n`python -m benchmarks.gpu_overhead{' --quick' if quick else ''}`: "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {shape['n_layer']} layers, n_embd "
            f"{shape['n_embd']}, {shape['n_head']} heads, vocab 50257, seq {shape['seq']}, batch {shape['batch']}, "
            f"{'bf16 autocast' if bf16 else 'fp32'}; medians of {shape['repeats']} steps (each ending in "
            f"torch.cuda.synchronize()) after 3 warm-up steps, the cases interleaved; {per_step:.0f} records per "
            "probed step; peak = max_memory_allocated of one step above the memory held before it; host syncs "
            "counted over one step (without its final synchronize) with torch.cuda.set_sync_debug_mode('warn').\n\n"
            + table(["case", "median ms", "/ no probes", "step peak MiB", "host syncs / step"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_overhead")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fp32", action="store_true", help="no autocast (default: bf16 autocast)")
    arguments = parser.parse_args()
    print(run(quick=arguments.quick, bf16=not arguments.fp32))
