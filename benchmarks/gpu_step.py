"""Training-step cost on a CUDA device: Hugging Face GPT-2 with and without probes, eager and compiled.

    python -m benchmarks.gpu_step [--quick]

Stages: build ``transformers.GPT2LMHeadModel`` (no download, dropout off) on the GPU, one copy per case
(no probes / StatisticsSubscriber, each eager and under ``torch.compile`` with inductor), time training
steps round-robin with the device synchronised around each step, and count the host synchronisations one
probed step makes (``torch.cuda.set_sync_debug_mode("warn")``). Reports medians against the unprobed step
of the same mode, and the peak device memory of each case. Without CUDA it reports that and measures nothing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import median, table
from benchmarks.gpu_overhead import _syncs
from probes import StatisticsSubscriber, SubscriberManager

FULL = {"n_layer": 6, "n_head": 8, "n_embd": 512, "seq": 256, "batch": 16}
QUICK = {"n_layer": 2, "n_head": 4, "n_embd": 128, "seq": 64, "batch": 4}


def _model(shape: dict[str, int]) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                                     vocab_size=1024, n_positions=shape["seq"], resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False, loss_type="ForCausalLM")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).cuda()


def run(quick: bool = False) -> str:
    title = "### GPU training step (CUDA, Hugging Face GPT-2)"
    if not torch.cuda.is_available():
        return f"{title}\n\nNo CUDA device on this machine: not measured."
    shape = QUICK if quick else FULL
    work = Path(tempfile.mkdtemp(prefix="probes-gpu-bench-"))
    tokens = torch.randint(0, 1024, (shape["batch"], shape["seq"]), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    rows = []
    for mode in ("eager", "compiled"):
        times: dict[str, list[float]] = {}
        memory: dict[str, int] = {}
        syncs: dict[str, int] = {}
        for case in ("no probes", "probes StatisticsSubscriber"):
            model = _model(shape)
            manager = None
            if case != "no probes":
                manager = SubscriberManager()
                manager.subscribe(model, [StatisticsSubscriber(work / f"{mode}", override_output_dir=True)])
            runner = torch.compile(model) if mode == "compiled" else model

            def step() -> None:
                model.zero_grad(set_to_none=True)
                runner(input_ids=tokens, labels=tokens).loss.backward()

            for _ in range(3):  # warm-up: compilation, allocator, the statistics kernel
                step()
            syncs[case] = _syncs(step)
            torch.cuda.reset_peak_memory_stats()
            samples = []
            for _ in range(5 if quick else 20):
                torch.cuda.synchronize()
                started = time.perf_counter()
                step()
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - started)
            times[case] = samples
            memory[case] = torch.cuda.max_memory_allocated()
            if manager is not None:
                manager.unsubscribe()
            del model, runner
            torch.cuda.empty_cache()
        plain = median(times["no probes"])
        for case, samples in times.items():
            rows.append([mode, case, f"{median(samples) * 1e3:.2f}", f"{median(samples) / plain:.2f}x",
                         f"{memory[case] / 2**20:.0f}", str(syncs[case])])
    device = torch.cuda.get_device_name()
    return (f"{title}\n\n{device}, torch {torch.__version__}; {shape['n_layer']} layers, n_embd {shape['n_embd']}, "
            f"seq {shape['seq']}, batch {shape['batch']}, fp32; medians of {5 if quick else 20} steps after 3 warm-up "
            "steps; host syncs counted over one step with torch.cuda.set_sync_debug_mode('warn').\n\n"
            + table(["mode", "case", "median ms", "/ no probes", "peak MiB", "host syncs / step"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(quick=parser.parse_args().quick))
