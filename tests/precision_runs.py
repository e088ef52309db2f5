"""Real training runs of the zoo's Llama in fp32 or under bf16 autocast, on eager, torch.compile or ORTModule, with
or without a known bug: what the default tolerances are measured on (docs/compare.md, Tolerance) and tested with.

    run = train(tmp_path / "eager", backend="eager", bf16=True)                      # 3 SGD steps, statistics
    train(tmp_path / "compile", backend="compile", compile_backend="inductor", bf16=True)
    train(tmp_path / "bug", backend="eager", bf16=True, bug=Bug("output", "model.layers.1.mlp", step=1))
    train(tmp_path / "gpt2", arch="gpt2", precision="float16")                        # any zoo architecture
    measure(tmp_path / "eager", tmp_path / "compile")   # per precision: the largest differences, in eps
    python tests/precision_runs.py OUT [ARCH ...]  # every run, then what ``measure`` finds (docs/compare.md)

A bug acts from ``Bug.step`` on: ``"output"`` scales a module's first output by ``factor`` before its probe
records it (``probes.testing.inject_bug``), so the module's own record is the first to differ; ``"softmax"``
scales the query of one attention layer after its probe recorded it, so the attention's softmax is computed from
scores ``factor`` times too large while every recorded input of it agrees: the first record to differ is the
layer's ``o_proj`` output.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from helpers import OrtWitness, counting_backend
from probes import StatisticsSubscriber, SubscriberManager
from probes.testing import BugInjection, _scale_first_tensor, inject_bug
from zoo import ARCHITECTURES

STEPS = 3
LR = 0.05


@dataclass(frozen=True)
class Bug:
    kind: str  # "output" | "softmax"
    layer: str  # "output": the module; "softmax": the attention module (model.layers.<i>.self_attn)
    step: int
    factor: float = 1.01

    @property
    def first_record(self) -> tuple[int, str, str]:
        """(step, phase, name) of the record the bug must be found at first."""
        name = f"{self.layer}.output.0" if self.kind == "output" else f"{self.layer}.o_proj.output.0"
        return self.step, "forward", name


def _softmax_bug(model: torch.nn.Module, bug: Bug) -> BugInjection:
    """The query of ``bug.layer`` scaled after its probe: the softmax of that layer gets scaled scores."""
    injection = BugInjection(f"{bug.layer}.q_proj", bug.step, bug.factor, "forward")
    injection.handle = model.get_submodule(f"{bug.layer}.q_proj").register_forward_hook(_scale_first_tensor(injection))
    return injection


def _autocast(precision: str) -> contextlib.AbstractContextManager:
    if precision in ("bfloat16", "float16"):
        return torch.autocast("cpu", dtype=getattr(torch, precision))
    return contextlib.nullcontext()


@dataclass
class Run:
    """What a training run did: its losses, and the proof that its backend ran (ORT's runtime called the probes
    ``by_ort`` times; torch.compile compiled ``graphs`` graphs)."""

    losses: list[float] = field(default_factory=list)
    by_ort: int = 0
    graphs: int = 0


def train(out: Path | None, *, backend: str = "eager", compile_backend: str = "inductor", bf16: bool = False,
          precision: str = "float32", steps: int = STEPS, bug: Bug | None = None, attention: str = "eager",
          arch: str = "llama", sharpen: float = 1.0, adam: bool = False, seed: int = 0) -> Run:
    """``steps`` SGD steps of a zoo model (the Llama) on ``backend`` (eager | compile | ort); statistics (forward,
    backward, grad, param) to ``out`` unless None. ``bf16``: under ``torch.autocast("cpu", dtype=torch.bfloat16)``
    (``precision="bfloat16"``); ``precision="float16"``: autocast to float16; ``"float64"``: the model in float64.
    ``sharpen``: every query and key projection's weight times this, so that attention attends (scores of order
    one, as in a trained model) instead of averaging (a fresh model's scores are near zero). ``adam``: AdamW
    (lr 1e-3) instead of SGD, its state recorded too (``optim`` records)."""
    precision = "bfloat16" if bf16 else precision
    built = ARCHITECTURES[arch]
    model = built.build(seed=seed, attention=attention)
    if precision == "float64":
        model = model.double()
    if sharpen != 1.0:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    parameter.mul_(sharpen)
    run = Run()
    witness = OrtWitness()
    injection = None
    if bug is not None and bug.kind == "output":
        injection = inject_bug(model, bug.layer, step=bug.step, factor=bug.factor)
    manager = SubscriberManager()
    if out is not None:
        subscribers = [StatisticsSubscriber(out, override_output_dir=True, parameters=True, optimizer_state=adam)]
        manager.subscribe(model, subscribers + ([witness] if backend == "ort" else []))
    if bug is not None and bug.kind == "softmax":
        injection = _softmax_bug(model, bug)
    runner: torch.nn.Module = model
    if backend == "ort":
        from onnxruntime.training.ortmodule import ORTModule

        os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"  # ORT runs it, or this raises
        runner = ORTModule(model)
    elif backend == "compile":
        torch._dynamo.reset()
        runner = torch.compile(model, backend=counting_backend(run, compile_backend))
    elif backend != "eager":
        raise ValueError(f"unknown backend {backend!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if adam else torch.optim.SGD(model.parameters(), lr=LR)
    try:
        for step in range(steps):
            if injection is not None:
                injection.step = step
            optimizer.zero_grad()
            with _autocast(precision):
                loss = built.loss(runner, built.batch(step))
            loss.backward()
            run.losses.append(loss.item())
            optimizer.step()
    finally:
        manager.unsubscribe()
        if injection is not None:
            injection.remove()
        if backend == "compile":
            torch._dynamo.reset()
    run.by_ort = witness.by_ort
    return run


def measure(base: Path, other: Path) -> dict[str, dict[str, float]]:
    """Per precision the records are compared at: the largest difference of single values (min, max, samples) and
    of moments (mean, std, norm; of activations, of gradients and updates, of optimizer states), each
    |diff| / max(|x|, rms, scale floor) in units of the precision's eps; the moments' also times sqrt(numel); and
    the worst ratio |diff| / tolerance under the defaults."""
    import numpy as np

    from probes.compare import compare_dumps
    from probes.compare.options import AGGREGATES, MOMENTS, PRECISIONS
    from probes.compare.pairs import from_columns
    from probes.compare.reading import read_dump
    from probes.compare.pairs import match

    loaded_b, loaded_o = read_dump(base, progress=False), read_dump(other, progress=False)
    pairs, _ = from_columns(loaded_b, loaded_o, match(loaded_b, loaded_o))
    numel = pairs.base["numel"][0]
    mean, std = (np.nan_to_num(pairs.base[name][0]) for name in ("mean", "std"))
    rms = np.maximum(np.hypot(mean, std * np.sqrt(np.maximum(numel - 1, 0) / np.maximum(numel, 1))), pairs.floor)
    single, moment = np.zeros(pairs.count), np.zeros(pairs.count)
    with np.errstate(divide="ignore", invalid="ignore"):
        for name in MOMENTS:
            values = pairs.base[name][0]
            found = np.nan_to_num(np.abs(pairs.other[name][0] - values) / np.maximum(np.abs(values), rms))
            if name in AGGREGATES:
                moment = np.maximum(moment, found)
            else:
                single = np.maximum(single, found)
        for block in pairs.samples:
            found = np.abs(block.other - block.base) / np.maximum(np.abs(block.base), rms[block.rows, None])
            single[block.rows] = np.maximum(single[block.rows], np.nan_to_num(found).max(axis=1))
    report = compare_dumps(base, other)
    ratios = np.asarray(report.records.ratio)  # matched records in execution order: the worst per precision below
    table = {}
    for name in sorted(set(pairs.precision.tolist())):
        if name not in PRECISIONS:
            continue
        rows = pairs.precision == name
        eps = PRECISIONS[name].eps
        table[name] = {"records": int(rows.sum()), "values": float(single[rows].max() / eps),
                       "moments_sqrt_numel": float((moment * np.sqrt(numel))[rows].max() / eps)}
        for label, phases in (("forward", ("forward",)), ("gradients", ("backward", "grad", "param")),
                              ("optim", ("optim",))):
            chosen = rows & np.isin(pairs.phase.astype(str), phases)
            table[name][f"moments_{label}"] = float(moment[chosen].max(initial=0.0) / eps)
    table["all"] = {"worst_ratio": float(np.nan_to_num(ratios, posinf=1e300).max(initial=0.0)),
                    "diverged": int(report.diverged_count)}
    return table


def main(argv: list[str]) -> None:  # pragma: no cover - the measurement behind docs/compare.md's constants
    """Eager against torch.compile (inductor, aot_eager) in float32, bfloat16 and float16 autocast, and against
    ORTModule in float32 where it imports, 4 steps each; prints ``measure`` of each as a JSON line."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python tests/precision_runs.py")
    parser.add_argument("out", type=Path)
    parser.add_argument("archs", nargs="*", default=["llama"])
    parser.add_argument("--sharpen", type=float, default=1.0)
    parser.add_argument("--precisions", default="float32,bfloat16,float16")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    attention = "eager" if os.environ.get("PROBES_LANE") == "ort" else "sdpa"  # as the zoo trains
    for arch in args.archs:
        for precision in args.precisions.split(","):
            runs = {"eager": {}, "inductor": {"backend": "compile"},
                    "aot_eager": {"backend": "compile", "compile_backend": "aot_eager"}}
            if precision == "float32":
                runs["ort"] = {"backend": "ort"}
            for label, options in runs.items():
                out = args.out / f"{arch}-{precision}-{label}"
                try:
                    train(out, precision=precision, steps=4, arch=arch, attention=attention, sharpen=args.sharpen,
                          **options)
                except Exception as error:  # a backend that cannot run it: said, not measured
                    print(json.dumps({"arch": arch, "precision": precision, "other": label,
                                      "fails": f"{type(error).__name__}: {str(error)[:200]}"}), flush=True)
                    continue
                if label != "eager":
                    print(json.dumps({"arch": arch, "precision": precision, "other": label,
                                      **measure(args.out / f"{arch}-{precision}-eager", out)}), flush=True)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
