"""Where the µs of one eager probe call go: a no-op probe call taken apart, and the statistics record path.

    python -m benchmarks.probe_parts [--quick]

Part 1, on the chain of 100 ``Linear(8, 8)`` of ``probe_overhead --floor``: the same no-op probe built up one part
at a time, each variant a model of its own, all timed interleaved in one run (CPU time of the training thread,
which runs the whole CPU backward too). Each row adds one part to the row above; its µs are the difference of the two rows' medians over
rounds, per module and step (forward and backward), with the quartiles of the per-round differences:

- an empty forward hook (the least any hook costs: torch's hooked module call);
- probes' hook with every check it makes, the probe an identity that returns the tensor (no autograd node);
- the C++ probe node (``probes.core.native``), its forward callback a Python function that returns None: no
  tracker, no backward callback;
- the tracker's forward (``StepTracker.probe_forward``: the step, the event) with delivery switched off;
- the backward callback (``probe_backward``), delivery still off;
- delivery to one no-op subscriber (its ``on_event``): probes as they run;
- the same with the garbage collector off (``gc.disable()`` while it runs): the collector's share.

The variants swap the manager's probe call (``_apply_observed``) and the tracker's receivers on their own instances:
benchmark-only, nothing in the library has a switch for it. Every probes row also has the root's step boundary
(once per step, 1/100 of it per module).

Part 2, per record of the StatisticsSubscriber (a 4 x 8 float32 tensor, the chain's), in a loop: the C++
``fast_row`` call alone, ``StepRows.add`` around it, the subscriber's ``on_event`` around that, and ``on_event``
with the collector off; and the chain of 1,000 (``probe_overhead``'s chain table) with the statistics, collector on
and off.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from benchmarks.common import environment, interleaved, table
from benchmarks.probe_overhead import NoOp
from probes import StatisticsSubscriber, SubscriberManager
from probes.core import ProbeEvent, ProbeSite
from probes.core import native
from probes.dump.live import flush_writers

CHAIN = 100
STEPS = 2  # per timing: short timings, many rounds (the machine is shared)


def _timed(cases: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[int]]:
    """CPU ns of this thread per case and round, round-robin (two warm-up rounds)."""
    return interleaved(cases, repeats, warmup=2, clock=time.thread_time_ns)


def _spread(values: list[float], middle: float | None = None) -> str:
    """``middle`` (default: the median of ``values``) with the quartiles of ``values``."""
    middle = statistics.median(values) if middle is None else middle
    if len(values) < 4:
        return f"{middle:.2f}"
    low, _, high = statistics.quantiles(values, n=4)
    return f"{middle:.2f} ({low:.2f} to {high:.2f})"


def _difference(case: list[int], base: list[int], scale: float) -> str:
    """The difference of the medians of two interleaved cases, scaled, with the quartiles of the per-round
    differences (on a shared machine the medians of each are steadier than the per-round differences)."""
    per_round = [(value - before) / scale for value, before in zip(case, base)]
    return _spread(per_round, (statistics.median(case) - statistics.median(base)) / scale)


def _no_gc(run: Callable[[], None]) -> Callable[[], None]:
    def without_collector() -> None:
        gc.disable()
        try:
            run()
        finally:
            gc.enable()
    return without_collector


def _steps(model: nn.Module, x: torch.Tensor, dump: Path | None = None) -> Callable[[], None]:
    def run() -> None:
        for _ in range(STEPS):
            model(x).sum().backward()
        if dump is not None:
            flush_writers(dump)
    return run


def _probe_variants() -> dict[str, Callable[[SubscriberManager], None] | None]:
    """How each probes row changes its manager (None: probes as they run). The hook of a Linear hands its output to
    the manager's ``_apply_observed`` (``native.ProbeAppliers.observed``)."""
    probe = native._NATIVE.load(required=True).probe
    real_forward = native._observed_forward

    def nothing(binding, tensors):
        return None

    def forward_only(binding, tensors):
        real_forward(binding, tensors)
        return None

    def with_forward(callback):
        def setup(manager: SubscriberManager) -> None:
            manager._apply_observed = lambda binding, tensor: probe(callback, binding, (tensor,))[0]
        return setup

    def no_delivery(setup):
        def both(manager: SubscriberManager) -> None:
            if setup is not None:
                setup(manager)
            manager.tracker._receivers = lambda site, step, phase: ()
        return both

    return {
        "probes' hook and checks, identity probe": lambda manager: setattr(
            manager, "_apply_observed", lambda binding, tensor: tensor),
        "C++ probe node, forward callback returns None": with_forward(nothing),
        "tracker forward (no delivery)": no_delivery(with_forward(forward_only)),
        "tracker backward callback (no delivery)": no_delivery(None),
        "delivery to a no-op subscriber (probes as they run)": None,
    }


