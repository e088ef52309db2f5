"""Host reads (device syncs on CUDA) that one probed training step makes on the training thread.

    python -m benchmarks.host_reads [--quick]                  # markdown: the default and the torch backend
    python -m benchmarks.host_reads --backend torch --json     # one backend's numbers as JSON (what run() reads)

    from benchmarks.host_reads import count_host_reads
    with count_host_reads(record_stacks=True) as reads:
        model(x).sum().backward()
    assert reads.total == 0, reads.describe()

``count_host_reads`` wraps the torch.Tensor methods that read a tensor back to the host for its
duration (restored on exit, also on exceptions) and counts their calls per method name:
``item``, ``tolist``, ``numpy``, ``__bool__``, ``__int__``, ``__float__``, ``__index__`` (a value read);
``cpu`` and ``to(<cpu device>)`` unless ``non_blocking=True`` (a blocking copy to the host, counted
whatever the source device: on a CPU-only machine this is how a device tensor's read shows); ``copy_``
into a CPU tensor from a non-CPU tensor unless ``non_blocking=True`` (a CPU-to-CPU ``copy_`` is, on a
device, a copy on the device). Only the outermost wrapped call counts (a wrapped method calling another
is one read), and a read of the tensor that a counted copy just returned is that same read
(``x.cpu().numpy()`` counts once). With ``aten=True`` a ``TorchDispatchMode`` also counts the aten ops
that sync without going through those methods: ``_local_scalar_dense`` (``item`` in C++), ``nonzero``
and ``masked_select`` (data-dependent output sizes). Dispatch modes sit below autograd, so autograd
Functions (the probes) run unchanged under it (the tests check that the records are still written).

Threads: the calling thread counts, and so do threads not started by Python's ``threading`` (PyTorch's
autograd engine runs a CUDA backward, and so the probes' backward, on such threads); other Python threads
(the dump's writer thread) are ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

VALUE_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
COPIES = ("cpu", "to", "copy_")
ATEN_READS = ("_local_scalar_dense", "nonzero", "masked_select")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class HostReads:
    """What ``count_host_reads`` counted: calls per method (aten ops as ``aten.<name>``) and, with
    ``record_stacks``, the stack of the first counted call of each."""

    counts: Counter[str] = field(default_factory=Counter)
    stacks: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        if not self.counts:
            return "no host reads"
        text = ", ".join(f"{name} x{count}" for name, count in self.counts.most_common())
        for name, stack in self.stacks.items():
            text += f"\n--- first {name} call:\n{stack}"
        return text


class _State(threading.local):
    depth = 0  # wrapped calls in progress on this thread
    fresh: Any = None  # the host tensor the last counted copy returned (its first read is that copy's)


def _destination_is_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the CPU as its device."""
    target = kwargs.get("device")
    if target is None and args:
        first = args[0]
        if isinstance(first, torch.Tensor):
            target = first.device
        elif isinstance(first, (str, torch.device)):
            target = first
    if target is None or isinstance(target, int):
        return False
    return torch.device(target).type == "cpu"


def _non_blocking(args: tuple, kwargs: dict, position: int) -> bool:
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    return len(args) > position and isinstance(args[position], bool) and args[position]


