"""Replay one module on the inputs it had in a run: its own error, with nothing carried in from upstream.

    from probes.replay import ModuleCapture, replay_module
    capture = ModuleCapture("captured", module="encoder.layers.0.self_attn", step=3)
    SubscriberManager().subscribe(model, [StatisticsSubscriber("eager"), capture])   # an eager run
    ...train past step 3...
    report = replay_module("captured", model.encoder.layers[0].self_attn, backend="compile")
    print(format_report(report))   # the module alone, eager against compiled, on the same inputs, op by op

The stages:

1. *Capture* (``ModuleCapture``, a subscriber, eager runs): the first call of the module in the chosen step stores
   the call's arguments (tensors, and the numbers, strings, ``None`` and nested tuples, lists and dicts around them),
   the module's parameters and buffers, its outputs, and, when the backward reaches them, the gradients of its
   outputs; written when the step ends. Tensors go to one ``.npz`` (``allow_pickle=False``), the structure to JSON: nothing is
   ever loaded with pickle. A call whose arguments hold something else (a cache object) is not captured: one warning.
2. *Replay* (``replay_module``): the module you pass (any instance of the same code; it is not modified) is copied
   twice, each copy given the captured parameters, and run alone on the captured arguments, once eagerly and once on
   ``backend`` (``"eager"``, ``"compile"``, or ``"ort"`` for ORTModule on the module alone), each with a
   ``StatisticsSubscriber`` recording its submodules' outputs and every operation inside it (``ops="*"``); then the
   captured output gradients run the backward. The module runs as the child ``module`` of a wrapper that takes the
   call's tensors only (the numbers stay numbers on every backend): its records are named ``module/<op>:<k>...``,
   ``module.<submodule>.output.<i>``.
3. *Compare*: the two replays' dumps, compared as any two runs (``compare_dumps``): the first divergence is the
   module's own. The eager replay is checked against the captured outputs first (``ReplayError`` when they differ:
   the capture did not hold everything the module reads, e.g. a random draw).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .compare import Report, compare_dumps
from .core import SubscriberBase, SubscriberManager
from .core.sites import ProbeEvent, ProbeSite
from .dump.layout import safe_component, write_durably
from .stats import StatisticsSubscriber
from .utils.checks import check_int
from .utils.tree import TensorLeaves

__all__ = ["ModuleCapture", "replay_module"]

_FORMAT = "probes-module-capture-1"
_BACKENDS = ("eager", "compile", "ort")


class ReplayError(RuntimeError):
    """A capture cannot be read or replayed; the message says what is wrong and what to do."""


class _Unsupported(TypeError):
    pass


class ModuleCapture(SubscriberBase):
    """Stores one module's call (arguments, parameters, outputs, output gradients) in one step; see the module docstring.

        capture = ModuleCapture("captured", module="blocks.0.attn", step=0)
    """

    event_kinds = frozenset({"forward", "backward", "step_end"})

    def __init__(self, output_dir: str | os.PathLike, *, module: str, step: int) -> None:
        if not isinstance(module, str) or not module:
            raise ValueError(f"module must be a module's qualified name (e.g. 'blocks.0.attn'), got {module!r}")
        super().__init__(steps=[check_int(step, "step (the step whose call is captured)")], modules=[module])
        self.output_dir = Path(output_dir)
        self.module = module
        self.step = step
        self._call: tuple[tuple, dict, dict] | None = None  # the latest call's arguments and state, by reference
        self._pending: dict[str, Any] | None = None  # the captured call, until its step ends
        self.captured = False

    # The subscriber calls ---------------------------------------------------------------------------
    # The call is held by reference when it begins (a graph-building call: it sees the arguments), and copied
    # when its output probe fires in the chosen step (which only then is known): nothing is copied otherwise.

    def pre_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, kwargs: dict):
        if site.name == self.module and not self.captured and not torch.compiler.is_compiling():
            self._call = (args, kwargs, module.state_dict(keep_vars=True))
        return args, kwargs

    def on_event(self, event: ProbeEvent) -> None:
        kind = event.kind
        if kind == "forward":
            self._forward(event)
        elif kind == "backward":
            pending = self._pending
            if pending is not None and event.step == self.step and event.call == 0:
                pending["grads"] = [None if grad is None else _host(grad) for grad in event.tensors]
        elif kind == "step_end" and event.step == self.step:
            self._write()

    def _forward(self, event: ProbeEvent) -> None:
        call, self._call = self._call, None
        if (call is None or self._pending is not None or self.captured or event.step != self.step
                or event.site.kind != "output" or event.call != 0 or torch.jit.is_tracing()):
            return
        args, kwargs, state = call
        try:
            leaves: dict[str, torch.Tensor] = {}
            structure = {"args": _encode(list(args), leaves, "args"), "kwargs": _encode(kwargs, leaves, "kwargs")}
        except _Unsupported as error:
            warnings.warn(f"probes: ModuleCapture cannot store the call of {self.module!r} in step {self.step}: "
                          f"{error}. Nothing was captured; training goes on.", stacklevel=2)
            self.captured = True
            return
        leaves.update({f"state/{name}": value for name, value in state.items()})
        self._pending = {"structure": structure, "tensors": {key: _host(value) for key, value in leaves.items()},
                         "requires_grad": {key: bool(value.requires_grad) for key, value in leaves.items()},
                         "state": sorted(state), "outputs": [_host(tensor) for tensor in event.tensors],
                         "grads": [None] * len(event.tensors)}

    def close(self) -> None:
        self._write()

    # The files ----------------------------------------------------------------------------------------

    def _write(self) -> None:
        pending, self._pending = self._pending, None
        self.captured = True
        if pending is None:
            return
        arrays, dtypes = {}, {}
        for key, value in pending["tensors"].items():
            arrays[key], dtypes[key] = _to_numpy(value)
        for kind in ("outputs", "grads"):
            for index, value in enumerate(pending[kind]):
                if value is not None:
                    key = f"{kind}/{index}"
                    arrays[key], dtypes[key] = _to_numpy(value)
        where = _capture_dir(self.output_dir, self.module, self.step)
        where.mkdir(parents=True, exist_ok=True)
        with open(where / "tensors.npz", "wb") as file:
            np.savez(file, **arrays)
        meta = {"format": _FORMAT, "module": self.module, "step": self.step,
                "structure": pending["structure"], "state": pending["state"], "dtypes": dtypes,
                "requires_grad": pending["requires_grad"],
                "outputs": len(pending["outputs"]), "grads": [g is not None for g in pending["grads"]]}
        write_durably(where / "capture.json", json.dumps(meta, indent=1).encode())


def replay_module(capture_dir: str | os.PathLike, module: torch.nn.Module, *, backend: str = "compile",
                  step: int | None = None, name: str | None = None, output_dir: str | os.PathLike | None = None,
                  backward: bool = True) -> Report:
    """The module alone on its captured call, eagerly and on ``backend``, compared record by record (ops included).

        report = replay_module("captured", model.blocks[0].attn, backend="compile")

    ``module`` is not modified (copies are run). ``step``/``name``: which capture, when the directory holds several.
    ``output_dir``: where the two replays' dumps go (``eager`` and ``<backend>`` in it; a new temporary directory by
    default). ``backward``: also run the backward with the captured output gradients.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {backend!r}")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"replay_module needs the module to run (a torch.nn.Module), got {type(module).__qualname__}")
    where = _find_capture(Path(capture_dir), step, name)
    meta = _read_meta(where)
    with np.load(where / "tensors.npz", allow_pickle=False) as archive:
        stored = {key: _from_numpy(archive[key], meta["dtypes"][key]) for key in archive.files}
    out = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="probes-replay-"))
    dumps = {}
    for run in ("eager", backend) if backend != "eager" else ("eager", "eager-again"):
        dumps[run] = out / run
        outputs = _run(module, meta, stored, run.split("-")[0], dumps[run], backward)
        if run == "eager":
            _check_reproduced(meta, stored, outputs)
    return compare_dumps(dumps["eager"], dumps[backend if backend != "eager" else "eager-again"])


