"""Op-level records: every torch operation called inside chosen modules passes through a probe of its own.

    StatisticsSubscriber("out", ops="encoder.layers.0.*", steps=[0])   # what a user writes
    recorder = OpRecorder(manager._probe_op)                          # the manager owns one
    outputs = recorder.run_paused(hook, *args)   # the probes' own code inside a scope: its torch calls are not the model's
    recorder.enter(scope)                # an op-selected module's forward begins (its pre-hook)
    recorder.leave(scope.module_index)   # ... and ends (its forward hook)
    recorder.close()                     # the root's call ended (also when it raised): no scope, no provenance

The stages:

1. *Scope*: the manager opens a ``Scope`` (module name, index, depth, class) when the forward of a module
   whose operations some subscriber selects (``ops=``) begins, and closes it when the forward ends. While
   a scope is open, the recorder is a ``TorchFunctionMode``: it sees each call of a torch function (``torch.*``,
   ``torch.nn.functional.*``, ``Tensor`` methods and operators) made by the model's Python code. Calls made
   inside such a call (``F.softmax`` calling ``Tensor.softmax``) are not seen again: a record is one call the
   model's code made, the same Python call in eager, in ORTModule's export trace and in dynamo's trace.
2. *Name*: the call's record is ``<module>/<op>:<k>``: the innermost open scope's module, the function's name
   (underscores stripped: ``__matmul__`` is ``matmul``), and the count of earlier calls of that op in this call
   of the module. The same code gives the same names on every backend and in every run.
3. *Probe*: the call's floating-point tensor outputs pass through the manager's probe for that name
   (eager: ``TensorProbe``, which ORTModule's export turns into a PythonOp; dynamo: the compiled probe ops),
   so forward and backward get records like a module's outputs.
4. *Provenance*: each op site lists, for each tensor argument, the record name it was (an earlier op's output,
   the module's inputs, a submodule's outputs), so that compare can tell an error made by the op from one that
   reached it. Not under dynamo (identity of traced tensors is not traceable): there the list is empty.

Calls left out, because a record of them would say nothing new or could change training: calls with no tensor
argument and ``*_like``/``new_*`` (constants: ``torch.zeros``, ``arange``, ``empty_like``), views and in-place or ``out=`` calls (by the aten schema's
alias annotations: a probe's output is a new tensor, and an in-place write through a probed view would not reach
its base's autograd history), indexing (``x[...]``), ``clone``/``contiguous``/``detach``, a cast that keeps the
dtype, an output that is one of the arguments (dropout in eval), and outputs that are not floating point.
Direct calls of ``torch.ops.*`` operators are left out too (the model's code calls torch functions).

*Read records* (``read_name``): what some left-out calls make is read where it is made, so that the operations
reading it can name it (compare then names a view or a draw that differs): a view or indexing that changes shape
or strides, a constant (no tensor argument, ``*_like``, ``new_*``; never unset memory: ``empty``), a random draw
(its integer outputs too; an in-place draw after it). Named ``<module>/<call>:<k>`` as op records are, they pass
the manager's probe detached (``read``), whose outputs are dropped: a forward record only, the model's tensor and
its autograd history untouched, no draw repeated. Made where the call is made, the same on every backend (dynamo
cannot trace which tensors a later call reads).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode

from exporters.adapters import torch_internals

__all__ = ["OpRecorder", "Scope"]

_INPLACE_OPERATORS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                                "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                                "__irshift__", "__setitem__"})
_COPIES = frozenset({"clone", "contiguous", "detach", "detach_", "requires_grad_", "retain_grad", "data_ptr"})
_CASTS = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16"})
_DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                       "feature_dropout"})


def _identity_dropout(args: Sequence[Any], kwargs: dict) -> bool:
    """A dropout that changes nothing (``p`` 0, or not training): ``F.dropout(x, p, training)``, ``torch.dropout(x, p,
    train)``."""
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    return p == 0 or not training


# What ``op_name`` gives for calls that get no record but matter to provenance: a view stands for its first argument;
# an in-place call changes its argument, whose source then no longer says what it holds.
_VIEW, _INPLACE = "", "!"


@torch_internals.constant_while_tracing
def op_name(func: Callable) -> str | None:
    """The name an op record gets for calls of ``func``; ``_VIEW`` or ``_INPLACE`` for a view or an in-place call (no
    record); None for any other call left out (see the module docstring)."""
    return _op_name(func)


@functools.lru_cache(maxsize=None)
def _op_name(func: Callable) -> str | None:
    raw = getattr(func, "__name__", None)
    if not isinstance(raw, str) or raw in ("__get__", "__set__", "__delitem__"):
        return None
    if getattr(func, "namespace", None) is not None:  # ``torch.ops.*`` (the probes' own compiled ops among them)
        return None
    if raw in _INPLACE_OPERATORS:
        return _INPLACE
    if raw == "__getitem__":  # a view, or a gather whose values are its argument's: no record either way
        return _VIEW
    if raw in _COPIES:
        return _INPLACE if raw.endswith("_") else _VIEW
    name = raw.strip("_")
    if not name:
        return None
    if raw.endswith("_") and not raw.endswith("__"):  # ``add_``: in place
        return _INPLACE
    if name in _CASTS:
        return name
    if name.endswith("_like") or name.startswith("new_"):  # ``empty_like``, ``new_zeros``: constants of a shape
        return None
    aliasing = torch_internals.torch_function_aliases(name)
    return _INPLACE if aliasing == "write" else _VIEW if aliasing else name


# Calls whose values are drawn: their integer outputs are read too (``randperm``'s order, ``multinomial``'s choice), and
# their in-place forms (``uniform_``) are read after the draw.
_RANDOM = frozenset({"rand", "randn", "randint", "randperm", "bernoulli", "multinomial", "normal", "poisson",
                     "rand_like", "randn_like", "randint_like", "uniform", "exponential", "geometric", "cauchy",
                     "log_normal", "random"})
# Calls that make memory without values: a record would read whatever the memory held.
_UNSET = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})


@torch_internals.constant_while_tracing
def read_name(func: Callable) -> str | None:
    """The name of the read record of what a call of ``func`` that ``op_name`` leaves out made (``getitem``,
    ``transpose``, ``zeros_like``, ``uniform``): a view or indexing, a constant of a shape, an in-place random draw;
    None for a call whose output gets no read record (a copy, a cast, another in-place call, unset memory, a call that
    makes no tensor). Calls with no tensor argument (``zeros``, ``rand``) are read under their ``op_name``."""
    return _read_name(func)


@functools.lru_cache(maxsize=None)
def _read_name(func: Callable) -> str | None:
    kind = _op_name(func)
    raw = getattr(func, "__name__", "")
    name = raw.strip("_")
    if kind == _VIEW:
        return None if raw in _COPIES else name
    if kind == _INPLACE:
        return name if name in _RANDOM else None
    if kind is None and (name.endswith("_like") or name.startswith("new_")) and getattr(func, "namespace", None) is None:
        return None if name in _UNSET else name
    return None


@dataclass(eq=False)
class Scope:
    """One call of an op-selected module: where its operations' records belong."""

    module: str  # the module's qualified name
    module_index: int
    counts: dict[str, int] = field(default_factory=dict)  # calls of each op so far in this call of the module


