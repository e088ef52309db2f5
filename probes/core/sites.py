"""Where a probe sits and what happens to a subscriber: plain data, the vocabulary every other core module shares.

    site = ProbeSite("encoder.layers.0", "output", module_index=3, depth=3, module_class="Layer")
    site.record_name(1)                           # "encoder.layers.0.output.1"
    event = ProbeEvent(site, step=0, phase="forward", seq=7, kind="forward", tensors=(tensor,))
    ProbeEvent(None, step=3, kind="step_end")     # a step's event: no site

Imports nothing of probes.core, so that any core module may name a site, even for annotations only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Sequence

from ..utils.phases import Phase

if TYPE_CHECKING:
    import torch

SiteKind = Literal["input", "output", "inspect", "op"]
# What happened: a probe fired (its tensors, in the forward or a recomputation: "forward"; their gradients:
# "backward"), the root's forward returned, a step opened or ended, a site was switched off, the model was
# subscribed. One list, in the order a step meets them (``subscribe`` once, first).
EventKind = Literal["subscribe", "step_start", "forward", "backward", "forward_end", "step_end", "site_failed"]
EVENT_KINDS: tuple[EventKind, ...] = ("subscribe", "step_start", "forward", "backward", "forward_end", "step_end",
                                      "site_failed")


@dataclass(eq=False)
class ProbeSite:
    """Where a probe sits: one module's inputs or outputs, one ``inspect_activation`` name, or one operation
    called inside a module (kind ``"op"``, named ``<module>/<op>:<k>``: the k-th call of ``op`` in one call
    of the module; ``probes.core.ops``).

    Plain data: it knows nothing of the subscription that made it. Compared and hashed by identity, since
    a subscription keys its per-site state (call counts, failures, caches) by its own sites.
    """

    name: str  # the module's qualified name ("<root>" for the root), the inspect name, or "<module>/<op>:<k>"
    kind: SiteKind
    module_index: int  # position in the root's named_modules(); -1 for inspect sites
    depth: int  # 0 for the root; an op's is its module's + 1
    module_class: str
    # An op site's tensor arguments, in order: the record names they were (forward), "" where none.
    inputs: "list[str] | None" = None

    @property
    def module(self) -> str:
        """The record's ``module``: the module's name (for an op, the module it ran in), or the inspect name."""
        return self.name.rpartition("/")[0] if self.kind == "op" else self.name

    def record_name(self, tensor_index: int, call: int = 0) -> str:
        """Stable name of the i-th tensor here, e.g. ``encoder.layers.0.output.1``.

        A module called more than once in a step gets ``#<call>`` after its name from the second call.
        """
        base = self.name if call == 0 else f"{self.name}#{call}"
        if self.kind == "inspect":
            return base if tensor_index == 0 else f"{base}.{tensor_index}"
        return f"{base}.{'output' if self.kind == 'op' else self.kind}.{tensor_index}"

    def legacy_name(self, tensor_index: int) -> str:
        """The original onnxruntime hooks' form: ``<Class>_<module index>_<i>th_output``."""
        if self.kind == "inspect":
            return self.name
        if self.kind == "op":
            return self.record_name(tensor_index)
        return f"{self.module_class}_{self.module_index}_{tensor_index}th_{self.kind}"


class ProbeEvent(NamedTuple):
    """What a subscriber is told: one event, the one argument of ``SubscriberBase.on_event``.

    ``kind`` says what happened (``EventKind``). A probe firing (``"forward"``, ``"backward"``) has its site,
    step, phase (``"forward"``, ``"recompute"`` or ``"backward"``), execution order and call, and the
    ``tensors`` (forward: the site's tensors, ``tensors[i]`` named ``record_name(i)``; backward: their
    gradients, None where one got none). A step's events (``"step_start"``, ``"forward_end"``,
    ``"step_end"``) have no site; ``"site_failed"`` repeats the failed firing's fields with the ``reason``;
    ``"subscribe"`` carries the ``model``.

    A named tuple: one is made per probe call, and a tuple is the cheapest immutable record Python makes (a probe
    firing's are built by position in ``probe_firing`` alone: a new field goes before ``tensors``, which stays
    last). The tensors are the live ones: read them during the call, keep no reference (``event._replace(tensors=())``
    keeps the rest).
    """

    site: ProbeSite | None  # None for a step's events and "subscribe"
    step: int
    phase: Phase | None = None  # None for a step's events and "subscribe"
    seq: int = -1  # execution order within the step; every phase shares one counter
    call: int = 0  # how many times this site fired earlier in the step (see ``record_name``)
    forward_step: int | None = None  # backward only: the step of the forward it differentiates, if another
    kind: EventKind = "forward"  # (a default only for events made by hand as before kinds existed: the manager's say)
    reason: str | None = None  # "site_failed": why the site was switched off
    model: "torch.nn.Module | None" = None  # "subscribe": the user's module, wrappers removed
    tensors: Sequence[Any] = ()  # "forward": the tensors; "backward": their gradients (None where none came)

    def record_name(self, tensor_index: int) -> str:
        return self.site.record_name(tensor_index, self.call)


# A probe firing's events are made with tuple's own constructor: it skips the named tuple's argument binding, a
# third of the cost of an event, made once or twice per probe call. These two are the only places that do.
_new_tuple = tuple.__new__
_KIND_OF_PHASE = {"forward": "forward", "recompute": "forward", "backward": "backward"}


def probe_firing(site: ProbeSite, step: int, phase: Phase, seq: int, call: int,
                 forward_step: int | None = None) -> ProbeEvent:
    """A probe firing's event without its tensors (the form a step keeps for the backward: it holds no tensor)."""
    return _new_tuple(ProbeEvent, (site, step, phase, seq, call, forward_step, _KIND_OF_PHASE[phase], None, None, ()))


def with_tensors(event: ProbeEvent, tensors: Sequence[Any]) -> ProbeEvent:
    """``event`` with ``tensors`` (the last field), as a subscriber gets it."""
    return _new_tuple(ProbeEvent, event[:-1] + (tensors,))