def run_call_parts(quick: bool = False) -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Linear(8, 8) for _ in range(CHAIN)))
    x = torch.randn(4, 8)
    cases: dict[str, Callable[[], None]] = {"plain": _steps(plain, x)}
    hooked = copy.deepcopy(plain)
    for module in hooked:
        module.register_forward_hook(lambda module, args, output: output)
    cases["empty forward hook"] = _steps(hooked, x)
    managers = []
    for name, setup in _probe_variants().items():
        model = copy.deepcopy(plain)
        manager = SubscriberManager()
        manager.subscribe(model, [NoOp()])
        if setup is not None:
            setup(manager)
        managers.append(manager)
        cases[name] = _steps(model, x)
    cases["garbage collector off"] = _no_gc(cases["delivery to a no-op subscriber (probes as they run)"])
    times = _timed(cases, repeats=3 if quick else 150)
    for manager in managers:
        manager.unsubscribe()
    names = list(times)
    per = STEPS * CHAIN * 1e3  # ns per step and module -> µs
    rows = [["plain (chain alone)", f"{statistics.median(times['plain']) / STEPS / 1e6:.2f} ms / step", ""]]
    for previous, name in zip(names, names[1:]):
        label, part = name, _difference(times[name], times[previous], per)
        if name == "garbage collector off":  # a share of the row above, not a part added to it
            label, part = "of which the garbage collector (row above - the same, collector off)", _difference(
                times[previous], times[name], per)
        rows.append([label, part, _difference(times[name], times["plain"], per)])
    return (f"### One no-op probe call by part ({'quick' if quick else 'full'}; chain of {CHAIN} Linear(8, 8), "
            "batch 4, one forward and one backward per module and step)\n\n"
            "`python -m benchmarks.probe_parts` (CPU µs of the training thread per module and step: each row's "
            "median over rounds minus the row above's, quartiles of the per-round differences in brackets; last column: the row minus plain)\n\n"
            f"{environment()}\n\n"
            + table(["part (each row adds it to the row above)", "µs / call", "cumulative µs / call"], rows))


def _event(site: ProbeSite, tensor: torch.Tensor) -> ProbeEvent:
    return ProbeEvent(site, 0, "forward", 0, 0, None, "forward", None, None, (tensor,))


def run_record_parts(quick: bool = False) -> str:
    """The statistics subscriber's per-record Python around the C++ ``fast_row`` call, in a loop of records."""
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="probes-parts-"))
    subscriber = StatisticsSubscriber(work / "loop")
    rows = subscriber._rows
    kernel = rows._kernel
    site = ProbeSite("layer", "output", 1, 1, "Linear")
    tensor = torch.randn(4, 8)
    event = _event(site, tensor)
    count = 200 if quick else 2000
    target = torch.empty((count, rows.width), dtype=torch.float64)

    def fast_row() -> None:
        for row in range(count):
            kernel.fast_row(tensor, target, row, rows.sample_count, rows.bucket_size)

    def add() -> None:
        for _ in range(count):
            rows.add(event, 0, tensor)
        rows.clear()

    def on_event() -> None:
        for _ in range(count):
            subscriber.on_event(event)
        rows.clear()

    cases = {"C++ fast_row alone": fast_row, "StepRows.add": add, "StatisticsSubscriber.on_event": on_event,
             "on_event, garbage collector off": _no_gc(on_event)}
    times = _timed(cases, repeats=3 if quick else 30)
    subscriber.close()
    names = list(times)
    table_rows = []
    for index, name in enumerate(names):
        total = _spread([value / count / 1e3 for value in times[name]])
        part = _difference(times[name], times[names[index - 1]], count * 1e3) if index else total
        table_rows.append([name, part, total])
    return (f"### One statistics record by part ({'quick' if quick else 'full'}; a 4 x 8 float32 tensor, "
            f"{count} records a round)\n\n"
            "`python -m benchmarks.probe_parts` (CPU µs of the thread per record: median over rounds of the row "
            "minus the row above, quartiles in brackets)\n\n"
            f"{environment()}\n\n"
            + table(["part", "µs / record (row - row above)", "µs / record"], table_rows))


def run_chain_gc(quick: bool = False) -> str:
    """The chain of 1,000 (``probe_overhead``'s chain table): no-op and statistics, collector on and off."""
    torch.set_num_threads(1)
    count = 100 if quick else 1000
    work = Path(tempfile.mkdtemp(prefix="probes-parts-chain-"))
    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Linear(8, 8) for _ in range(count)))
    noop, stats = copy.deepcopy(plain), copy.deepcopy(plain)
    managers = [SubscriberManager(), SubscriberManager()]
    managers[0].subscribe(noop, [NoOp()])
    managers[1].subscribe(stats, [StatisticsSubscriber(work / "stats")])
    x = torch.randn(4, 8)
    cases = {"plain": _steps(plain, x), "no-op": _steps(noop, x), "statistics": _steps(stats, x, work / "stats")}
    cases["statistics, collector off"] = _no_gc(cases["statistics"])
    cases["no-op, collector off"] = _no_gc(cases["no-op"])
    wall: dict[str, list[float]] = {name: [] for name in cases}

    def walled(name: str, run: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            started = time.perf_counter_ns()
            run()
            wall[name].append(time.perf_counter_ns() - started)
        return timed

    times = _timed({name: walled(name, run) for name, run in cases.items()}, repeats=3 if quick else 12)
    for manager in managers:
        manager.unsubscribe()
    records = 2 * (count + 1)
    table_rows = []
    for name in cases:
        if name == "plain":
            continue
        scale = STEPS * records * 1e3
        table_rows.append([name, _difference(times[name], times["plain"], scale),
                           _difference(wall[name][2:], wall["plain"][2:], scale)])  # (2: the warm-up's)
    return (f"### Chain of {count}, µs per record over plain, collector on and off ({'quick' if quick else 'full'})\n\n"
            "`python -m benchmarks.probe_parts` (two records per module: output and gradient; CPU time of the "
            "training thread, and wall time with the dump writer's thread, flushed in each timing)\n\n"
            f"{environment()}\n\n"
            + table(["case", "CPU µs / record, training thread", "wall µs / record"], table_rows))


def run(quick: bool = False) -> str:
    return "\n\n".join((run_call_parts(quick), run_record_parts(quick), run_chain_gc(quick)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=("call", "record", "chain"), help="only one table")
    arguments = parser.parse_args()
    only = {"call": run_call_parts, "record": run_record_parts, "chain": run_chain_gc}
    print(only[arguments.part](arguments.quick) if arguments.part else run(arguments.quick))