def _run(module: torch.nn.Module, meta: dict, stored: dict[str, torch.Tensor], backend: str, dump: Path,
         backward: bool) -> list[torch.Tensor]:
    replica = copy.deepcopy(module)
    state = {name: stored[f"state/{name}"] for name in meta["state"]}
    try:
        replica.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ReplayError(f"the module passed to replay_module is not the captured module's kind "
                          f"({meta['module']!r}): {str(error).splitlines()[0]}; pass the same module "
                          "of a model built by the same code") from None
    requires = meta["requires_grad"]
    leaves = {key: value.clone().requires_grad_(requires.get(key, False) and value.is_floating_point())
              for key, value in stored.items() if not key.startswith(("state/", "outputs/", "grads/"))}
    keys = sorted(leaves, key=lambda key: int(key.split("/")[1]))
    bound = _Bound(replica, meta["structure"], keys)
    manager = SubscriberManager()
    # Inputs are not recorded: they are the captured ones in both runs.
    subscriber = StatisticsSubscriber(dump, override_output_dir=True, ops="*")
    with manager.subscribe(bound, [subscriber]):
        runner: Any = bound
        if backend == "compile":
            runner = torch.compile(bound)
        elif backend == "ort":
            from onnxruntime.training.ortmodule import ORTModule
            runner = ORTModule(bound)
        outputs = runner(*(leaves[key] for key in keys))
        tensors = TensorLeaves.of(outputs).tensors
        pairs = [(tensor, stored[f"grads/{index}"]) for index, tensor in enumerate(tensors)
                 if f"grads/{index}" in stored and tensor.requires_grad]
        if backward and pairs:
            torch.autograd.backward([tensor for tensor, _ in pairs], [grad for _, grad in pairs])
        manager.flush()
    return [tensor.detach() for tensor in tensors]


