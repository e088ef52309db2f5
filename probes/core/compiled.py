"""The probes inside ``torch.compile``: custom operators the compiler keeps in its graph and calls every step.

Under ``torch.compile`` the manager's hooks run once, while dynamo traces the forward; what has to
happen on every step must be in the compiled graph. ORTModule gets that from PythonOps; here it comes
from two opaque custom operators, ``probes::observe`` (forward) and ``probes::observe_grad`` (backward),
whose Python bodies call the same ``StepTracker`` as the eager probe Functions. Each mutates a token
tensor, so no compiler pass drops, reorders or recomputes them, and none of the run state is a value
dynamo could guard on: the graph holds only constant ids.

    key = OPS.register(owner)             # at subscribe: the subscription's key (owner: a ``SiteOwner``)
    outputs = probe(key, site, tensors)   # a hook while dynamo traces: probe Function -> op node
    outputs = boundary(key, tensors)      # the root's outputs: the forward returned / the backward reached the root
    tensor = inspect(key, name, tensor)   # an ``inspect_activation`` call
    outputs = probe_op(key, name, tensors)   # an operation inside an op-selected module (probes.core.ops)
    OPS.unregister(key)                   # at unsubscribe: the ops of its graphs do nothing from then on

The stages:

1. *Trace* (a hook, once per compilation): the ops are defined with ``torch.library`` the first time
   (never at import); the tensors pass through ``CompiledProbe``, whose forward calls ``probes::observe``
   with the subscription's key, the site's module index and kind, and a fresh slot (one per probe call
   in the traced program), all constants of the graph; its backward calls ``probes::observe_grad`` with them.
   Only the tensors that need a gradient come out of it; the others are observed and go on as they were.
2. *Forward* (every step, inside the compiled forward): ``observe`` finds the subscription's owner by its
   key and asks its tracker whether a subscriber records the step (``StepTracker.compiled_left_out``, the
   active subscribers worked out once per step): if none does, it stops there and makes no event, as eager
   inserts no probe in such a step. Otherwise it finds the site through the owner and calls the tracker
   (``StepTracker.compiled_forward``); the event waits under the call's number and its slot.
3. *Backward* (every step, inside the compiled backward): ``observe_grad`` reads the call's number from its
   token, takes the event waiting under that number and its slot, and reports the gradients to it
   (``StepTracker.probe_backward``, as eager's probe does with the event it kept); none where the forward
   made no event (a left-out step). The event stays for a second backward of a retained graph; it is
   forgotten once the call's token is gone (its graph freed: no backward of it can come).

Each compiled call that will run probe backwards gets a backward token of its own, a 1-element CPU tensor
holding the call's number, for two reasons:

- *Pairing.* The compiled backward gets no per-call object from its forward (a ticket tensor passed
  between them is recomputed by torch 2.4's partitioner, and running a forward probe twice is wrong), and
  the slot alone does not tell the calls apart: one backward of two calls of the graph
  (``(model(a).sum() + model(b).sum()).backward()``) runs the second call's backward first. The token is a
  forward input that the backward ops get back, as AOT autograd saved it or as a copy of it (its
  functionalization hands a mutated argument over as a clone, so neither the tensor nor its memory is the
  forward's): its value is what survives, read on the host (a CPU tensor: never a device sync).
- *Versions.* The backward token is a forward input of the compiled graph that its backward mutates, so
  AOT autograd saves it for the backward. torch 2.4 checks the version counter of every tensor it saved
  (later versions skip the check for tensors a Function's backward reads without saving them, as eager
  autograd does), so a token shared by two compiled calls that are both waiting for their backward (two
  graphs of a model that breaks the graph, two forwards before one backward) is found "modified by an
  inplace operation" in the second backward. Hence ``observe`` hands the next call a fresh token, and a
  retained graph's token gets its version back when the backward pass that changed it ends, so that a
  second backward of that graph finds it unchanged.

A subscription that has ended is no longer found: its ops do nothing until dynamo recompiles
(removing the hooks changes what dynamo guards on, so the next call recompiles).
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from exporters.adapters import torch_internals


if TYPE_CHECKING:
    from .sites import ProbeEvent, ProbeSite
    from .steps import StepTracker

# What an op call is: a module's input or output probe, the root's step boundary, an ``inspect_activation``
# call or an operation inside an op-selected module (``probes.core.ops``). The last two's sites are made when
# they first run, by name, by the owner: making one while tracing would be Python side effects dynamo cannot
# put in a graph.
_INPUT, _OUTPUT, _BOUNDARY, _INSPECT, _OP = 0, 1, 2, 3, 4


class SiteOwner(Protocol):
    """What the ops reach at run time through a subscription's key (the ``SubscriberManager``)."""

    tracker: "StepTracker"

    def module_site(self, module_index: int, kind: str) -> "ProbeSite | None":
        """The input or output site of the module at ``module_index``; None if there is none."""

    def inspect_site(self, name: str) -> "ProbeSite":
        """The site of the ``inspect_activation`` name ``name``."""

    def op_site(self, name: str) -> "ProbeSite | None":
        """The site of the operation ``name`` (``<module>/<op>:<k>``); None if its module is not subscribed."""


