"""The C++ TensorProbe for eager calls (``_probe_function.cpp``): its build (once per torch version), its load,
and the choice of the Function an eager probe call uses.

    apply, observed = probe_applier()          # the C++ probe where it is built, else the Python Function
    outputs = apply(SiteBinding(tracker, site), *tensors)   # as TensorProbe.apply(...), same events
    output = observed(binding, tensor)         # one tensor, the caller having checked what apply checks (below)

Both Functions do the same thing in eager PyTorch (the same identity, the same tracker calls on forward and
backward); the C++ one only spends fewer microseconds a call. Exports (ORTModule's, ONNX, TorchScript traces),
functorch transforms and tensor subclasses get the Python ``TensorProbe`` (an exported graph must hold it as
a PythonOp; functorch runs Python Functions only; a subclass's ``detach`` may be its own); torch.compile's
graphs hold their custom ops (``probes.core.compiled``), not either Function.

``PROBES_PROBE_BACKEND=auto|cpp|python`` chooses (read at each ``probe_applier()``, i.e. each subscription):
``auto`` (the default) builds the C++ probe on first use and falls back to the Python Function with one
``RuntimeWarning`` if it cannot be built; ``cpp`` raises that build's error instead; ``python`` never builds.
The build is tried once per process (a loaded extension cannot be unloaded).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, NamedTuple, Sequence

import torch

from exporters.adapters import ort_internals, torch_internals

from ..utils.extensions import BuiltOnce, build_inline
from .functions import SiteBinding, apply_probe

__all__ = ["BACKENDS", "PYTHON_APPLIERS", "ProbeAppliers", "probe_applier", "probe_backend"]

BACKENDS = ("auto", "cpp", "python")
# Bump when _probe_function.cpp changes what it exports: a build under the old name is then not reused.
VERSION = 2


def _build() -> ModuleType:
    version = re.sub(r"[^0-9a-zA-Z]+", "_", torch.__version__)
    source = Path(__file__).with_name("_probe_function.cpp").read_text()
    return build_inline(f"probes_probe_v{VERSION}_torch{version}", source, ["-O2"])


def _native_probe(build: Callable[[], ModuleType]) -> BuiltOnce[ModuleType]:
    """The C++ probe of a process: built once, or the error of its one failed build (warned about once)."""
    return BuiltOnce(build, required="probes: PROBES_PROBE_BACKEND=cpp, but the C++ probe could not be built",
                     fallback="probes: building the C++ probe failed; eager probes use the Python autograd Function "
                     "(same records, slower; PROBES_PROBE_BACKEND=python says so and skips the build)")


_NATIVE = _native_probe(_build)


def _setting() -> str:
    choice = os.environ.get("PROBES_PROBE_BACKEND", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"PROBES_PROBE_BACKEND={choice!r} is not one of {BACKENDS}")
    return choice


def probe_backend() -> str:
    """The Function eager probe calls use now: "cpp" (built on first use) or "python".

        probe_backend()   # "cpp" where a C++ compiler is installed
    """
    choice = _setting()
    if choice == "python":
        return "python"
    return "cpp" if _NATIVE.load(required=choice == "cpp", stacklevel=4) is not None else "python"


def _eager_forward(probe: SiteBinding, tensors: Sequence[torch.Tensor]) -> tuple[Callable, Any] | None:
    """What TensorProbe.forward does in an eager call, for the C++ probe: None, or the backward call and its token."""
    tracker = probe.tracker
    if tracker.observed_now():  # a left-out step records nothing
        event = tracker.probe_forward(probe.site, tensors)
        if event is not None:
            return tracker.probe_backward, event
    return None


def _observed_forward(probe: SiteBinding, tensors: Sequence[torch.Tensor]) -> tuple[Callable, Any] | None:
    """``_eager_forward`` for a caller that has checked that the step is observed now and the site is not off."""
    tracker = probe.tracker
    event = tracker.probe_forward_observed(probe.site, tensors)
    if event is not None:
        return tracker.probe_backward, event
    return None


class ProbeAppliers(NamedTuple):
    """The eager probe calls of one subscription.

    ``apply(binding, *tensors)``: any call, as ``TensorProbe.apply`` (the export, transform and tensor checks made
    here). ``observed(binding, tensor)``: one plain tensor of a module hook that has checked all ``apply`` checks
    but ORT's and ONNX's export flags (no TorchScript trace, no functorch transform), and that the step is observed
    now (not paused) and the site not switched off: the most common call, without asking any of that twice.
    """

    apply: Callable[..., Sequence[torch.Tensor]]
    observed: Callable[[SiteBinding, torch.Tensor], torch.Tensor]


def _python_observed(probe: SiteBinding, tensor: torch.Tensor) -> torch.Tensor:
    return apply_probe(probe, tensor)[0]


PYTHON_APPLIERS = ProbeAppliers(apply_probe, _python_observed)  # the Python Function's, for both calls


def probe_applier() -> ProbeAppliers:
    """The probe calls for the backend ``probe_backend()`` chooses now: with "cpp", eager calls go to the C++
    probe, else to ``apply_probe`` (the Python Function)."""
    if probe_backend() == "python":
        return PYTHON_APPLIERS
    native = _NATIVE.load(required=True).probe
    transforms_active = torch_internals.functorch_transforms_active
    exporting = ort_internals.is_exporting
    ort_exporting = ort_internals.is_ort_exporting
    onnx_exporting = torch_internals.in_onnx_export

    def apply(probe: SiteBinding, *tensors: torch.Tensor) -> Sequence[torch.Tensor]:
        if not (exporting() or transforms_active()):
            outputs = native(_eager_forward, probe, tensors)
            if outputs is not None:  # None: a tensor subclass
                return outputs
        return apply_probe(probe, *tensors)

    def observed(probe: SiteBinding, tensor: torch.Tensor) -> torch.Tensor:
        if not (ort_exporting() or onnx_exporting()):
            outputs = native(_observed_forward, probe, (tensor,))
            if outputs is not None:
                return outputs[0]
        return apply_probe(probe, tensor)[0]

    return ProbeAppliers(apply, observed)
