"""The step machine of one subscription: which step a probe firing belongs to, and when a step ends.

The probe Functions (``probes.core.functions``) are its only callers, in eager PyTorch and inside
ORTModule alike; it tells the subscribers (``on_event``: ``"forward"``, ``"backward"``, ``"step_end"``...).

    tracker = StepTracker(forward_running=lambda: False)
    tracker.reset(subscribers)                         # a new subscription: counting starts at step 0
    event = tracker.probe_forward(site, tensors)       # TensorProbe.forward
    tracker.probe_backward(event, grads)               # TensorProbe.backward
    tracker.forward_returned()                         # StepBoundary.forward: the root forward returned ("forward_end")
    tracker.backward_reached_root()                    # StepBoundary.backward
    tracker.close_open_step()                          # the manager's flush()
    tracker.pause(); tracker.resume()                  # the manager's pause()/resume(): evaluation, say
    tracker.stop()                                     # the manager's unsubscribe(): no more calls

The rules (docs/training.md says what each training set-up gives):

- A step opens at the first probe of a forward (``"step_start"`` to every subscriber). It closes when the backward pass that reaches it
  ends (the autograd engine's graph task finishes), so its dump is complete when ``backward()``
  returns. A forward that no backward follows (evaluation, ``torch.no_grad``) closes when the next
  forward starts, or on ``close_open_step()`` (the manager's ``flush()``/``unsubscribe()``).
- A forward that runs inside a backward pass is a recomputation (activation checkpointing): not a
  step, not a new call of its modules, not recorded (unless a subscriber sets ``observe_recompute``).
- While paused, probes pass their tensors through untouched: no step opens, nothing is recorded and the
  step count does not move, so evaluation between training steps leaves no trace in the numbering.
- A backward pass that reaches a step already closed (``retain_graph=True`` and a second
  ``backward()``, a second-order backward) opens a backward-only step of its own. A second backward
  of the same forward within one step is recorded as a new call of the module (``name#k``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from exporters.adapters import torch_internals

from .differentiable import EagerDifferentiable
from .failures import SiteFailures
from .interface import TENSOR_EVENTS, SubscriberBase, wanted_events
from .sites import EVENT_KINDS, ProbeEvent, ProbeSite, probe_firing, with_tensors

# The observers that take one site's calls of one phase.
Receivers = tuple[SubscriberBase, ...]


@dataclass(eq=False)
class RunState:
    """Mutable run state of one subscription, shared by its hooks and probe Functions.

    ORT freezes a PythonOp's non-tensor arguments at export; the probes reach this object through their
    tracker, passed by pointer, so the exported graph sees its updates.
    """

    step: int = 0  # the number the next step gets: the count of steps begun so far
    open_step: int | None = None  # the step collecting records
    forward_done: bool = False  # the open step's root forward has returned
    seq: int = 0  # execution sequence number within the open step
    calls: dict[int, int] = field(default_factory=dict)  # per-site call count in the open step
    inspected: set[str] = field(default_factory=set)
    # Activation checkpointing: forward events of the open step per site, those not yet matched by a
    # recomputation, and the recomputed probes waiting for their match (see StepTracker._match_recomputed).
    unmatched: dict[int, list[ProbeEvent]] = field(default_factory=dict)
    recomputing: list[tuple[int, "Recomputed"]] = field(default_factory=list)
    recomputes: dict[int, int] = field(default_factory=dict)  # per-site recomputations in the open step
    backward_done: set[int] = field(default_factory=set)  # ids of forward events whose backward was recorded
    backward_tasks: set[int] = field(default_factory=set)  # running graph tasks that end the open step

    def end_step(self) -> int | None:
        """Forget the open step's bookkeeping; returns the step that was open (None if none was)."""
        step, self.open_step = self.open_step, None
        self.forward_done = False
        self.seq = 0
        for per_step in (self.calls, self.inspected, self.unmatched, self.recomputing, self.recomputes,
                         self.backward_done):
            per_step.clear()
        return step


@dataclass(eq=False)
class Recomputed:
    """A probe recomputed by activation checkpointing; ``event`` is the original forward event it
    stands for (None when it could not be matched), so its backward is recorded under that event."""

    site: ProbeSite
    event: ProbeEvent | None = None


