"""Per-probe overhead: step cost vs number of probed modules (10 to 1,000), and what selection saves.

    python -m benchmarks.probe_overhead [--quick] [--selection]     (--selection: only the selection table)

A chain of N tiny Linear(8, 8) modules, so the step is dominated by per-module costs. Each case is
timed against the unprobed chain in the same run; the overhead is reported per probed module and
step (forward + backward), in microseconds, for a no-op observing subscriber (the manager's own
cost: hooks, pytree, the probe Function) and for the StatisticsSubscriber (plus statistics and dump), and
per record (two per module: the output and its gradient). Each timing is 5 steps and, for the statistics,
waits for the dump writer's thread to finish them: its work is counted, not left to slow the next case.

The selection table (``run_selection``) takes the chain of 100 and compares recording everything with
recording every 10th step or 10% of the modules, and measures what a left-out step and left-out
modules cost against the no-op subscriber.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import environment, interleaved, median, python_probes, ratio_spread, table
from probes import StatisticsSubscriber, SubscriberBase, SubscriberManager
from probes.dump.live import flush_writers

FULL_COUNTS = (10, 100, 1000)
STEPS_PER_TIMING = 5
QUICK_COUNTS = (10, 100)


class NoOp(SubscriberBase):
    """Observes every tensor and does nothing with it: the manager's own cost."""

    event_kinds = {"forward", "backward"}

    def on_event(self, event):
        pass


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    rows = []
    for count in QUICK_COUNTS if quick else FULL_COUNTS:
        torch.manual_seed(0)
        plain = nn.Sequential(*(nn.Linear(8, 8) for _ in range(count)))
        models = {"plain": plain, "no-op": copy.deepcopy(plain), "statistics": copy.deepcopy(plain)}
        managers = [SubscriberManager(), SubscriberManager()]
        managers[0].subscribe(models["no-op"], [NoOp()])
        managers[1].subscribe(models["statistics"], [StatisticsSubscriber(work / f"stats_{count}")])
        x = torch.randn(4, 8)

        def steps(model: nn.Module, dump: Path | None = None):
            def run_steps() -> None:
                for _ in range(STEPS_PER_TIMING):
                    model(x).sum().backward()
                if dump is not None:  # the writer thread's work for these steps belongs to this case's time
                    flush_writers(dump)
            return run_steps

        cases = {"plain": steps(models["plain"]), "no-op": steps(models["no-op"]),
                 "statistics": steps(models["statistics"], work / f"stats_{count}")}
        times = {name: [value / STEPS_PER_TIMING for value in values]
                 for name, values in interleaved(cases, repeats=3 if quick else 15).items()}
        for manager in managers:
            manager.unsubscribe()
        base = median(times["plain"])
        probes_count = count + 1  # every Linear and the Sequential itself
        records = 2 * probes_count  # an output and its gradient per module
        noop, stats = median(times["no-op"]), median(times["statistics"])
        rows.append([count, f"{base * 1e3:.2f}",
                     f"{(noop - base) / probes_count * 1e6:.1f}",
                     f"{(stats - base) / probes_count * 1e6:.1f}",
                     f"{(stats - base) / records * 1e6:.1f}",
                     f"{(stats - noop) / records * 1e6:.1f}",
                     f"{stats / base:.2f}x"])
    return (f"### Per-probe overhead ({'quick' if quick else 'full'}; chain of Linear(8, 8), batch 4)\n\n"
            f"{environment()}\n\n"
            + table(["modules", "plain step ms", "no-op subscriber µs / module", "statistics µs / module",
                     "statistics µs / record", "record path µs / record (statistics − no-op)",
                     "statistics step / plain"], rows)
            + "\n\n" + run_selection(quick) + "\n\n" + run_floor(quick))


SELECTION_MODULES = 100
EVERY = 10
FLOOR_MODULES = 100