class CompiledOps:
    """The ``probes`` operator library and the subscriptions its ops report to.

    Process-wide, and so one instance (``OPS``): torch.library defines an operator namespace once per
    process, and a compiled graph holds only ints, which its ops turn back into a subscription.
    """

    def __init__(self) -> None:
        self._owners: "weakref.WeakValueDictionary[int, SiteOwner]" = weakref.WeakValueDictionary()
        self._keys = itertools.count(1)
        self._slots = itertools.count(1)
        self._library: torch.library.Library | None = None
        # Opaque to the compiler, mutated by every probe op: the ops of one pass are chained through it in
        # the order they were traced, and a mutating op is never dead code. One per pass, so that no backward
        # op depends on a forward op's output (which would let a partitioner recompute the forward op).
        self.forward_token = torch.zeros(1)
        # A new one for each compiled call that will run probe backwards, holding the call's number (see the
        # module docstring).
        self._calls = itertools.count(1)
        self.backward_token = self._new_backward_token()
        # The backward tokens the compiled calls took, by call number, as their graphs got them (AOT autograd
        # passes an alias, which shares the token's version counter): weakly, they live as long as a graph saved them.
        self._taken: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._last_taken: torch.Tensor | None = None  # the token the running call's probe ops pass
        self._last_call = 0  # its number
        # Per call, by slot: the forward events its backward differentiates (kept while its token lives).
        self._waiting: dict[int, dict[int, ProbeEvent]] = {}
        self._restoring: int | None = None  # the backward pass at whose end the taken tokens' versions go back

    def register(self, owner: SiteOwner) -> int:
        """A new key under which the compiled graphs find ``owner`` (held weakly)."""
        key = next(self._keys)
        self._owners[key] = owner
        return key

    def unregister(self, key: int) -> None:
        self._owners.pop(key, None)

    def owner(self, key: int) -> SiteOwner | None:
        return self._owners.get(key)

    def new_slot(self) -> int:
        return next(self._slots)

    def _new_backward_token(self) -> torch.Tensor:
        # On the CPU whatever the default device: reading the number back is never a device sync.
        return torch.full((1,), next(self._calls), dtype=torch.int64, device="cpu")

    def backward_token_taken(self, token: torch.Tensor) -> int:
        """A running compiled call took ``token`` (saved for its backward, which changes it): the next
        call gets a new one. Returns the call's number, which its backward ops read from their token."""
        if token is self._last_taken:  # the call's later probe ops (one check: the call passes the same token)
            return self._last_call
        call = int(token.item())
        self._last_taken, self._last_call = token, call  # (letting the previous call's token go first)
        if call not in self._taken:  # its first probe op in this call
            self._taken[call] = token
            self.backward_token = self._new_backward_token()
            # The calls whose token is gone: their graph is freed, no backward of theirs will come.
            for ended in [ended for ended in self._waiting if ended not in self._taken]:
                del self._waiting[ended]
            self._waiting[call] = {}
        return call

    def wait(self, call: int, slot: int, event: ProbeEvent) -> None:
        """``event``, made by the forward op ``slot`` of compiled call ``call``, waits for that call's backward."""
        waiting = self._waiting.get(call)
        if waiting is not None:
            waiting[slot] = event

    def waiting(self, token: torch.Tensor, slot: int) -> ProbeEvent | None:
        """The forward event that the backward op ``slot`` differentiates, given the token that op got (its
        call's, or a copy of it: the call's number is its value); None where that forward made no event."""
        waiting = self._waiting.get(int(token.item()))
        return None if waiting is None else waiting.get(slot)

    def backward_changed_tokens(self) -> None:
        """A probe backward ran, changing its call's token: the taken tokens get their version back when
        this backward pass ends, so that a retained graph finds its token unchanged on its next backward."""
        task = torch_internals.current_backward()
        if task is None or task == self._restoring:
            return
        self._restoring = task
        torch_internals.call_when_backward_ends(self._restore_versions)

    def _restore_versions(self) -> None:
        self._restoring = None
        for token in list(self._taken.values()):
            if token._version:  # a token is saved at version 0: only the probe backwards change it
                torch_internals.set_version(token, 0)

    def define(self) -> None:
        """Define ``probes::observe`` and ``probes::observe_grad`` (once)."""
        if self._library is not None:
            return
        # torch.library's low-level API: a call costs about 5 us, against 60-130 us for a
        # ``torch.library.custom_op`` (its Python autograd and default-filling layers run on every call).
        library = torch.library.Library("probes", "DEF")
        # ``backward_token``: the one the call's backward ops change, or None where no backward will come.
        library.define("observe(Tensor(a!) token, Tensor? backward_token, Tensor[] tensors, int owner, int module, "
                       "int slot, int what, str name) -> ()")
        library.define("observe_grad(Tensor(a!) token, Tensor?[] grads, int owner, int module, int slot, int what, "
                       "str name) -> ()")
        for name, body in (("observe", _observe), ("observe_grad", _observe_grad)):
            library.impl(name, body, "CompositeExplicitAutograd")
            library.impl(name, _nothing, "Meta")  # fake tensors (dynamo, AOT autograd) run the Meta kernel
        self._library = library


