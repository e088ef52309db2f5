"""Training-step cost on a Hugging Face GPT-2 built from a tiny config: many small modules.

    python -m benchmarks.gpt2_overhead [--quick]

Stages: build ``transformers.GPT2LMHeadModel`` from a config in code (no download, dropout off), one copy
per case (no probes; probes with a no-op observing subscriber, the manager's own cost; probes' StatisticsSubscriber
in a step it leaves out, recording every step with its rows computed but not written (the dump writer's share
is the difference), and recording every step; the no-op and recording cases again with the Python probe
Function in eager calls, ``PROBES_PROBE_BACKEND=python``; the original onnxruntime StatisticsSubscriber where
onnxruntime-training is installed), time eager training steps round-robin, report each median against
the unprobed step of the same run.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch

from benchmarks.common import environment, interleaved, median, python_probes, ratio_spread, table
from benchmarks.probe_overhead import NoOp
from benchmarks.step_overhead import _original_subscribe
from probes import StatisticsSubscriber, SubscriberManager
from probes.dump.live import flush_writers

FULL = {"n_layer": 6, "n_head": 4, "n_embd": 128, "seq": 64, "batch": 4}
STEPS_PER_TIMING = 4  # back to back, as in training: the dump writer works while the next step runs
QUICK = {"n_layer": 2, "n_head": 2, "n_embd": 32, "seq": 16, "batch": 2}


def _model(shape: dict[str, int]) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                                     vocab_size=256, n_positions=shape["seq"], resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def rows_not_written(output_dir: Path) -> StatisticsSubscriber:
    """A StatisticsSubscriber whose rows are computed on the training thread but never written: the dump
    writer's share of a step is the difference to one that writes them."""
    subscriber = StatisticsSubscriber(output_dir)
    subscriber._writer.write = lambda step, batch: None  # (private: no public switch for this, on purpose)
    return subscriber


def run(quick: bool = False) -> str:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "### GPT-2 (Hugging Face) training step\n\ntransformers is not installed: not measured."
    torch.set_num_threads(1)
    shape = QUICK if quick else FULL
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    base = _model(shape)
    tokens = torch.randint(0, 256, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    cases: dict[str, torch.nn.Module] = {"no probes": base}
    managers = []
    ours = copy.deepcopy(base)
    # The manager's own cost (hooks, probe Functions, step tracking), and a step the statistics leave out.
    for name, subscriber in (("probes, no-op subscriber", NoOp()),
                             ("probes StatisticsSubscriber, a left-out step (steps=[never])",
                              StatisticsSubscriber(work / "left_out", steps=[10**12]))):
        cases[name] = copy.deepcopy(base)
        managers.append(SubscriberManager())
        managers[-1].subscribe(cases[name], [subscriber])
    unwritten = cases["probes StatisticsSubscriber, rows not written"] = copy.deepcopy(base)
    managers.append(SubscriberManager())
    managers[-1].subscribe(unwritten, [rows_not_written(work / "unwritten")])
    managers.append(SubscriberManager())
    managers[-1].subscribe(ours, [StatisticsSubscriber(work / "ours")])
    cases["probes StatisticsSubscriber"] = ours
    # The same two with the Python probe Function in eager calls (the C++ probe's gain, in the same run).
    for name, subscriber in (("probes, no-op subscriber, Python Function", NoOp()),
                             ("probes StatisticsSubscriber, Python Function", StatisticsSubscriber(work / "python"))):
        cases[name] = copy.deepcopy(base)
        managers.append(SubscriberManager())
        with python_probes():
            managers[-1].subscribe(cases[name], [subscriber])
    original = copy.deepcopy(base)
    if _original_subscribe(original, work / "original") is not None:
        cases["original onnxruntime StatisticsSubscriber"] = original
    failed: dict[str, str] = {}
    written = {"probes StatisticsSubscriber": "ours", "probes StatisticsSubscriber, Python Function": "python"}

    def step(name: str, model: torch.nn.Module):
        def run_step() -> None:
            if name in failed:
                return
            try:
                for _ in range(STEPS_PER_TIMING):
                    model.zero_grad(set_to_none=True)
                    model(input_ids=tokens, labels=tokens).loss.backward()
                if name in written:  # the dump writer's work for these steps is counted here, not in the next case
                    flush_writers(work / written[name])
            except Exception as error:  # the original hooks may not handle a model: say so, measure the rest
                failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
        return run_step

    times = {name: [value / STEPS_PER_TIMING for value in values] for name, values in
             interleaved({name: step(name, model) for name, model in cases.items()}, repeats=3 if quick else 15).items()}
    for manager in managers:
        manager.unsubscribe()
    modules = len(list(base.modules()))
    records = len(list((work / "ours").rglob("*.parquet")))
    plain = median(times["no probes"])
    rows = [[name, "failed: " + failed[name] if name in failed else f"{median(samples) * 1e3:.1f}",
             "" if name in failed else f"{median(samples) / plain:.2f}x",
             "" if name in failed else ratio_spread(samples, times["no probes"])] for name, samples in times.items()]
    return (f"### GPT-2 (Hugging Face) training step, eager ({'quick' if quick else 'full'}: {shape['n_layer']} "
            f"layers, n_embd {shape['n_embd']}, seq {shape['seq']}, batch {shape['batch']}, {modules} modules, "
            f"{records} steps dumped)\n\n{environment()}\n\n"
            + table(["case", "median ms", "/ no probes", "per-round ratio: median (quartiles)"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
