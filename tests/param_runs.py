"""Dumps of a real training run with forward, backward, grad, param and optim records, for the compare, show and
TensorBoard tests of those phases.

    run = train_dump(tmp_path / "base", steps=3)                         # AdamW, three steps
    train_dump(tmp_path / "other", steps=3, decay={"blocks.1.fc.weight": 0.1})
    run.grads[step]["blocks.0.fc.weight"]                                # the gradient the optimizer used (float64)

A three-layer MLP trains for real (torch, CPU, a fixed seed); each record is the real statistics of a real tensor,
through the subscriber's own path (``tensor_record``: ``StepRows.add_named``), written by the ``DumpWriter``: the
Linear layers' outputs (forward), the gradients flowing back through them (backward), then per parameter in model
order the gradient after clipping (grad), the parameter after ``step()`` (param) and each state tensor (optim),
named and ordered as ``StatisticsSubscriber(parameters=True, optimizer_state=True)`` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from probes.dump.writer import DumpWriter
from dump_records import write_record
from probes.stats.one_tensor import tensor_record

LAYERS = ("blocks.0.fc", "blocks.1.fc", "head")


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)


class MLP(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(width), _Block(width)])
        self.head = torch.nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block.fc(x))
        return self.head(x)


@dataclass
class Run:
    path: Path
    grads: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # step -> parameter -> gradient used


def train_dump(path: Path, *, steps: int = 3, rank: int = 0, decay: dict[str, float] | None = None,
               clip: float | None = None, beta2: float = 0.999, nan_grad: tuple[int, str] | None = None,
               on_step_written=None) -> Run:
    """Trains ``MLP`` with AdamW for ``steps`` steps into a dump at ``path`` (see the module docstring).

    ``decay``: a weight decay for these parameters (their own parameter group; 0 for the rest); ``clip``: the
    gradients clipped to this total norm before ``step()``; ``nan_grad``: (step, parameter) whose gradient gets one
    nan element before it is recorded (that step then records no update); ``on_step_written``: the writer's listener
    (``LiveTensorBoard``).
    """
    torch.manual_seed(0)
    model = MLP()
    named = dict(model.named_parameters())
    groups = [{"params": [p for name, p in named.items() if name not in (decay or {})], "weight_decay": 0.0}]
    groups += [{"params": [named[name]], "weight_decay": value} for name, value in (decay or {}).items()]
    assert set(decay or {}) <= set(named), f"no such parameter: {sorted(set(decay or {}) - set(named))}"
    optimizer = torch.optim.AdamW(groups, lr=0.05, betas=(0.9, beta2))
    owner = {f"{layer}.{kind}": layer for layer in LAYERS for kind in ("weight", "bias")}
    run = Run(path)
    with DumpWriter(path, rank=rank, on_step_written=on_step_written) as writer:
        for step in range(steps):
            seq = iter(range(10_000))

            def write(phase: str, name: str, module: str, kind: str, tensor: torch.Tensor) -> None:
                record = {"name": name, "phase": phase, "seq": next(seq), "step": step, "rank": rank,
                          "module": module, "kind": kind}
                record.update(tensor_record(tensor.detach(), sample_count=8))
                write_record(writer, step, record)

            outputs: list[tuple[str, torch.Tensor]] = []
            hooks = [dict(model.named_modules())[layer].register_forward_hook(
                lambda module, args, out, layer=layer: outputs.append((layer, out))) for layer in LAYERS]
            generator = torch.Generator().manual_seed(100 + step)
            x, target = torch.randn(16, 8, generator=generator), torch.randn(16, 2, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), target)
            for hook in hooks:
                hook.remove()
            for layer, out in outputs:
                write("forward", f"{layer}.output.0", layer, "output", out)
            gradients: dict[str, torch.Tensor] = {}
            for layer, out in outputs:
                out.register_hook(lambda grad, layer=layer: gradients.__setitem__(layer, grad))
            optimizer.zero_grad()
            loss.backward()
            for layer, _ in reversed(outputs):
                write("backward", f"{layer}.output.0", layer, "output", gradients[layer])
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if nan_grad is not None and nan_grad[0] == step:
                named[nan_grad[1]].grad.view(-1)[0] = float("nan")
            run.grads[step] = {name: p.grad.double().numpy().copy() for name, p in named.items()}
            for name, p in named.items():
                write("grad", name, owner[name], "parameter", p.grad)
            if nan_grad is not None and nan_grad[0] == step:
                writer.finish_step(step)
                continue
            optimizer.step()
            for name, p in named.items():
                write("param", name, owner[name], "parameter", p)
            for name, p in named.items():
                for key, state in optimizer.state[p].items():
                    if isinstance(state, torch.Tensor):
                        write("optim", f"{name}.{key}", owner[name], "parameter", state)
            writer.finish_step(step)
    return run


def global_grad_norm(grads: dict[str, np.ndarray]) -> float:
    """The reference: sqrt of the sum of the squares of every finite gradient element, numpy float64."""
    values = np.concatenate([grad.ravel() for grad in grads.values()]).astype(np.float64)
    finite = values[np.isfinite(values)]
    return float(np.sqrt(np.sum(finite * finite)))
