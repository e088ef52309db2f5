"""Every private torch call of the project, and every difference between the torch versions it runs on.

The probes, the exporters and the statistics kernel reach torch's private API only through here, so
a torch upgrade touches one file. Supported: torch >= 2.1, < 2.15 (tested: 2.4.1 and 2.13.0).

- The TorchScript ONNX exporter: torch 2.9 moved its modules under
  ``torch.onnx._internal.torchscript_exporter`` and made ``torch.onnx.export`` default to the dynamo
  exporter; the symbolic registry, the export globals and the graph context are otherwise the same.
- The autograd engine: which backward pass (graph task) runs now, and a callback when it ends.
- Tracing state (pausing a TorchScript trace, the tracer's stand-ins for Python numbers), ONNX element types, the C++ extension build directory,
  whether a tensor dispatches to Python (a ``__torch_dispatch__`` subclass), and torch's pytree
  (``torch.utils._pytree``), which probes uses to flatten module outputs.
- Python dispatch modes (``torch.utils._python_dispatch``): a mode that sees every aten operation of one
  thread, and what an operator's schema says (its name, whether an output aliases an input); the
  calibration run of ``probes.rounding`` uses them.

    from exporters.adapters import torch_internals as compat
    with compat.override_symbolic("prim::PythonOp", 17, my_symbolic): ...   # or keep the Handle, .remove()
    compat.onnx_export(model, args, buffer, opset_version=17, training=torch.onnx.TrainingMode.TRAINING)
    task = compat.current_backward()          # None outside a backward pass
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from types import ModuleType
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree  # noqa: F401  (re-exported: torch's pytree, private by name)

from ..handles import Handle

Symbolic = Callable[..., Any]

SUPPORTED_TORCH = ((2, 1), (2, 15))
_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


class TorchInternalsError(RuntimeError):
    """torch lacks a private call the project relies on; the message names it and what to do."""


def _missing(what: str) -> TorchInternalsError:
    low, high = (".".join(map(str, bound)) for bound in SUPPORTED_TORCH)
    return TorchInternalsError(
        f"torch {torch.__version__} has no {what}; probes supports torch >= {low}, < {high}: install a "
        "supported torch or update exporters/adapters/torch_internals.py"
    )


@functools.cache
def _exporter_modules() -> tuple[ModuleType, ModuleType]:
    """(registration, _globals) of the TorchScript exporter.

    Imported on first use: with onnxruntime-training installed, importing torch.onnx on torch 2.4
    imports ORTModule too (seconds), which ``import exporters`` must not cost.
    """
    try:  # torch >= 2.9
        from torch.onnx._internal.torchscript_exporter import _globals, registration
    except ImportError:  # torch 2.4
        from torch.onnx import _globals  # type: ignore[no-redef]
        from torch.onnx._internal import registration  # type: ignore[no-redef]
    return registration, _globals


def export_training_mode() -> bool:
    """True when the running TorchScript export exports a training graph."""
    mode = _exporter_modules()[1].GLOBALS.training_mode
    if isinstance(mode, bool):
        return mode
    return mode == torch.onnx.TrainingMode.TRAINING


def export_opset() -> int:
    """The opset of the running (or last) TorchScript export."""
    return int(_exporter_modules()[1].GLOBALS.export_onnx_opset_version)


def active_symbolic(name: str, opset: int) -> Symbolic | None:
    """The symbolic the exporter would call now for ``name`` ("domain::op") at ``opset``."""
    group = _exporter_modules()[0].registry.get_function_group(name)
    return group.get(opset) if group is not None else None


def _custom_override(name: str, opset: int) -> Symbolic | None:
    group = _exporter_modules()[0].registry.get_function_group(name)
    # The registry keeps custom functions per exact opset next to the built-in ones; only a custom
    # function registered at this very opset is replaced by ours and must be put back afterwards.
    if group is None or not group._functions.overridden(opset):
        return None
    return group._functions[opset]


def override_symbolic(name: str, opset: int, symbolic: Symbolic) -> Handle:
    """Make ``symbolic`` the custom symbolic of ``name`` at ``opset``; ``remove()`` on the handle undoes it.

    The undo puts back what was registered at that opset before (or nothing), and leaves the
    registry alone if someone replaced ``symbolic`` in the meantime.
    """
    registry = _exporter_modules()[0].registry
    previous = _custom_override(name, opset)
    registry.register(name, opset, symbolic, custom=True)

    def restore() -> None:
        if _custom_override(name, opset) is not symbolic:
            return
        if previous is None:
            registry.unregister(name, opset)
        else:
            registry.register(name, opset, previous, custom=True)

    return Handle(restore)


def python_op_class(node: torch._C.Node) -> type:
    """The autograd Function class a traced ``prim::PythonOp`` node applies."""
    return node.pyobj().__self__


def onnx_export(model: torch.nn.Module, args: tuple, f: Any, **kwargs: Any) -> None:
    """``torch.onnx.export`` with the TorchScript exporter on every supported torch."""
    with warnings.catch_warnings():
        # torch 2.13 deprecates the TorchScript exporter; torch 2.4 warns about traced Python values.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(model, args, f, dynamo=False, **kwargs)


# The autograd engine -------------------------------------------------------------------------------
# A backward pass is one graph task of the engine (one ``backward()`` or ``torch.autograd.grad`` call;
# a reentrant checkpoint runs a nested one). A module forward that runs while a graph task is running
# is a recomputation (activation checkpointing), not a step of training.

@functools.cache
def _engine_api() -> tuple[Callable[[], int], Callable[[Callable[[], None]], None]]:
    current = getattr(torch._C, "_current_graph_task_id", None)
    queue = getattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback", None)
    if current is None or queue is None:
        raise _missing("torch._C._current_graph_task_id or Variable._execution_engine.queue_callback")
    return current, queue


def current_backward() -> int | None:
    """The id of the graph task the autograd engine runs on this thread, or None outside backward."""
    task = _engine_api()[0]()
    return None if task < 0 else task


def call_when_backward_ends(callback: Callable[[], None]) -> None:
    """Runs ``callback`` once the current graph task has finished (call only inside a backward)."""
    _engine_api()[1](callback)


# Tracing, ONNX types, C++ extensions ---------------------------------------------------------------

@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Pause a running TorchScript trace (ONNX export): what runs inside is executed, not recorded."""
    state = torch._C._get_tracing_state()
    if state is None:
        yield
        return
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


