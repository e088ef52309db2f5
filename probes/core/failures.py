"""A probe never stops training: what happens when a probe's own code raises at run time.

Probes run inside the user's forward and backward: in eager PyTorch, in ORT's PythonOp callbacks and in
the body of a compiled custom op. An exception there would end the training step (under ORTModule as
an unreadable "Get null result"). Instead the site is switched off for the rest of the subscription, for
the subscriber that raised or, when the probe's own bookkeeping raised, for all of them; one
``ProbeFailureWarning`` names the site and the reason, and the subscriber's ``"site_failed"`` event
(``event.reason``) lets its records say so (``StatisticsSubscriber`` writes a record whose ``unsupported`` field gives it).

    failures = SiteFailures()
    failures.switch_off(site, subscriber, event, error)   # in an except clause, never raises
    failures.is_off(site, subscriber)                     # True from then on

Where a phase ends (``"forward_end"``, ``"step_end"``) only errors meant to stop training, whose class
sets ``stops_training = True`` (the anomaly sentinel's ``AnomalyError``), are raised; any other error there
is one ``ProbeFailureWarning`` per subscriber (``phase_failed``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .interface import wanted_events

if TYPE_CHECKING:
    from .interface import SubscriberBase
    from .sites import ProbeEvent, ProbeSite

_REASON_LENGTH = 300
_ALL = None  # switched off for every subscriber


class ProbeFailureWarning(UserWarning):
    """A probe's code raised while training ran; its site is switched off and training goes on.

        warnings.simplefilter("error", ProbeFailureWarning)   # make probe failures fail a test
    """


def failure_reason(error: BaseException) -> str:
    """One line: the error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= _REASON_LENGTH else text[: _REASON_LENGTH - 3] + "..."


class SiteFailures:
    """The sites switched off in one subscription, per subscriber (or for all of them)."""

    def __init__(self) -> None:
        self._off: dict["ProbeSite", set] = {}
        self._phase_warned: set = set()

    def clear(self) -> None:
        self._off.clear()
        self._phase_warned.clear()

    def any(self) -> bool:
        """Whether any site is switched off."""
        return bool(self._off)

    def is_off(self, site: "ProbeSite", subscriber: "SubscriberBase | None" = _ALL) -> bool:
        off = self._off.get(site)
        return off is not None and (_ALL in off or subscriber in off)

    def phase_failed(self, subscriber: "SubscriberBase", step: int, error: BaseException) -> None:
        """A subscriber raised where a phase ended (finishing a step), not on purpose: one warning per
        subscriber; training goes on and the subscriber keeps its calls."""
        if subscriber in self._phase_warned:
            return
        self._phase_warned.add(subscriber)
        warnings.warn(f"probes: {type(subscriber).__qualname__} raised at the end of a phase of step {step}: "
                      f"{failure_reason(error)}. Training goes on; this warning is not repeated for it.",
                      ProbeFailureWarning, stacklevel=4)

    def switch_off(self, site: "ProbeSite", subscriber: "SubscriberBase | None", event: "ProbeEvent | None",
                   error: BaseException, subscribers: tuple["SubscriberBase", ...] = ()) -> None:
        """Switch ``site`` off for ``subscriber`` (None: for all ``subscribers``); warn once; tell them."""
        if self.is_off(site, subscriber):
            return
        self._off.setdefault(site, set()).add(subscriber)
        reason = failure_reason(error)
        who = f"{type(subscriber).__qualname__}" if subscriber is not None else "the probe"
        where = f" in step {event.step} ({event.phase})" if event is not None else ""
        warnings.warn(
            f"probes: {who} raised at {site.name!r} ({site.kind}){where}: {reason}. That site is switched off "
            "for the rest of this subscription and training goes on; its records say so. "
            "(A probe never stops training; report the error if it is the probes' own.)",
            ProbeFailureWarning,
            stacklevel=3,
        )
        if event is None:
            return
        failed = event._replace(kind="site_failed", reason=reason, tensors=())
        for told in (subscriber,) if subscriber is not None else subscribers:
            if "site_failed" in wanted_events(told):
                try:
                    told.on_event(failed)
                except Exception:  # the subscriber is broken already: nothing more to tell it
                    pass
