"""What op-level records (``ops=``) cost: a Hugging Face GPT-2 training step with its attentions drilled into.

    python -m benchmarks.ops_overhead [--quick]

Stages: build ``transformers.GPT2LMHeadModel`` from a config in code (eager attention, so that the attention's
operations are torch calls of its own; dropout off), one copy per case (no probes; module records; module records
and the operations of one attention; of every attention; the operations selected, in a step left out), time
training steps round-robin and report each against the unprobed step and the module records of the same run;
then the peak resident memory of each case in a fresh process (Linux ``VmHWM``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import environment, interleaved, median, peak_rss, ratio_spread, table
from probes import StatisticsSubscriber, SubscriberManager
from probes.dump.live import flush_writers

FULL = {"n_layer": 6, "n_head": 4, "n_embd": 128, "seq": 64, "batch": 4}
QUICK = {"n_layer": 2, "n_head": 2, "n_embd": 32, "seq": 16, "batch": 2}
NEVER = 10**12
CASES: dict[str, dict | None] = {
    "no probes": None,
    "module records": {},
    "+ ops of one attention (transformer.h.0.attn)": {"ops": "transformer.h.0.attn"},
    "+ ops of every attention (transformer.h.*.attn)": {"ops": "transformer.h.*.attn"},
    "ops of every attention, a left-out step": {"ops": "transformer.h.*.attn", "steps": [NEVER]},
}
BASELINE = "module records"


def _case(shape: dict[str, int], options: dict | None, dump: Path) -> tuple[Callable[[], None], SubscriberManager | None]:
    import transformers

    config = transformers.GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                                     vocab_size=256, n_positions=shape["seq"], resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 256, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    manager = None
    if options is not None:
        manager = SubscriberManager()
        manager.subscribe(model, [StatisticsSubscriber(dump, **options)])

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        if manager is not None:  # the writer's work for this step is counted here
            flush_writers(dump)
    return step, manager


def _case_from_json(config: str, case: str, dump: Path) -> tuple[Callable[[], None], SubscriberManager | None]:
    """``_case`` from its arguments as text (``common.peak_rss``'s fresh process)."""
    return _case(json.loads(config), CASES[case], dump)


def run(quick: bool = False) -> str:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "### Op-level records (ops=)\n\ntransformers is not installed: not measured."
    torch.set_num_threads(1)
    shape = QUICK if quick else FULL
    repeats = 3 if quick else 15
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    built = {name: _case(shape, options, work / f"case-{index}") for index, (name, options) in enumerate(CASES.items())}
    times = interleaved({name: step for name, (step, _) in built.items()}, repeats=repeats, warmup=2)
    for _, manager in built.values():
        if manager is not None:
            manager.unsubscribe()
    rss = {name: peak_rss("benchmarks.ops_overhead", name, json.dumps(shape), 3 if quick else 8, work / f"rss-{index}")
           for index, name in enumerate(CASES)}
    plain, base = times["no probes"], times[BASELINE]
    rows = [[name, f"{median(samples) * 1e3:.1f}", f"{median(samples) / median(plain):.2f}x",
             ratio_spread(samples, plain), f"{median(samples) / median(base):.2f}x",
             f"{rss[name] / 2**20:.1f}", f"{(rss[name] - rss['no probes']) / 2**20:+.1f}"]
            for name, samples in times.items()]
    return (f"### Op-level records (ops=): GPT-2 (Hugging Face, eager attention) training step "
            f"({'quick' if quick else 'full'}: {shape['n_layer']} layers, n_embd {shape['n_embd']}, seq "
            f"{shape['seq']}, batch {shape['batch']}, {repeats} interleaved repeats)\n\n"
            + table(["case", "median ms", "/ no probes", "per-round ratio: median (quartiles)", "/ module records",
                     "peak RSS MiB", "vs no probes MiB"], rows)
            + f"\n\nA step includes the writer's work for the step. {environment()}\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