class _Identity(torch.autograd.Function):
    """The least a Python autograd Function probe does: pass a detached alias, hand the gradient back."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.set_materialize_grads(False)
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _hooked(model: nn.Module, hook) -> nn.Module:
    for module in model:
        module.register_forward_hook(hook)
    return model


def _grad_hook(module, args, output):
    output.register_hook(lambda grad: None)
    return output


def run_floor(quick: bool = False) -> str:
    """What the mechanisms a probe is built from cost by themselves, per module and step (forward + backward), on
    the chain of 100: a forward hook that does nothing, the same hook passing the output through an identity
    Python autograd Function (the floor of any probe that is one), a tensor gradient hook instead, and probes'
    no-op subscriber, with the probe Function eager calls use (``probes.core.native``) and with the Python one. The
    difference between probes and the hook + Function row is the manager's own bookkeeping."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Linear(8, 8) for _ in range(FLOOR_MODULES)))
    models = {
        "plain": plain,
        "empty forward hook": _hooked(copy.deepcopy(plain), lambda module, args, output: output),
        "hook + identity autograd Function": _hooked(copy.deepcopy(plain),
                                                     lambda module, args, output: _Identity.apply(output)),
        "hook + tensor gradient hook": _hooked(copy.deepcopy(plain), _grad_hook),
        "probes, no-op subscriber": copy.deepcopy(plain),
        "probes, no-op subscriber, Python Function": copy.deepcopy(plain),
    }
    manager, python_manager = SubscriberManager(), SubscriberManager()
    manager.subscribe(models["probes, no-op subscriber"], [NoOp()])
    with python_probes():
        python_manager.subscribe(models["probes, no-op subscriber, Python Function"], [NoOp()])
    x = torch.randn(4, 8)

    def steps(model: nn.Module):
        def run_steps() -> None:
            for _ in range(STEPS_PER_TIMING):
                model(x).sum().backward()
        return run_steps

    times = interleaved({name: steps(model) for name, model in models.items()}, repeats=3 if quick else 25)
    manager.unsubscribe()
    python_manager.unsubscribe()
    base = median(times["plain"]) / STEPS_PER_TIMING
    rows = [[name, f"{median(values) / STEPS_PER_TIMING * 1e3:.2f}",
             f"{(median(values) / STEPS_PER_TIMING - base) / FLOOR_MODULES * 1e6:.1f}"]
            for name, values in times.items()]
    return (f"### What a probe is built from ({'quick' if quick else 'full'}; chain of {FLOOR_MODULES} Linear(8, 8), "
            "batch 4, one hook per Linear)\n\n"
            "`python -m benchmarks.probe_overhead --floor` (µs per module and step, forward and backward; probes' "
            "row also has the root's step boundary)\n\n"
            f"{environment()}\n\n"
            + table(["case", "step ms", "µs / module"], rows)
            + "\n\nStep time with probes' no-op subscriber, eager probe Function / Python Function, per round: "
            + ratio_spread(times["probes, no-op subscriber"], times["probes, no-op subscriber, Python Function"]))


def run_selection(quick: bool = False) -> str:
    """Statistics with selection vs everything, on the chain of 100; left-out costs vs the no-op subscriber."""
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="probes-bench-select-"))
    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Linear(8, 8) for _ in range(SELECTION_MODULES)))
    tenth = r"re:\d*0"  # the modules 0, 10, ..., 90: 10% of them
    cases: dict[str, list[SubscriberBase]] = {
        "no-op subscriber": [NoOp()],
        "statistics, everything": [StatisticsSubscriber(work / "all")],
        f"statistics, every_n_steps={EVERY}": [StatisticsSubscriber(work / "every", every_n_steps=EVERY)],
        "statistics, modules=10%": [StatisticsSubscriber(work / "tenth", modules=tenth)],
        "left-out step (statistics, steps=[never])": [StatisticsSubscriber(work / "never", steps=[10**12])],
        "left-out modules (statistics, modules=none)": [StatisticsSubscriber(work / "none", modules="nothing")],
    }
    models = {"plain": plain, **{name: copy.deepcopy(plain) for name in cases}}
    managers = []
    for name, subscribers in cases.items():
        managers.append(SubscriberManager())
        managers[-1].subscribe(models[name], subscribers)
    x = torch.randn(4, 8)

    def steps(model: nn.Module):
        def run_steps():  # EVERY steps per timing: a cadence's cost is its average over a whole period
            for _ in range(EVERY):
                model(x).sum().backward()
        return run_steps

    times = interleaved({name: steps(model) for name, model in models.items()}, repeats=3 if quick else 15)
    for manager in managers:
        manager.unsubscribe()
    per_step = {name: median(values) / EVERY for name, values in times.items()}
    base = per_step["plain"]
    probes_count = SELECTION_MODULES + 1  # every Linear and the Sequential itself
    noop = per_step["no-op subscriber"] - base

    def row(name: str) -> list[object]:
        extra = per_step[name] - base
        left_out = f"{extra / noop:.2f}" if name.startswith("left-out") else ""
        return [name, f"{per_step[name] * 1e3:.2f}", f"{per_step[name] / base:.3f}x", f"{extra / probes_count * 1e6:.1f}",
                left_out]

    return (f"### Selection ({'quick' if quick else 'full'}; chain of {SELECTION_MODULES} Linear(8, 8), batch 4, "
            f"per-step averages over {EVERY} steps)\n\n"
            "`python -m benchmarks.probe_overhead --selection` (the µs are per module of the chain and per step; "
            "the last column is the left-out cost over the no-op subscriber's)\n\n"
            f"{environment()}\n\n"
            + table(["case", "step ms", "/ plain", "µs / module", "left-out cost / no-op cost"],
                    [["plain", f"{base * 1e3:.2f}", "1.000x", "0", ""]] + [row(name) for name in cases]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--selection", action="store_true", help="only the selection table")
    parser.add_argument("--floor", action="store_true", help="only the table of what a probe is built from")
    arguments = parser.parse_args()
    if arguments.floor:
        print(run_floor(arguments.quick))
    else:
        print(run_selection(arguments.quick) if arguments.selection else run(arguments.quick))