# What Python's number operators record on the 0-dim tensors a trace gives for sizes (``h // 2``, ``h * w``...).
_NUMBER_OPS = frozenset(f"aten::{name}" for name in (
    "add", "sub", "rsub", "mul", "div", "floor_divide", "floordiv", "remainder", "fmod", "neg", "pow", "abs",
    "ceil", "floor", "round", "minimum", "maximum", "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__",
    "__xor__", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "__lshift__", "__rshift__"))


def is_traced_number(tensor: torch.Tensor) -> bool:
    """True when, inside a TorchScript trace, ``tensor`` is the tracer's stand-in for a Python number of the
    traced code: a size (``x.shape[i]``, ``x.size(i)``: ``prim::NumToTensor``) or arithmetic on such numbers
    (``(h + 1) // 2``), which eager code holds as an int. False outside a trace and for every tensor the
    code computes as a tensor (``torch.arange(h)``, ``mask.sum()``, ``torch.tensor(h)``).
    """
    if tensor.dim() != 0 or torch._C._get_tracing_state() is None:
        return False
    value_trace = getattr(torch._C, "_get_value_trace", None)
    if value_trace is None:
        raise _missing("torch._C._get_value_trace (the traced value of a tensor)")
    try:
        value = value_trace(tensor)
    except RuntimeError:  # not a value of this trace (made before it began)
        return False
    return _traced_number(value, depth=0)