def _is_read(name: str, tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    if name == "to":
        # to(device, dtype, non_blocking, ...), to(dtype, non_blocking, ...), to(other, non_blocking, ...)
        position = 2 if args and isinstance(args[0], (str, torch.device, int)) else 1
        return _destination_is_cpu(args, kwargs) and not _non_blocking(args, kwargs, position)
    if name == "copy_":
        source = args[0] if args else kwargs.get("src")
        return (tensor.device.type == "cpu" and isinstance(source, torch.Tensor) and source.device.type != "cpu"
                and not _non_blocking(args, kwargs, 1))
    return True


@contextlib.contextmanager
def count_host_reads(*, record_stacks: bool = False, aten: bool = True,
                     foreign_threads: bool = True) -> Iterator[HostReads]:
    """Counts host reads on this thread while the block runs (see the module docstring).

    record_stacks: keep the stack of the first counted call per method (``HostReads.describe`` prints it).
    aten: also count ``_local_scalar_dense``, ``nonzero``, ``masked_select`` through a TorchDispatchMode.
    foreign_threads: also count threads not started by Python (the autograd engine's device threads).
    """
    reads = HostReads()
    state = _State()
    owner = threading.get_ident()
    dummy = getattr(threading, "_DummyThread", ())

    def counts_here() -> bool:
        if threading.get_ident() == owner:
            return True
        return foreign_threads and isinstance(threading.current_thread(), dummy)

    def count(name: str) -> None:
        reads.counts[name] += 1
        if record_stacks and name not in reads.stacks:
            reads.stacks[name] = "".join(traceback.format_stack(limit=30)[:-2])

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if state.depth or not counts_here():
                return original(self, *args, **kwargs)
            if state.fresh is not None and state.fresh() is self and name in VALUE_READS:
                state.fresh = None  # the read of a host copy already counted
                counted = False
            else:
                counted = _is_read(name, self, args, kwargs)
            if counted:
                count(name)
            state.depth += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                state.depth -= 1
            if counted and name in COPIES and isinstance(result, torch.Tensor):
                state.fresh = weakref.ref(result)
            return result
        return wrapper

    saved = {name: torch.Tensor.__dict__.get(name) for name in VALUE_READS + COPIES}
    mode = _AtenReads(state, counts_here, count) if aten else contextlib.nullcontext()
    try:
        for name in saved:
            setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
        with mode:
            yield reads
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


class _AtenReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops of ``ATEN_READS`` that no wrapped method is already counting."""

    def __init__(self, state: _State, counts_here: Callable[[], bool], count: Callable[[str], None]) -> None:
        super().__init__()
        self.state, self.counts_here, self.count = state, counts_here, count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ in ATEN_READS and not self.state.depth and self.counts_here():
            self.count(f"aten.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------- the benchmark

CASES = {"probes, sentinel off": {}, "probes, on_anomaly='warn'": {"on_anomaly": "warn"}}
WARMUP = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)))


def measure(record_stacks: bool = True) -> dict[str, Any]:
    """One backend's numbers (the one this process imported): per case the records of the counted step,
    its host reads beyond the unprobed step's, the counts per method and the first stacks."""
    from probes import StatisticsSubscriber, SubscriberManager, load_dump
    from probes.stats import numerics

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    base = _model()

    def step(model: nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    for _ in range(WARMUP):
        step(base)
    with count_host_reads(record_stacks=record_stacks) as plain:
        step(base)
    work = Path(tempfile.mkdtemp(prefix="probes-host-reads-"))
    cases = []
    for case, options in CASES.items():
        model = copy.deepcopy(base)
        manager = SubscriberManager()
        out = work / f"case{len(cases)}"
        manager.subscribe(model, [StatisticsSubscriber(out, **options)])
        try:
            for _ in range(WARMUP):
                step(model)
            with count_host_reads(record_stacks=record_stacks) as reads:
                step(model)
        finally:
            manager.unsubscribe()
        records = sum(1 for record in load_dump(out) if record["step"] == WARMUP)
        extra = reads.total - plain.total
        cases.append({"case": case, "records": records, "reads": extra, "counts": dict(reads.counts),
                      "stacks": reads.stacks, "reads_per_record": extra / records if records else None})
    return {"backend": numerics.backend(), "torch": torch.__version__, "unprobed_reads": plain.total,
            "cases": cases}


def measure_in_subprocess(backend: str = "torch", timeout: float = 600) -> dict[str, Any]:
    """``measure`` under ``PROBES_NUMERICS_BACKEND=<backend>`` (in a fresh process of its own, as a user would set it)."""
    env = dict(os.environ, PROBES_NUMERICS_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.host_reads", "--backend", backend, "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.host_reads --backend {backend} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> str:
    from benchmarks.common import environment, table

    results = [measure(record_stacks=False), measure_in_subprocess("torch")]
    rows = []
    for result in results:
        for case in result["cases"]:
            per_record = "-" if case["reads_per_record"] is None else f"{case['reads_per_record']:.2f}"
            counted = ", ".join(f"{name} {count}" for name, count in sorted(case["counts"].items())) or "none"
            rows.append([result["backend"], case["case"], case["records"], case["reads"], per_record, counted])
    return ("### Host reads per probed step (4 blocks of Linear(64, 64) + ReLU, batch 8)\n\n"
            "`python -m benchmarks.host_reads`: calls that read a tensor back to the host (a device sync on CUDA) on "
            "the training thread during one probed step (forward + backward), minus the unprobed step's "
            f"({results[0]['unprobed_reads']}); counted by `benchmarks.host_reads.count_host_reads`. The torch "
            "backend (`PROBES_NUMERICS_BACKEND=torch`) is the path device tensors take.\n\n"
            f"{environment()}\n\n"
            + table(["statistics backend", "case", "records / step", "host reads / step", "reads / record",
                     "counted calls"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_reads")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="this process's backend only, as one line of JSON")
    parser.add_argument("--backend", choices=("auto", "cpp", "torch"),
                        help="PROBES_NUMERICS_BACKEND for this process (set before probes is imported)")
    args = parser.parse_args()
    if args.backend is not None:
        if "probes" in sys.modules and os.environ.get("PROBES_NUMERICS_BACKEND") != args.backend:
            parser.error("--backend must be chosen before probes is imported")
        os.environ["PROBES_NUMERICS_BACKEND"] = args.backend
    if args.json:
        print(json.dumps(measure()))
    else:
        print(run(quick=args.quick))


if __name__ == "__main__":
    main()
