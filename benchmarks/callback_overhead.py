"""Cost of the Hugging Face Trainer callback over subscribing by hand, and of both over no probes.

    python -m benchmarks.callback_overhead [--quick]

One ``trainer.train()`` of a GPT-2 built from a small config (no download) on the CPU, one thread, per
sample; cases timed round-robin:
- no probes;
- ``SubscriberManager().subscribe(model, [StatisticsSubscriber(out)])`` made before ``train()`` and
  removed after it (both inside the timing);
- ``ProbesCallback(out)`` (subscribes at train begin, pauses outside training steps, appends the
  trainer step map at each update, unsubscribes at train end).
Every case builds its Trainer outside the timing. The figure that matters is callback / by hand.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import transformers

from benchmarks.common import environment, median, table
from probes import StatisticsSubscriber, SubscriberManager
from probes.integrations.transformers import ProbesCallback

FULL = dict(n_layer=4, n_head=4, n_embd=128, seq=64, steps=20, repeats=9)
QUICK = dict(n_layer=2, n_head=2, n_embd=32, seq=16, steps=3, repeats=2)


def _gpt2(size: dict) -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=size["n_layer"], n_head=size["n_head"], n_embd=size["n_embd"],
                                     vocab_size=256, n_positions=size["seq"], resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _prepare(kind: str, size: dict, data: list, out: Path) -> Callable[[], None]:
    """The Trainer of one sample, built; returns what is timed (training, and subscribing by hand)."""
    model = _gpt2(size)
    args = transformers.TrainingArguments(output_dir=str(out.parent / "hf"), per_device_train_batch_size=4,
                                          max_steps=size["steps"], use_cpu=True, report_to=[], save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True)
    callbacks = [ProbesCallback(out)] if kind == "ProbesCallback" else []
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(transformers.PrinterCallback)  # its summary line would go to stdout

    def by_hand() -> None:
        manager = SubscriberManager()
        manager.subscribe(model, [StatisticsSubscriber(out)])
        trainer.train()
        manager.unsubscribe()

    return by_hand if kind == "by hand" else trainer.train


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    size = QUICK if quick else FULL
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    tokens = torch.randint(0, 256, (4 * size["steps"], size["seq"]), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    kinds = ("no probes", "by hand", "ProbesCallback")
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for repeat in range(size["repeats"] + 1):  # round-robin, the order rotated; the first round warms up
        for kind in kinds[repeat % 3:] + kinds[:repeat % 3]:
            out = work / f"{kind.replace(' ', '-')}-{repeat}"
            train = _prepare(kind, size, data, out)
            started = time.perf_counter()
            train()
            if repeat:
                seconds[kind].append(time.perf_counter() - started)
            shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    plain, by_hand = median(seconds["no probes"]), median(seconds["by hand"])
    rows = [[kind, f"{median(seconds[kind]) / size['steps'] * 1e3:.1f}", f"{median(seconds[kind]) / plain:.3f}x",
             f"{median(seconds[kind]) / by_hand:.3f}x" if kind != "no probes" else ""] for kind in kinds]
    return (f"### Hugging Face Trainer callback ({'quick' if quick else 'full'}: GPT-2 {size['n_layer']} layers, "
            f"n_embd {size['n_embd']}, seq {size['seq']}, batch 4, {size['steps']} steps per train(), "
            f"{size['repeats']} interleaved repeats)\n\n"
            + table(["case", "ms per step", "vs no probes", "vs by hand"], rows)
            + f"\n\nOne train() per sample, the Trainer built outside the timing. {environment()}\n")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.callback_overhead")
    parser.add_argument("--quick", action="store_true")
    print(run(quick=parser.parse_args().quick))


if __name__ == "__main__":
    main()