def _traced_number(value: torch._C.Value, depth: int) -> bool:
    node = value.node()
    kind = node.kind()
    if kind == "prim::NumToTensor":
        return True
    if kind not in _NUMBER_OPS or depth > 64:
        return False
    found = False
    for operand in node.inputs():
        if operand.node().kind() == "prim::Constant" or not isinstance(operand.type(), torch._C.TensorType):
            continue  # a literal (``2`` in ``h // 2``) or a non-tensor operand (``alpha``)
        if not _traced_number(operand, depth + 1):
            return False
        found = True
    return found


def onnx_element_type(dtype: torch.dtype) -> int:
    """The ONNX ``TensorProto`` element type of a torch dtype."""
    try:  # torch >= 2.9
        from torch.onnx._internal.torchscript_exporter import _type_utils
    except ImportError:  # torch 2.4
        from torch.onnx import _type_utils  # type: ignore[no-redef]
    return int(_type_utils.JitScalarType.from_dtype(dtype).onnx_type())


def extension_build_directory(name: str) -> str | None:
    """Where ``cpp_extension.load_inline(name=...)`` builds, or None when this torch does not say."""
    from torch.utils import cpp_extension

    get = getattr(cpp_extension, "_get_build_directory", None)
    return None if get is None else get(name, verbose=False)


# torch.compile -----------------------------------------------------------------------------------

def compiled_alias(tensor: torch.Tensor) -> torch.Tensor:
    """What a compiled probe Function returns for ``tensor``: an alias autograd does not take for a view (so
    in-place ops after the probe stay legal), made by an op that keeps ``requires_grad`` where torch 2.4's
    dynamo traces it (it takes the outputs of a Function's traced forward for the Function's: a ``detach()``
    there made every probe output look constant to the probes after it, which then got no backward)."""
    if tensor.layout != torch.strided or tensor.is_nested:
        return tensor.detach()
    return torch.ops.aten._unsafe_view.default(tensor, tensor.shape)


def set_version(tensor: torch.Tensor, version: int) -> None:
    """Set the autograd version counter of ``tensor`` (what ``torch.autograd._unsafe_preserve_version_counter``
    does). torch 2.4 takes one tensor and one int, later versions sequences of both."""
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None:
        raise _missing("torch._C._autograd._unsafe_set_version_counter")
    try:
        setter((tensor,), (version,))
    except TypeError:  # torch 2.4
        setter(tensor, version)


class AbsentFieldTyping:
    """Lets torch 2.1-2.4's dynamo tell the type of a Hugging Face ``ModelOutput`` field that is None, while
    the probes flatten a module's outputs (``active``), and nowhere else.

    That dynamo models a ``ModelOutput`` built in traced code by its fields that are not None. Reading
    another field (``outputs.past_key_values``, None when the model uses no cache) gives a value of no
    known type, which the model passes on into the outputs it builds; ``type()`` or ``isinstance`` on it,
    as torch's pytree does when the probes flatten those outputs, breaks the graph ("GetAttrVariable(
    CustomizedDictVariable(), past_key_values) has no type"). A ``ModelOutput`` keeps exactly its fields
    that are not None, so such a field (a dataclass field defaulting to None) is None: NoneType. The
    model's own code is traced as before (``active`` is off then). torch >= 2.5 models a ``ModelOutput``
    otherwise: nothing to do.

        ABSENT_FIELDS.set(True); leaves = pytree.tree_flatten(outputs); ABSENT_FIELDS.set(False)   # while tracing
    """

    def __init__(self) -> None:
        self.active = False
        self._installed = False

    def set(self, active: bool) -> None:
        if active and not self._installed:
            self._install()
        self.active = active

    def _install(self) -> None:
        self._installed = True
        from torch._dynamo.variables import dicts, misc

        customized = getattr(dicts, "CustomizedDictVariable", None)
        if customized is None:  # torch >= 2.5
            return
        from torch._dynamo.variables.constant import ConstantVariable

        untyped = misc.GetAttrVariable.python_type
        typing = self

        def python_type(self: Any) -> type:
            owner = self.obj
            if typing.active and isinstance(owner, customized) and dataclasses.is_dataclass(owner.user_cls):
                field = {field.name: field for field in dataclasses.fields(owner.user_cls)}.get(self.name)
                if field is not None and field.default is None and ConstantVariable.create(self.name) not in owner:
                    return type(None)
            return untyped(self)

        misc.GetAttrVariable.python_type = python_type