class StepTracker:
    """Numbers probe firings into steps and reports them to the subscribers (see the module doc).

    ``forward_running()`` tells whether the subscription's root forward is running now (a backward
    that ends inside it, ``torch.autograd.grad`` in a forward, does not end the step).
    """

    def __init__(self, *, forward_running: Callable[[], bool]) -> None:
        self.state = RunState()
        self._subscribers: tuple[SubscriberBase, ...] = ()
        self._observers: tuple[SubscriberBase, ...] = ()
        self._taking: dict[str, tuple[SubscriberBase, ...]] = {}  # per event kind, the subscribers that take it
        # Per site and phase, the observers whose selection wants it (steps are asked per call).
        self._wanting: dict[ProbeSite, dict[str, Receivers]] = {}
        # The observers active in one step (``_receivers``): (step, them, whether they are all the observers).
        self._active_in: tuple[int | None, tuple[SubscriberBase, ...], bool] = (None, (), True)
        self._forward_running = forward_running
        self.failures = SiteFailures()  # sites whose probe code raised: switched off, training goes on
        self.differentiable = EagerDifferentiable()  # what eager differentiates, for probes in ORT's graph
        self.paused = False

    def reset(self, subscribers: Sequence[SubscriberBase]) -> None:
        """Start counting from step 0 for a new set of subscribers."""
        self.state = RunState()
        self._subscribers = tuple(subscribers)
        wanted = [wanted_events(s) for s in subscribers]
        self._taking = {kind: tuple(s for s, kinds in zip(subscribers, wanted) if kind in kinds)
                        for kind in EVENT_KINDS}
        self._observers = tuple(s for s, kinds in zip(subscribers, wanted) if not TENSOR_EVENTS.isdisjoint(kinds))
        self._wanting.clear()
        self._active_in = (None, (), True)
        self.failures.clear()
        self.differentiable.clear()
        self.paused = False

    def pause(self) -> None:
        """Finish the open step, then let probes pass until ``resume()`` (no step, no record, no count)."""
        self.close_open_step()
        self.paused = True

    def resume(self) -> None:
        """Probes record again; the next forward opens the next step."""
        self.paused = False

    def stop(self) -> None:
        """The subscription ended: the open step closes, and no subscriber gets another call (the
        count of steps begun stays until the next ``reset``)."""
        self.close_open_step()
        self._subscribers = self._observers = ()
        self._taking = {}
        self._wanting.clear()
        self._active_in = (None, (), True)

    @property
    def step(self) -> int:
        """The number of steps begun so far (the number the next step will get)."""
        return self.state.step

    @property
    def subscribers(self) -> tuple[SubscriberBase, ...]:
        return self._subscribers

    @property
    def observers(self) -> tuple[SubscriberBase, ...]:
        """The subscribers that take tensors ("forward"/"backward" events), so probes are inserted."""
        return self._observers

    def wants_site(self, site: ProbeSite) -> bool:
        """Whether some observer wants ``site`` in some phase (if not, the manager inserts no probe there)."""
        wanting = self._wanting_at(site)
        return bool(wanting["forward"] or wanting["backward"])

    def observed_now(self) -> bool:
        """Whether a probe firing now would reach an observer: one of them records the step it would belong to
        (the open step, or the next one when the open step's forward is over and no backward runs)."""
        if self.paused:
            return False
        return bool(self._active_observers(self._step_now())[1])

    def _step_now(self) -> int:
        state = self.state
        step = state.open_step
        if step is None or (state.forward_done and torch_internals.current_backward() is None):
            step = state.step
        return step

    def wants_ops(self, site: ProbeSite) -> bool:
        """Whether some observer records the operations inside the module of ``site`` (``ops=``) in some step."""
        return any(s.selection.wants_ops(site.name, site.module_class) for s in self._observers)

    def ops_observed_now(self, site: ProbeSite) -> bool:
        """Whether an observer that records the operations inside ``site``'s module records the step now."""
        if self.paused:
            return False
        return any(s.selection.wants_ops(site.name, site.module_class)
                   for s in self._active_observers(self._step_now())[1])

    # Called by the probe Functions ------------------------------------------------------------

    def probe_forward(self, site: ProbeSite, tensors: Sequence[torch.Tensor]) -> ProbeEvent | Recomputed | None:
        """A probe's forward fired: its event (kept by the probe for its backward), None once the site is off
        or while paused."""
        if self.paused or self.failures.is_off(site):
            return None
        return self.probe_forward_observed(site, tensors)

    def probe_forward_observed(self, site: ProbeSite,
                               tensors: Sequence[torch.Tensor]) -> ProbeEvent | Recomputed | None:
        """``probe_forward`` called by a module hook that has checked that its step is observed now (so not paused)
        and that ``site`` is not off (``native.ProbeAppliers.observed``)."""
        try:
            return self._probe_forward(site, tensors)
        except Exception as error:  # the probe's own bookkeeping: never the training step's problem
            self.failures.switch_off(site, None, None, error)
            return None

    def _probe_forward(self, site: ProbeSite, tensors: Sequence[torch.Tensor]) -> ProbeEvent | Recomputed:
        if torch_internals.current_backward() is not None:
            return self._recomputed_forward(site, tensors)
        state = self.state
        step = state.open_step
        if step is None or state.forward_done:
            step = self._begin_forward_work()
        elif state.backward_tasks:  # (what _begin_forward_work does in an open step's forward)
            state.backward_tasks.clear()
        if site.kind == "inspect":
            if site.name in state.inspected:
                raise ValueError(
                    f"inspect_activation name {site.name!r} was used twice in step {step}; "
                    "give every inspected tensor a unique name"
                )
            state.inspected.add(site.name)
        key = id(site)
        calls = state.calls
        call = calls.get(key, 0)
        calls[key] = call + 1
        seq = state.seq
        state.seq = seq + 1
        event = probe_firing(site, step, "forward", seq, call)
        unmatched = state.unmatched.get(key)
        if unmatched is None:
            state.unmatched[key] = [event]
        else:
            unmatched.append(event)
        receivers = self._receivers(site, step, "forward")
        if receivers:
            self._deliver(receivers, event, tensors)
        return event

    def probe_backward(self, token: ProbeEvent | Recomputed, grads: Sequence[torch.Tensor | None]) -> None:
        """A probe's backward fired with the gradients of its outputs; ``token`` is what its forward returned."""
        if self.paused or self.failures.is_off(token.site):
            return
        try:
            self._probe_backward(token, grads)
        except Exception as error:
            self.failures.switch_off(token.site, None, None, error)

    def _probe_backward(self, token: ProbeEvent | Recomputed, grads: Sequence[torch.Tensor | None]) -> None:
        state = self.state
        if state.recomputing:
            self._match_recomputed()
        forward = token.event if type(token) is Recomputed else token
        if forward is None:
            return
        self._watch_backward()
        grads = self.differentiable.reported(forward, grads)
        if grads is None:  # ORT differentiated a probe call eager does not differentiate at all
            return
        step = state.open_step
        if step is None:
            step = self._open()
        site = forward.site
        seq = state.seq
        state.seq = seq + 1
        if forward.step == step and id(forward) not in state.backward_done:
            state.backward_done.add(id(forward))
            event = probe_firing(site, step, "backward", seq, forward.call)
        else:  # another backward of a forward already differentiated: a new call in this step
            call = state.calls.get(id(site), 0)
            state.calls[id(site)] = call + 1
            event = probe_firing(site, step, "backward", seq, call, forward.step)
        receivers = self._receivers(site, step, "backward")
        if receivers:
            self._deliver(receivers, event, grads)

    def compiled_left_out(self) -> bool:
        """Whether a compiled probe's forward firing now belongs to a step no observer records (``observed_now``,
        whose active observers are worked out once per step): then it makes no event, as eager inserts no probe
        in such a step, and its backward finds none to report to."""
        return not self.observed_now()

    def compiled_forward(self, site: ProbeSite, tensors: Sequence[torch.Tensor]) -> ProbeEvent | None:
        """A probe's forward fired inside a torch.compile graph (``probes.core.compiled``): the event its backward
        reports to (``probe_backward``), None where there is none (the site is off, a recomputation inside a
        backward pass)."""
        event = self.probe_forward(site, tensors)
        return event if isinstance(event, ProbeEvent) else None

    def forward_returned(self) -> None:
        """The root module's forward returned."""
        if self.paused or torch_internals.current_backward() is not None:
            return  # the root itself recomputed by a checkpoint
        step = self._begin_forward_work()
        self.state.forward_done = True
        self._tell_each(ProbeEvent(None, step, kind="forward_end"))

    def backward_reached_root(self) -> None:
        """The backward pass reached the root's outputs: the step closes when that pass ends."""
        self._match_recomputed()
        self._watch_backward()

    def close_open_step(self) -> None:
        """Finish the open step now ("step_end" to the subscribers active in it)."""
        step = self.state.end_step()
        if step is None:
            return
        self._tell_each(ProbeEvent(None, step, kind="step_end"))

    def _tell_each(self, event: ProbeEvent) -> None:
        """``event`` to every subscriber that takes it and is active in its step; one that raises does not stop the
        others (their step must still be finished). Once all were called, the first error meant to stop training
        (``stops_training``, the anomaly sentinel's) is raised; any other is one ``ProbeFailureWarning``."""
        error: BaseException | None = None
        step = event.step
        for subscriber in self._taking.get(event.kind, ()):
            if subscriber.is_active(step):
                try:
                    subscriber.on_event(event)
                except Exception as raised:
                    if getattr(raised, "stops_training", False):
                        error = error or raised
                    else:
                        self.failures.phase_failed(subscriber, step, raised)
        if error is not None:
            raise error

    # The machine ------------------------------------------------------------------------------

    def _open(self) -> int:
        """The open step, opening the next one if none is open."""
        state = self.state
        if state.open_step is not None:
            return state.open_step
        step = state.open_step = state.step
        state.step += 1
        takers = self._taking.get("step_start")
        if takers:  # every subscriber, selected or not: the previous step is over
            event = ProbeEvent(None, step, kind="step_start")
            for subscriber in takers:
                try:
                    subscriber.on_event(event)
                except Exception as error:
                    self.failures.phase_failed(subscriber, step, error)
        return step

    def _begin_forward_work(self) -> int:
        # A probe after the root forward returned belongs to the next forward: the open step got no
        # backward (evaluation, no_grad), so it is complete.
        state = self.state
        if state.open_step is not None and state.forward_done:
            self.close_open_step()
        # No backward runs now (a forward inside one is a recomputation and does not get here): a pass
        # still listed raised before its end callbacks ran.
        state.backward_tasks.clear()
        return self._open()

    def _receivers(self, site: ProbeSite, step: int | None, phase: str) -> Receivers:
        """The observers that get this site's ``phase`` call in ``step``."""
        if step is None:
            return ()
        wanting = self._wanting.get(site) or self._wanting_at(site)
        wanting = wanting[phase]
        known = self._active_in
        _, active, all_active = known if known[0] == step else self._active_observers(step)
        if all_active and not self.failures.any():  # the common case: nothing to filter
            return wanting
        return tuple(r for r in wanting if r in active and not self.failures.is_off(site, r))

    def _active_observers(self, step: int) -> tuple[int | None, tuple[SubscriberBase, ...], bool]:
        """(step, the observers active in it, whether those are all the observers), worked out once per step."""
        if self._active_in[0] != step:
            active = tuple(s for s in self._observers if s.is_active(step))
            self._active_in = (step, active, len(active) == len(self._observers))
        return self._active_in

    def _deliver(self, receivers: Receivers, event: ProbeEvent, tensors: Sequence) -> None:
        """A probe firing to its receivers: ``event`` is its event without its tensors (what the step keeps for the
        backward, holding no tensor); each receiver gets it with them. A subscriber that raises loses this site,
        and training goes on."""
        full = with_tensors(event, tensors)
        for subscriber in receivers:
            try:
                subscriber.on_event(full)
            except Exception as error:
                self.failures.switch_off(event.site, subscriber, event, error)

    def _wanting_at(self, site: ProbeSite) -> dict[str, Receivers]:
        wanting = self._wanting.get(site)
        if wanting is None:
            eligible = [s for s in self._observers
                        if (site.kind != "input" or s.observe_inputs) and s.selection.wants_site(site)]
            wanting = self._wanting[site] = {}
            for phase in ("forward", "backward", "recompute"):
                kind = "backward" if phase == "backward" else "forward"
                takers = self._taking.get(kind, ())
                wanting[phase] = tuple(s for s in eligible
                                       if s in takers and s.selection.wants_phase(phase)
                                       and (phase != "recompute" or s.observe_recompute))
        return wanting

    def _recomputed_forward(self, site: ProbeSite, tensors: Sequence[torch.Tensor]) -> Recomputed:
        """A forward run inside backward (activation checkpointing): matched to its original later."""
        state = self.state
        token = Recomputed(site)
        state.recomputing.append((id(site), token))
        step = state.open_step
        wanted = self._receivers(site, step, "recompute")
        if wanted:
            count = state.recomputes.get(id(site), 0)
            state.recomputes[id(site)] = count + 1
            event = probe_firing(site, step, "recompute", state.seq, count)
            state.seq += 1
            self._deliver(wanted, event, tensors)
        return token

    def _match_recomputed(self) -> None:
        """Pairs the probes recomputed since the last backward call with their original forward events.

        A checkpointed segment is recomputed in one go, in forward order, and segments are recomputed
        last first; so the k recomputed calls of a site are its last k forward calls not matched yet.
        Only a reentrant checkpoint runs backward through recomputed probes; the others leave them unused.
        """
        state = self.state
        if not state.recomputing:
            return
        by_site: dict[int, list[Recomputed]] = {}
        for site_id, token in state.recomputing:
            by_site.setdefault(site_id, []).append(token)
        state.recomputing.clear()
        for site_id, tokens in by_site.items():
            originals = state.unmatched.get(site_id, [])
            matched = originals[-len(tokens):]
            del originals[len(originals) - len(matched):]
            for token, event in zip(tokens[len(tokens) - len(matched):], matched):
                token.event = event

    def _watch_backward(self) -> None:
        task = torch_internals.current_backward()
        state = self.state
        if task is None or task in state.backward_tasks:
            return
        state.backward_tasks.add(task)
        torch_internals.call_when_backward_ends(functools.partial(self._backward_ended, task))

    def _backward_ended(self, task: int) -> None:
        state = self.state
        state.backward_tasks.discard(task)
        # Wait for the enclosing pass when a reentrant checkpoint's nested backward ends, and for the
        # forward when a backward runs inside it (torch.autograd.grad in a module's forward).
        if state.backward_tasks or self._forward_running():
            return
        self.close_open_step()

