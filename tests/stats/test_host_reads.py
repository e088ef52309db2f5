"""A probed training step reads nothing back to the host on the training thread (the sentinel: one read a phase).

    ./dev run --lane ort python -m pytest -q tests/stats/test_host_reads.py

The counter is ``benchmarks.host_reads.count_host_reads`` (a device sync on CUDA is such a read); the
step is ``benchmarks.host_reads.measure``'s: 4 blocks of Linear(64, 64) + ReLU, two warm-up steps,
then one counted step, on the default statistics backend in this process and on the torch backend
(the path device tensors take) in a subprocess, each in a process of its own (the kernel is built once per process).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from benchmarks.host_reads import COPIES, VALUE_READS, count_host_reads, measure, measure_in_subprocess


def test_counter_counts_reads_on_the_calling_thread_only_and_restores_the_methods():
    before = {name: torch.Tensor.__dict__.get(name) for name in VALUE_READS + COPIES}
    x = torch.arange(4.0)
    with count_host_reads() as reads:
        x.sum().item()
        x.tolist()
        x.cpu()
        x.to("cpu")
        x.to(torch.device("cpu"), non_blocking=True)  # not a blocking copy
        x.to(torch.float64)  # no device: stays where it is
        torch.empty(4).copy_(x)  # CPU to CPU: on a device, a copy on the device
        x.cpu().numpy()  # one read: the numpy() of the copy just counted is that copy's
        torch.nonzero(x)  # aten.nonzero through the dispatch mode
        other = threading.Thread(target=lambda: (x.sum().item(), x.tolist(), x.cpu(), x.to("cpu")))
        other.start()
        other.join()
    assert dict(reads.counts) == {"item": 1, "tolist": 1, "cpu": 2, "to": 1, "aten.nonzero": 1}, reads.describe()
    assert reads.total == 6
    assert {name: torch.Tensor.__dict__.get(name) for name in VALUE_READS + COPIES} == before
    with pytest.raises(RuntimeError, match="boom"), count_host_reads():
        raise RuntimeError("boom")
    assert {name: torch.Tensor.__dict__.get(name) for name in VALUE_READS + COPIES} == before


def test_counter_records_the_first_stack_per_method():
    with count_host_reads(record_stacks=True) as reads:
        bool(torch.ones(()))
        bool(torch.ones(()))
    assert reads.counts["__bool__"] == 2
    assert "test_counter_records_the_first_stack_per_method" in reads.stacks["__bool__"]


def _assert_no_extra_reads(result: dict[str, Any]) -> None:
    cases = {case["case"]: case for case in result["cases"]}
    for name, case in cases.items():
        assert case["records"] == 26, case  # 13 modules (root, 4 blocks, 8 layers), forward and backward

    def detail(case: dict[str, Any]) -> str:
        stacks = "".join(f"\n--- first {name}:\n{stack}" for name, stack in case["stacks"].items())
        return (f"{result['backend']} backend, {case['case']}: {case['reads']} host reads, "
                f"per method {case['counts']}{stacks}")

    off = cases["probes, sentinel off"]
    assert off["reads"] == 0, detail(off)
    warn = cases["probes, on_anomaly='warn'"]
    assert warn["reads"] <= 2, detail(warn)  # one per phase: the end of the forward and the end of the step


def test_probed_step_makes_no_host_reads_default_backend():
    _assert_no_extra_reads(measure())


def test_probed_step_makes_no_host_reads_torch_backend():
    result = measure_in_subprocess("torch")
    assert result["backend"] == "torch"
    _assert_no_extra_reads(result)