ABSENT_FIELDS = AbsentFieldTyping()  # process-wide: it patches dynamo's class, once


def _frame_evaluation() -> Any:
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    if frames is None or not hasattr(frames, "set_eval_frame"):
        raise _missing("torch._C._dynamo.eval_frame.set_eval_frame")
    return frames


def not_compiled_as_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo never compiles a frame of ``fn``'s code as a program of its own; it still traces ``fn`` inline
    where a frame it compiles calls it. (What ``torch._dynamo.skip`` does, without marking ``fn`` as
    disabled, which would make dynamo break the graph at every call.) ``call_uncompiled`` is marked too:
    called from such a frame, it must not be compiled before it turns dynamo off."""
    frames = _frame_evaluation()
    for code in (fn.__code__, call_uncompiled.__code__):
        if hasattr(frames, "skip_code"):  # torch 2.4
            frames.skip_code(code)
        elif hasattr(frames, "set_code_exec_strategy"):  # torch >= 2.6
            frames.set_code_exec_strategy(code, frames._FrameExecStrategy(frames._FrameAction.SKIP,
                                                                          frames._FrameAction.DEFAULT))
        else:
            raise _missing("torch._C._dynamo.eval_frame.skip_code or set_code_exec_strategy")
    return fn


def call_uncompiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with dynamo's frame evaluation off, as inside ``torch.compiler.disable``: no frame it
    runs is compiled."""
    prior = torch._C._dynamo.eval_frame.set_eval_frame(None)
    try:
        return fn(*args)
    finally:
        torch._C._dynamo.eval_frame.set_eval_frame(prior)


def functorch_transforms_active() -> bool:
    """Whether a functorch transform (``torch.func.grad``, ``vmap``...) is active: autograd Functions written in
    C++ do not run under one (torch raises), Python ones do."""
    return torch._C._are_functorch_transforms_active()


def function_applier(function: type) -> Callable[..., Any]:
    """``function.apply`` (an autograd Function without ``setup_context``), without the Python wrapper's
    per-call work where that work changes nothing: with no functorch transform active, ``Function.apply``
    only unwraps dead functorch wrappers, then calls the C++ apply. That wrapper costs about as much as the
    C++ apply itself (5 µs of 11 on the 2-core machine): for a probe called on every module, it is worth
    its one definition here. Under a functorch transform the public ``apply`` runs.

        apply_probe = function_applier(TensorProbe)
        outputs = apply_probe(probe, *tensors)       # the same as TensorProbe.apply(probe, *tensors)
    """
    if function.setup_context is not torch.autograd.function._SingleLevelFunction.setup_context:
        raise TypeError(f"{function.__qualname__} defines setup_context: use {function.__qualname__}.apply")
    functorch = getattr(torch._C, "_functorch", None)
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    unwrap = getattr(functorch, "unwrap_if_dead", None)
    raw = getattr(super(torch.autograd.Function, function), "apply", None)
    if active is None or unwrap is None or raw is None:
        raise _missing("torch._C._are_functorch_transforms_active, torch._C._functorch.unwrap_if_dead or "
                       "torch._C._FunctionBase.apply")
    tensor = torch.Tensor
    public = function.apply

    def apply(*args: Any) -> Any:
        if active():
            return public(*args)
        return raw(*[unwrap(arg) if isinstance(arg, tensor) else arg for arg in args])

    return apply