OPS = CompiledOps()


@torch_internals.constant_while_tracing
def _new_slot() -> int:
    # Evaluated while dynamo traces, so each probe call in a compiled program gets its own constant.
    return OPS.new_slot()


@torch_internals.constant_while_tracing
def _defined() -> bool:
    # Evaluated while dynamo traces (a registration is no graph node), before the first op is traced.
    OPS.define()
    return True


@torch_internals.constant_while_tracing
def flattening(active: bool) -> bool:
    """Called while dynamo traces, around a hook's flattening of a module's inputs or outputs: dynamo can
    then type each value in them (``torch_internals.AbsentFieldTyping``)."""
    torch_internals.ABSENT_FIELDS.set(active)
    return active


def _observe(token: torch.Tensor, backward_token: torch.Tensor | None, tensors: list[torch.Tensor], key: int,
             module: int, slot: int, what: int, name: str) -> None:
    """The forward op's body: tell the subscription's step tracker (nothing once it has ended)."""
    call = None if backward_token is None else OPS.backward_token_taken(backward_token)
    owner = OPS.owner(key)
    if owner is None:
        return
    tracker = owner.tracker
    if what == _BOUNDARY:  # may raise on purpose where a phase ends (the anomaly sentinel): not caught
        tracker.forward_returned()
        return
    if tracker.compiled_left_out():
        return  # a step no subscriber records: no site, no event (the step boundary still numbers the step)
    if what == _INSPECT:
        site = owner.inspect_site(name)
    elif what == _OP:
        site = owner.op_site(name)
    else:
        site = owner.module_site(module, "input" if what == _INPUT else "output")
    if site is None:
        return
    try:
        event = tracker.compiled_forward(site, tensors)
        if event is not None and call is not None:
            OPS.wait(call, slot, event)
    except Exception as error:  # the op's body runs inside the compiled step: it must not end it
        tracker.failures.switch_off(site, None, None, error)