ProbeOp = Callable[[str, "list[str] | None", Sequence[torch.Tensor]], "Sequence[torch.Tensor] | None"]
ReadOp = Callable[[str, "list[str] | None", Sequence[torch.Tensor]], None]


class OpRecorder(TorchFunctionMode):
    """Sees the torch function calls made inside open scopes and passes their outputs through ``probe``.

    ``probe(name, inputs, tensors)`` returns the tensors to continue with (the manager's probe of the op site
    ``name``; None: unchanged); ``inputs`` is the provenance list (None under dynamo). ``read(name, inputs, tensors)``
    records detached tensors that a left-out call made (the same probe, its outputs dropped). ``run_paused`` runs
    the probes' own code inside a scope (hooks, subscribers), whose torch calls are not the model's.
    """

    def __init__(self, probe: ProbeOp, read: ReadOp) -> None:
        super().__init__()
        self._probe = probe
        self._read = read
        self.scopes: list[Scope] = []
        self._entered = False
        self._paused = 0
        # id(tensor) -> (weak reference, record name): where the tensors the model holds now came from.
        self._producers: dict[int, tuple[weakref.ref, str]] = {}

    # Scopes ---------------------------------------------------------------------------------------

    def enter(self, scope: Scope) -> None:
        if not self._active():
            self.scopes.clear()  # left by a forward that never reached its hook (see ``_active``)
            self.__enter__()
            self._entered = True
        self.scopes.append(scope)

    def leave(self, module_index: int) -> None:
        """Closes the innermost scope of that module (and any scope a raising forward left open inside it)."""
        scopes = self.scopes
        for position in range(len(scopes) - 1, -1, -1):
            if scopes[position].module_index == module_index:
                del scopes[position:]
                break
        if not scopes:
            self._exit()

    def close(self) -> None:
        """Leaves the mode and forgets the step's provenance (the root's forward ended, or raised)."""
        self.scopes.clear()
        self._producers.clear()
        self._exit()

    def _active(self) -> bool:
        """Whether this mode is on the thread's mode stack now. Not always what ``_entered`` says: a forward
        recomputed inside a backward (activation checkpointing) may stop before its module's forward hook, and
        the autograd engine restores the mode stack around each backward node."""
        if torch.compiler.is_compiling():
            return self._entered
        return self._entered and any(mode is self for mode in torch_internals.function_mode_stack())

    def _exit(self) -> None:
        if not self._active():
            self._entered = False
            return
        if torch.compiler.is_compiling() or torch_internals.function_mode_stack()[-1] is self:
            self._entered = False
            self.__exit__(None, None, None)
        # else: a mode entered after this one is still open (the user's): this one leaves when that one has

    def run_paused(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its torch calls not recorded (nothing to pause while no scope is open)."""
        if not self.scopes:
            return fn(*args)
        self._paused += 1
        try:
            return fn(*args)
        finally:
            self._paused -= 1

    # Provenance -----------------------------------------------------------------------------------

    def produced(self, tensors: Sequence[Any], names: Sequence[str]) -> None:
        """``tensors[i]`` is the record ``names[i]`` from now on (eager and export traces only)."""
        if torch.compiler.is_compiling():
            return
        for tensor, name in zip(tensors, names):
            if isinstance(tensor, torch.Tensor):
                self._producers[id(tensor)] = (weakref.ref(tensor), name)

    def _source(self, tensor: torch.Tensor) -> str:
        known = self._producers.get(id(tensor))
        return known[1] if known is not None and known[0]() is tensor else ""

    def _pass_source(self, kind: str, argument: torch.Tensor, result: Any) -> None:
        """A view of a recorded tensor differs where that tensor differs: it keeps its source. A tensor changed in
        place is no longer what its record saw: it loses its source."""
        if kind == _INPLACE:
            self._producers.pop(id(argument), None)
            return
        source = self._source(argument)
        if source:
            outputs = (result,) if isinstance(result, torch.Tensor) else result if type(result) in (tuple, list) else ()
            self.produced(outputs, [source] * len(outputs))

    def _site(self, name: str, arguments: Sequence[torch.Tensor]) -> tuple[str, "list[str] | None"]:
        """The site name of this call of ``name`` in the innermost scope (``<module>/<name>:<k>``, counted), and the
        provenance of its tensor ``arguments`` (None under dynamo)."""
        scope = self.scopes[-1]
        count = scope.counts.get(name, 0)
        scope.counts[name] = count + 1
        inputs = None if torch.compiler.is_compiling() else [self._source(tensor) for tensor in arguments]
        return f"{scope.module}/{name}:{count}", inputs

    def _read_made(self, name: str, arguments: Sequence[torch.Tensor], result: Any, view: bool = False) -> bool:
        """Read what a left-out call ``name`` made (``result``): its floating-point tensors (and a draw's integer ones)
        get a forward record ``<module>/<name>:<k>``, read detached, and are that record from now on. A view that
        reads its argument as it is (same shape and strides) gets none. Whether it made a record."""
        outputs = (result,) if isinstance(result, torch.Tensor) else result if type(result) in (tuple, list) else ()
        drawn = name in _RANDOM
        made = [out for out in outputs if isinstance(out, torch.Tensor) and (drawn or out.is_floating_point())
                and not torch_internals.is_traced_number(out)
                and not (view and out.shape == arguments[0].shape and out.stride() == arguments[0].stride())]
        if not made:
            return False
        site_name, inputs = self._site(name, arguments)
        self.run_paused(self._read, site_name, inputs, [tensor.detach() for tensor in made])
        self.produced(made, [f"{site_name}.output.{k}" for k in range(len(made))])
        return True

    # The mode -------------------------------------------------------------------------------------

    def __torch_function__(self, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.scopes or self._paused:
            return result
        name = op_name(func)
        if "out" in kwargs:
            return result
        made = read_name(func)
        if name is None and made is None:
            return result
        arguments = [leaf for leaf in (*args, *kwargs.values()) if isinstance(leaf, torch.Tensor)]
        arguments += [item for leaf in args if isinstance(leaf, (list, tuple))
                      for item in leaf if isinstance(item, torch.Tensor)]
        if torch.jit.is_tracing():  # the tracer's stand-ins for sizes are the numbers eager code holds
            arguments = [tensor for tensor in arguments if not torch_internals.is_traced_number(tensor)]
        if not arguments:  # a constant or a random draw: read
            if name and name != _INPLACE and name not in _UNSET:
                self._read_made(name, arguments, result)
            return result
        if name in _DROPOUTS and _identity_dropout(args, kwargs):
            name, made = _VIEW, None  # eager returns its input itself, a compiled graph a copy: no operation either way
        if name is None or name == _VIEW or name == _INPLACE:
            if made is not None and self._read_made(made, arguments, arguments[0] if name == _INPLACE else result,
                                                    view=name == _VIEW):
                return result
            if name is not None and not torch.compiler.is_compiling():
                self._pass_source(name, arguments[0], result)
            return result
        single = isinstance(result, torch.Tensor)
        outputs = (result,) if single else result if type(result) in (tuple, list) else None
        if outputs is None:
            return result
        positions = [i for i, out in enumerate(outputs) if isinstance(out, torch.Tensor) and out.is_floating_point()
                     and not any(out is argument for argument in arguments)  # returned as it came: no operation
                     and not torch_internals.is_traced_number(out)]
        if name in _CASTS:  # a cast records what it changed: a cast to the same dtype is no operation
            positions = [i for i in positions if outputs[i].dtype != arguments[0].dtype]
        if not positions:
            return result
        site_name, inputs = self._site(name, arguments)
        probed = self.run_paused(self._probe, site_name, inputs, [outputs[i] for i in positions])
        if probed is None:
            return result
        replaced = list(outputs)
        for i, tensor in zip(positions, probed):
            replaced[i] = tensor
        self.produced([replaced[i] for i in positions], [f"{site_name}.output.{k}" for k in range(len(positions))])
        if single:
            return replaced[0]
        return type(result)(replaced) if type(result) is tuple or type(result) is list else result