def compiler_runs_module() -> bool:
    """True while torch.compile runs a module's Python code on stand-in tensors outside dynamo's symbolic
    trace: dynamo computing the example value of a module call it keeps whole as one graph node (torch
    2.4 keeps a parametrized ``torch.nn`` module's ``forward`` so; the parametrization runs on
    FakeTensors), or AOT autograd tracing that node (FunctionalTensors). Nothing of that call is a step
    the model takes: the compiled graph runs the node's operations without calling the module.

        if not torch.compiler.is_compiling() and compiler_runs_module(): ...   # a hook: observe nothing

    Dynamo holds a ``TracingContext`` from its trace through the backend's compilation; a graph break's
    eager code, the compiled graph at run time and user code under a ``FakeTensorMode`` run outside it.
    """
    return _tracing_context()() is not None


@functools.cache
def _tracing_context() -> Callable[[], Any]:
    """``torch._guards.TracingContext.try_get``, looked up once (it is called on every eager hook).

    Where ``try_get`` is ``getattr(_TLS, "tracing_context", None)`` on a thread-local (torch 2.4 to 2.13), the same
    read from the thread's own dict: outside a compilation the attribute is missing, and ``getattr`` finds that out
    by raising and catching an AttributeError (0.4 to 0.8 µs, on every eager hook call; the dict's ``get``: 0.05)."""
    import threading

    from torch import _guards

    context = getattr(_guards, "TracingContext", None)
    if context is None or not hasattr(context, "try_get"):
        raise _missing("torch._guards.TracingContext.try_get")
    code = getattr(context.try_get, "__code__", None)
    local = getattr(_guards, "_TLS", None)
    if (code is not None and code.co_names == ("getattr", "_TLS") and "tracing_context" in code.co_consts
            and type(local) is threading.local):
        return functools.partial(_thread_value, local, "tracing_context")
    return context.try_get


def _thread_value(local: Any, name: str) -> Any:
    """``getattr(local, name, None)`` for a ``threading.local``, without raising where it has no ``name``."""
    return vars(local).get(name)


def in_onnx_export() -> bool:
    """``torch.onnx.is_in_onnx_export()`` (a TorchScript or a dynamo ONNX export runs), without the two imports
    torch >= 2.9 makes inside it on every call (1.3 µs; it is asked on every eager probe call)."""
    return _onnx_export_flags()()


@functools.cache
def _onnx_export_flags() -> Callable[[], bool]:
    """What ``torch.onnx.is_in_onnx_export`` reads, looked up once: the TorchScript exporter's ``GLOBALS`` and, where
    there is one (torch >= 2.9), the dynamo exporter's flag."""
    exporter_globals = _exporter_modules()[1].GLOBALS
    if not hasattr(exporter_globals, "in_onnx_export"):
        raise _missing("the TorchScript exporter's GLOBALS.in_onnx_export")
    try:
        from torch.onnx._internal.exporter import _flags
    except ImportError:  # torch 2.4: the TorchScript exporter only
        return lambda: exporter_globals.in_onnx_export
    if not hasattr(_flags, "_is_onnx_exporting"):
        raise _missing("torch.onnx._internal.exporter._flags._is_onnx_exporting")
    return lambda: exporter_globals.in_onnx_export or _flags._is_onnx_exporting


