"""Test helpers: assert that two dumped runs agree, and inject a known bug into one run.

    from probes.testing import assert_parity, inject_bug, perturbed_rounding
    assert_parity("eager_out", "ort_out")                            # AssertionError names the first divergence
    with perturbed_rounding(seed=1): train("eager_noise")            # a calibration run: the base again, perturbed
    assert_parity("eager_out", "compiled_out", noise="eager_noise")  # tolerances at least the noise floor

    bug = inject_bug(model, "blocks.0.mlp.0", step=2, factor=1.01)   # before the first step (ORT: before export)
    for step in range(steps):
        bug.step = step                                              # the bug reads the current step from here
        ...train...
    bug.remove()                                                     # or: with inject_bug(...) as bug: ...

Under pytest, the ``parity`` fixture is ``assert_parity`` that also writes an HTML report into the
test's tmp_path when the runs diverge (``from probes.testing import parity`` in a test module or conftest).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from exporters.handles import Handle

from .compare import Report, compare_dumps
from .compare.results import ZERO_GRAD_NOTE
from .compare.engine import CompareOptions
from .compare.terminal import counts_line, noise_floor_line, verdict
from .rounding import perturbed_rounding
from .utils.flags import takes_options

__all__ = ["assert_parity", "inject_bug", "perturbed_rounding"]


def parity_message(report: Report, limit: int = 5) -> str:
    """A few lines saying where two runs differ: the first divergence, then missing records and steps."""
    lines = [f"runs differ: {report.base} (base) vs {report.other} (other)", f"verdict: {verdict(report)}"]
    if report.first_divergence is not None:
        lines.append(f"first divergence: {report.first_divergence}")
    lines.append(counts_line(report))
    floor = noise_floor_line(report)
    if floor is not None:
        lines.append(f"noise floor: {floor}")
    for label, steps in (("only in base", report.steps_only_in_base), ("only in other", report.steps_only_in_other)):
        if steps:
            lines.append(f"steps {label}: {steps}")
    for label, keys in (("only in base", report.only_in_base), ("only in other", report.only_in_other)):
        if keys:
            shown = ", ".join(f"rank {k[0]} step {k[1]} {k[2]} {k[3]}" for k in keys[:limit])
            lines.append(f"records {label}: {shown}{' ...' if len(keys) > limit else ''}")
    if report.zero_grads:
        lines.append(f"note: {len(report.zero_grads)} records are a {ZERO_GRAD_NOTE} (not counted; "
                     "strict_zero_grads=True counts them)")
    if report.renamed:
        lines.append(f"renamed: {len(report.renamed)} names of other (first: {report.renamed[0]})")
    lines.append(f"details: python -m probes compare {report.base} {report.other}")
    return "\n".join(lines)


@takes_options(CompareOptions)
def assert_parity(base_dir: str | Path, other_dir: str | Path, *, html: str | Path | None = None,
                  **options: Any) -> Report:
    """Raises AssertionError naming the first divergence unless the two dumps agree; returns the report.

        assert_parity("eager_out", "refactored_out", name_map={r"\\.ffn\\.": ".mlp."})

    The options are ``probes.compare.compare_dumps``'s, declared once (``CompareOptions``, listed below): without
    ``rtol``/``atol``, each record's per-dtype default tolerance; ``noise``, calibration runs (the base run again
    under ``perturbed_rounding``), makes each statistic's tolerance at least its noise floor (docs/compare.md,
    Noise floor); ``name_map`` and ``fuzzy`` compare runs whose names differ (docs/names.md). ``html``: where to
    write the HTML report when the runs diverge (its path is then part of the message). Dumps this process is
    still writing are waited for first.
    """
    report = compare_dumps(base_dir, other_dir, **options)
    if report.agrees:
        return report
    message = parity_message(report)
    if html is not None:
        from .compare import write_html
        write_html(report, html)
        message += f"\nHTML report: {html}"
    raise AssertionError(message)


# --------------------------------------------------------------------------------------------- bug injection


class BugInjection(Handle):
    """Live state of an injected bug; the exported graph reaches it by pointer, so updates are seen under ORT.

    ``step`` is the current training step, set by the training loop; the bug acts while
    ``step >= from_step`` and it is not removed. Phase "forward": the layer's output is multiplied by
    ``factor`` (and, as the derivative of that, its gradient too). Phase "backward": only the gradient
    is. A ``Handle``: ``remove()`` (idempotent, or the end of a ``with`` block) removes the module hook
    and ends the bug, also in a graph ORT already exported with it.

    The scales are 0-d tensors updated in place: a torch.compile graph takes them as inputs, so a new
    ``step`` changes what the compiled bug does without a recompile (a Python number would be a guard).
    """

    def __init__(self, layer: str, from_step: int, factor: float,
                 phase: Literal["forward", "backward"], step: int = 0) -> None:
        super().__init__(self._unhook)
        self.layer = layer
        self.from_step = from_step
        self.factor = factor
        self.phase = phase
        self.handle: Any = None  # the module hook's handle
        self.output_scale = torch.ones(())  # what the layer's output is multiplied by now
        self.grad_scale = torch.ones(())  # what the gradient of the output is multiplied by now
        self.step = step

    def __repr__(self) -> str:
        return (f"BugInjection(layer={self.layer!r}, from_step={self.from_step}, factor={self.factor}, "
                f"phase={self.phase!r}, step={self.step}, active={self.active})")

    @property
    def step(self) -> int:
        """The current training step (set it before each step)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        self._refresh()

    @property
    def active(self) -> bool:
        """Whether the bug acts now: not removed, and ``step >= from_step``."""
        return super().active and self.step >= self.from_step

    @property
    def record_name(self) -> str:
        """The statistics record the bug shows up in first (the layer's first output)."""
        return f"{self.layer}.output.0"

    def _refresh(self) -> None:
        scale = self.factor if self.active else 1.0
        self.grad_scale.fill_(scale)
        self.output_scale.fill_(scale if self.phase == "forward" else 1.0)

    def _unhook(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self._refresh()  # ends the bug in graphs already built with it (ORT, torch.compile)


class ScaleOutput(torch.autograd.Function):
    """Multiplies a tensor (forward bug) or its gradient (backward bug) by the bug's scale of the step."""

    @staticmethod
    def forward(ctx: Any, bug: BugInjection, tensor: torch.Tensor) -> torch.Tensor:
        # Read when the forward runs (every step, under ORT and torch.compile too), not when the graph was built.
        ctx.bug = bug
        return tensor * bug.output_scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad * ctx.bug.grad_scale


def _scale_first_tensor(bug: BugInjection) -> Callable[..., Any]:
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return ScaleOutput.apply(bug, output)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            return type(output)([ScaleOutput.apply(bug, output[0]), *output[1:]])
        raise TypeError(f"inject_bug: {bug.layer} returns {type(output).__name__}, not a tensor or tuple of tensors")

    return hook


def inject_bug(model: torch.nn.Module, layer: str, *, step: int, factor: float = 1.01,
               phase: Literal["forward", "backward"] = "forward") -> BugInjection:
    """Scales the first output (or its gradient) of ``model``'s submodule ``layer`` from ``step`` on.

    A forward bug goes before any probe on that module (hook prepended), so the probe records the
    scaled output. A backward bug must be seen by the probe's backward, which runs after the Functions
    that come later in the forward: call ``inject_bug(..., phase="backward")`` after subscribing.
    Under ORTModule, inject before wrapping (or before the first step), so the bug is exported.
    """
    modules = dict(model.named_modules())
    if layer not in modules:
        sample = ", ".join(name for name in list(modules)[1:8])
        raise ValueError(f"inject_bug: {model.__class__.__name__} has no submodule {layer!r} (some names: {sample})")
    if phase not in ("forward", "backward"):
        raise ValueError(f"inject_bug: phase must be 'forward' or 'backward', got {phase!r}")
    bug = BugInjection(layer, step, float(factor), phase)
    bug.handle = modules[layer].register_forward_hook(_scale_first_tensor(bug), prepend=phase == "forward")
    return bug


# --------------------------------------------------------------------------------------------- pytest

# Defined only when pytest is already imported (i.e. under pytest): the demo and user scripts that import
# inject_bug or assert_parity neither need pytest nor pay for importing it.
pytest = sys.modules.get("pytest")

if pytest is not None:

    @pytest.fixture
    def parity(tmp_path: Path) -> Callable[..., Report]:
        """``assert_parity`` that writes ``<tmp_path>/parity.html`` when the runs diverge."""

        def check(base_dir: str | Path, other_dir: str | Path, **options: Any) -> Report:
            options.setdefault("html", tmp_path / "parity.html")
            return assert_parity(base_dir, other_dir, **options)

        return check