class _Bound(torch.nn.Module):
    """The replayed module with its call's numbers, strings and structure bound: its forward takes the call's tensors
    only, so every backend sees the numbers as the model's code did (ORTModule would make its inputs tensors)."""

    def __init__(self, module: torch.nn.Module, structure: dict, keys: list[str]) -> None:
        super().__init__()
        self.module = module
        self._structure, self._keys = structure, keys

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = dict(zip(self._keys, tensors))
        return self.module(*_decode(self._structure["args"], leaves), **_decode(self._structure["kwargs"], leaves))


def _check_reproduced(meta: dict, stored: dict[str, torch.Tensor], outputs: list[torch.Tensor]) -> None:
    expected = [stored[f"outputs/{index}"] for index in range(meta["outputs"])]
    same = len(expected) == len(outputs) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device)) for a, b in zip(expected, outputs))
    if not same:
        raise ReplayError(f"replaying {meta['module']!r} eagerly on its captured call did not give the captured "
                          "outputs: the module reads something the capture does not hold (a random draw, global "
                          "state, a different module passed); make the call deterministic (dropout off) and capture again")


# The capture's files -------------------------------------------------------------------------------------

def _capture_dir(root: Path, module: str, step: int) -> Path:
    return root / f"step_{step:06d}" / safe_component(module)


def _find_capture(root: Path, step: int | None, name: str | None) -> Path:
    found = sorted(path.parent for path in root.glob("step_*/*/capture.json"))
    if step is not None:
        found = [path for path in found if path.parent.name == f"step_{step:06d}"]
    if name is not None:
        found = [path for path in found if path.name == safe_component(name)]
    if len(found) != 1:
        what = "no capture" if not found else f"{len(found)} captures ({', '.join(p.name for p in found)})"
        raise ReplayError(f"{root}: {what} found; pass the directory a ModuleCapture wrote (and step=/name= to choose)")
    return found[0]


def _read_meta(where: Path) -> dict:
    try:
        meta = json.loads((where / "capture.json").read_text())
    except (OSError, ValueError) as error:
        raise ReplayError(f"{where / 'capture.json'}: unreadable ({error}); capture again") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ReplayError(f"{where / 'capture.json'}: not a probes module capture ({_FORMAT})")
    return meta


# Tensors and the structure around them ---------------------------------------------------------------------

def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy on the host: what the capture keeps of a tensor."""
    return tensor.detach().to("cpu", copy=True)


def _to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy(), dtype
    return tensor.contiguous().numpy(), dtype


def _from_numpy(array: np.ndarray, dtype: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def _encode(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"leaf/{len(tensors)}"
        tensors[key] = value
        return {"tensor": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        items = [_encode(item, tensors, f"{path}[{index}]") for index, item in enumerate(value)]
        return {"tuple" if isinstance(value, tuple) else "list": items}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: _encode(item, tensors, f"{path}[{key!r}]") for key, item in value.items()}}
    raise _Unsupported(f"{path} is a {type(value).__qualname__}, which a capture cannot store")


def _decode(value: Any, leaves: dict[str, torch.Tensor]) -> Any:
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        return leaves[value["tensor"]]
    if "dtype" in value:
        return getattr(torch, value["dtype"])
    if "dict" in value:
        return {key: _decode(item, leaves) for key, item in value["dict"].items()}
    items = [_decode(item, leaves) for item in value.get("tuple", value.get("list", []))]
    return tuple(items) if "tuple" in value else items