def constant_while_tracing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result`` without importing torch._dynamo.

    Dynamo calls such a function while it traces and puts its result in the graph as a constant.
    The public decorator imports torch._dynamo (about 2 s, and on torch 2.4 onnxruntime's ORTModule with
    it); in torch 2.1-2.14 all it does is set this attribute, which tests/test_compile.py checks.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def has_python_dispatch(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` dispatches to Python: a ``__torch_dispatch__`` subclass (FakeTensor, DTensor, ...)."""
    return torch._C._dispatch_keys(tensor).has(torch._C.DispatchKey.Python)


# Python dispatch modes ------------------------------------------------------------------------------

@functools.cache
def _dispatch_api() -> tuple[type, Callable[[], Any]]:
    try:
        from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
    except ImportError as error:
        raise _missing("torch.utils._python_dispatch.TorchDispatchMode") from error
    return TorchDispatchMode, _get_current_dispatch_mode


def dispatch_mode_class() -> type:
    """torch's ``TorchDispatchMode``: subclass it and define ``__torch_dispatch__(func, types, args, kwargs)``."""
    return _dispatch_api()[0]


class _EnteredMode(Handle):
    """A dispatch mode entered on one thread; removing it checks first, so a refused removal changes nothing."""

    def __init__(self, mode: Any) -> None:
        import threading

        self._owner = threading.get_ident()
        self._mode = mode
        mode.__enter__()
        super().__init__(lambda: mode.__exit__(None, None, None))

    def remove(self) -> None:
        import threading

        if self.active:
            if threading.get_ident() != self._owner:
                raise RuntimeError("a dispatch mode must be removed on the thread that entered it")
            if _dispatch_api()[1]() is not self._mode:
                raise RuntimeError("another dispatch mode was entered after this one and is still active: "
                                   "leave it first (modes are a stack)")
        super().remove()


def enter_dispatch_mode(mode: Any) -> Handle:
    """Makes ``mode`` (a ``dispatch_mode_class()`` instance) see every operation of this thread (and of the
    backward passes it starts) until the handle is removed; the handle refuses (and stays active) when removed
    from another thread or while a mode entered after it is still active (modes are a stack)."""
    return _EnteredMode(mode)


def operator_name(func: Any) -> str:
    """The name of an aten operator overload without its overload (``aten.mm.default`` -> ``mm``)."""
    return func.overloadpacket.__name__


def writes_or_aliases(func: Any) -> bool:
    """Whether an operator writes into an argument or returns a view of one (its schema's alias annotations)."""
    schema = func._schema
    return schema.is_mutable or any(ret.alias_info is not None for ret in schema.returns)


def function_mode_stack() -> list[Any]:
    """This thread's ``TorchFunctionMode`` stack, innermost last. The autograd engine restores it around each
    backward node: a mode entered inside a backward (a checkpointed forward recomputed) is gone after it."""
    stack = getattr(torch.overrides, "_get_current_function_mode_stack", None)
    if stack is None:
        raise _missing("torch.overrides._get_current_function_mode_stack")
    return stack()


def dynamo_traces_function_modes() -> bool:
    """Whether dynamo traces a ``TorchFunctionMode`` entered inside the program it compiles (torch 2.4 cannot
    construct or enter one there; 2.6 and later trace its ``__torch_function__``)."""
    return _TORCH_VERSION >= (2, 6)


def torch_function_aliases(name: str) -> bool | str:
    """How the aten operators named ``name`` (a torch function's name: ``reshape``, ``add_``) treat their arguments,
    by their schemas' alias annotations: ``"write"`` when one writes into a positional argument (in place),
    True when one returns a view of an argument, False otherwise (and for a name aten lacks)."""
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    if packet is None or not hasattr(packet, "overloads"):
        return False
    views = False
    for overload in packet.overloads():
        schema = getattr(getattr(packet, overload, None), "_schema", None)
        if schema is None:
            raise _missing(f"torch.ops.aten.{name}.{overload}._schema")
        if any(argument.type.kind() == "StringType" for argument in schema.arguments[:1]):
            continue  # aten::split.str and its kind: Python's str methods, not tensor operators
        written = [argument for argument in schema.arguments
                   if argument.alias_info is not None and argument.alias_info.is_write]
        if written and all(argument.kwarg_only for argument in written):
            continue  # an ``out=`` variant (``out``, ``values``, ...): writes only into its keyword-only outputs
        if written:
            return "write"
        views = views or any(ret.alias_info is not None for ret in schema.returns)
    return views