def _observe_grad(token: torch.Tensor, grads: list[torch.Tensor | None], key: int, module: int, slot: int,
                  what: int, name: str) -> None:
    """The backward op's body: the gradients to the forward event of its call and slot (its site is the event's)."""
    OPS.backward_changed_tokens()
    owner = OPS.owner(key)
    if owner is None:
        return
    if what == _BOUNDARY:
        owner.tracker.backward_reached_root()
        return
    event = OPS.waiting(token, slot)
    if event is not None:  # None: that forward was left out (``compiled_left_out``), as eager inserted no probe
        owner.tracker.probe_backward(event, grads)


def _nothing(*args: Any) -> None:
    return None  # what the compiler sees of the ops while it traces: they return nothing


class CompiledProbe(torch.autograd.Function):
    """Identity whose forward and backward call the probe ops (the compiled counterpart of TensorProbe).

    Every tensor is observed; only those that need a gradient (``graded``, one flag per tensor) come out of it:
    the others go on as they were, outside the Function. A traced Function's outputs are no place for them:
    torch 2.4's dynamo keeps no ``mark_non_differentiable``, so AOT autograd would take each for a tensor that
    needs a gradient, and when inductor returns one buffer for it and for the tensor it passed (both outputs of
    the graph, the root's), the compiled backward fails ("incorrect subclass metadata"), which training without
    probes never meets. Eager autograd computes no gradient for them either: their gradients are reported as None.
    """

    @staticmethod
    def forward(ctx: Any, key: int, module: int, slot: int, what: int, name: str, graded: tuple[bool, ...],
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        torch.ops.probes.observe(OPS.forward_token, OPS.backward_token, list(tensors), key, module, slot, what, name)
        ctx.key, ctx.module, ctx.slot, ctx.what, ctx.name, ctx.graded = key, module, slot, what, name, graded
        return tuple(torch_internals.compiled_alias(tensor) for tensor, grad in zip(tensors, graded) if grad)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        arriving = iter(grads)
        every = [next(arriving) if grad else None for grad in ctx.graded]
        torch.ops.probes.observe_grad(OPS.backward_token, every, ctx.key, ctx.module, ctx.slot, ctx.what, ctx.name)
        return (None, None, None, None, None, None, *every)


def _pass(key: int, module: int, what: int, tensors: Sequence[torch.Tensor], name: str = "") -> tuple[torch.Tensor, ...]:
    _defined()
    graded = tuple(tensor.requires_grad for tensor in tensors)
    if not (torch.is_grad_enabled() and any(graded)):
        # No backward will come: the forward op alone, no autograd Function. (Dynamo also binds a Function's
        # arguments wrongly when it inlines one under no_grad, as around a rotary embedding's (cos, sin).)
        torch.ops.probes.observe(OPS.forward_token, None, list(tensors), key, module, 0, what, name)
        return tuple(tensors)
    passed = iter(CompiledProbe.apply(key, module, _new_slot(), what, name, graded, *tensors))
    return tuple(next(passed) if grad else tensor for tensor, grad in zip(tensors, graded))


def probe(key: int, site: "ProbeSite", tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Pass ``tensors`` through a probe of the module site ``site`` of subscription ``key`` in the program
    dynamo is tracing."""
    return _pass(key, site.module_index, _INPUT if site.kind == "input" else _OUTPUT, tensors)


def inspect(key: int, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Pass ``tensor`` through the probe of the ``inspect_activation`` name ``name`` of subscription ``key``."""
    return _pass(key, -1, _INSPECT, (tensor,), name)[0]


def probe_op(key: int, name: str, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Pass an operation's output ``tensors`` through the probe of the op site ``name`` of subscription ``key``."""
    return _pass(key, -1, _OP, tensors, name)


def boundary(key: int, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Pass the root's outputs through the step boundary of subscription ``key`` (``tensors`` may be empty)."""
    if not tensors:
        _defined()
        torch.ops.probes.observe(OPS.forward_token, None, [], key, -1, 0, _BOUNDARY, "")
        return ()
    return _pass(key, -1, _BOUNDARY, tensors)
