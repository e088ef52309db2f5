"""The probes inside ``torch.compile``: custom operators the compiler keeps in its graph and calls every step.

Under ``torch.compile`` the manager's hooks run once, while dynamo traces the forward; what has to
happen on every step must be in the compiled graph. ORTModule gets that from PythonOps; here it comes
from two opaque custom operators, ``probes::observe`` (forward) and ``probes::observe_grad`` (backward),
whose Python bodies call the same ``StepTracker`` as the eager probe Functions. Each mutates a token
tensor, so no compiler pass drops, reorders or recomputes them, and none of the run state is a value
dynamo could guard on: the graph holds only constant ids.

    outputs = probe(site, tensors)      # a hook while dynamo traces: probe Function -> op node
    outputs = boundary(site, tensors)   # the root's outputs: the forward returned / the backward reached the root

The stages:

1. *Trace* (a hook, once per compilation): the tensors pass through ``CompiledProbe``, whose forward
   calls ``probes::observe`` with the site's key and a fresh slot (one per probe call in the traced
   program), both constants of the graph; its backward calls ``probes::observe_grad`` with them.
2. *Forward* (every step, inside the compiled forward): ``observe`` finds the site by its key and
   calls ``StepTracker.compiled_forward``; the event waits in the tracker's queue for its slot.
3. *Backward* (every step, inside the compiled backward): ``observe_grad`` takes the oldest event of its
   slot and reports the gradients (``StepTracker.compiled_backward``). The compiled backward gets no per-call object from
   its forward (a ticket tensor passed between them is recomputed by torch 2.4's partitioner, and
   running a forward probe twice is wrong), so the backward finds its forward by slot, first in first out.

A site whose subscription has ended is no longer found: its ops do nothing until dynamo recompiles
(removing the hooks changes what dynamo guards on, so the next call recompiles).
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import torch

from exporters import _torch_compat

if TYPE_CHECKING:
    from .interface import ProbeSite

# Opaque to the compiler, mutated by every probe op: the ops of one pass are chained through it in the
# order they were traced, and a mutating op is never dead code. One per pass, so that no backward op
# depends on a forward op's output (which would let a partitioner recompute the forward op).
_FORWARD_TOKEN = torch.zeros(1)
_BACKWARD_TOKEN = torch.zeros(1)

_SITES: "weakref.WeakValueDictionary[int, ProbeSite]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)
_SLOTS = itertools.count(1)

# What an op call is: a module's probe, the root's step boundary, or an ``inspect_activation`` call
# (its site is made when it first runs, by name, from the root's site: making one while tracing would
# be Python side effects dynamo cannot put in a graph).
_PROBE, _BOUNDARY, _INSPECT = 0, 1, 2


def site_key(site: "ProbeSite") -> int:
    """A new key under which the compiled graph finds ``site`` (the graph holds the key, not the object)."""
    key = next(_KEYS)
    _SITES[key] = site
    return key


@_torch_compat.constant_while_tracing
def _new_slot() -> int:
    # Evaluated while dynamo traces, so each probe call in a compiled program gets its own constant.
    return next(_SLOTS)


def _site(key: int, what: int, name: str) -> ProbeSite | None:
    site = _SITES.get(key)
    if site is None or what != _INSPECT:
        return site
    return site.manager.inspect_site(name)


# Defined with torch.library's low-level API: a call costs about 5 us, against 60-130 us for a
# ``torch.library.custom_op`` (its Python autograd and default-filling layers run on every call).
_LIBRARY = torch.library.Library("probes", "DEF")
_LIBRARY.define("observe(Tensor(a!) token, Tensor[] tensors, int key, int slot, int what, str name, bool queued) -> ()")
_LIBRARY.define("observe_grad(Tensor(a!) token, Tensor?[] grads, int key, int slot, int what, str name) -> ()")


def _report(tensors: list[torch.Tensor | None], key: int, slot: int | None, what: int, name: str, *,
            backward: bool) -> None:
    """What the ops do at run time: tell the site's step tracker (nothing once the site is gone)."""
    site = _site(key, what, name)
    if site is None:
        return
    steps = site.manager.steps
    if what == _BOUNDARY:  # may raise on purpose where a phase ends (the anomaly sentinel): not caught
        steps.backward_reached_root() if backward else steps.forward_returned()
        return
    try:
        if backward:
            steps.compiled_backward(site, tensors, slot=slot)
        else:
            steps.compiled_forward(site, tensors, slot=slot)
    except Exception as error:  # the op's body runs inside the compiled step: it must not end it
        steps.failures.switch_off(site, None, None, error)


def _observe(token: torch.Tensor, tensors: list[torch.Tensor], key: int, slot: int, what: int, name: str,
             queued: bool) -> None:
    _report(tensors, key, slot if queued else None, what, name, backward=False)


def _observe_grad(token: torch.Tensor, grads: list[torch.Tensor | None], key: int, slot: int, what: int,
                  name: str) -> None:
    _report(grads, key, slot, what, name, backward=True)


def _nothing(*args: Any) -> None:
    return None  # what the compiler sees of the ops while it traces: they return nothing


for _name, _body in (("observe", _observe), ("observe_grad", _observe_grad)):
    _LIBRARY.impl(_name, _body, "CompositeExplicitAutograd")
    _LIBRARY.impl(_name, _nothing, "Meta")  # fake tensors (dynamo, AOT autograd) run the Meta kernel


class CompiledProbe(torch.autograd.Function):
    """Identity whose forward and backward call the probe ops (the compiled counterpart of TensorProbe)."""

    @staticmethod
    def forward(ctx: Any, key: int, slot: int, what: int, name: str, queued: bool,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        torch.ops.probes.observe(_FORWARD_TOKEN, list(tensors), key, slot, what, name, queued)
        ctx.key, ctx.slot, ctx.what, ctx.name = key, slot, what, name
        outputs = tuple(_torch_compat.compiled_alias(tensor) for tensor in tensors)
        frozen = [output for output, tensor in zip(outputs, tensors) if not tensor.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        torch.ops.probes.observe_grad(_BACKWARD_TOKEN, list(grads), ctx.key, ctx.slot, ctx.what, ctx.name)
        return (None, None, None, None, None, *grads)


def _pass(site: "ProbeSite", what: int, tensors: Sequence[torch.Tensor], name: str = "") -> tuple[torch.Tensor, ...]:
    if not (torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)):
        # No backward will come: the forward op alone, no autograd Function. (Dynamo also binds a Function's
        # arguments wrongly when it inlines one under no_grad, as around a rotary embedding's (cos, sin).)
        torch.ops.probes.observe(_FORWARD_TOKEN, list(tensors), site.compiled_key, 0, what, name, False)
        return tuple(tensors)
    return CompiledProbe.apply(site.compiled_key, _new_slot(), what, name, True, *tensors)


def probe(site: "ProbeSite", tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Pass ``tensors`` through a probe of ``site`` in the program dynamo is tracing."""
    return _pass(site, _PROBE, tensors)


def inspect(root_site: "ProbeSite", name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Pass ``tensor`` through the probe of the ``inspect_activation`` name ``name`` of ``root_site``'s manager."""
    return _pass(root_site, _INSPECT, (tensor,), name)[0]


def boundary(site: "ProbeSite", tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Pass the root's outputs through the step boundary of ``site``'s tracker (``tensors`` may be empty)."""
    if not tensors:
        torch.ops.probes.observe(_FORWARD_TOKEN, [], site.compiled_key, 0, _BOUNDARY, "", False)
        return ()
    return _pass(site, _BOUNDARY, tensors)
