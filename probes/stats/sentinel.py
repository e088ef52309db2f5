"""The anomaly sentinel: stop (or warn) at the first nan or inf in any activation or gradient.

    from probes import SubscriberManager, AnomalySentinel, AnomalyError
    SubscriberManager.subscribe(model, [AnomalySentinel(action="raise")])      # no dump, only the check
    try:
        train()
    except AnomalyError as error:
        print(error.anomaly.step, error.anomaly.name)   # rank, step, phase, module, tensor index, counts

    # with statistics: the dump's own counts are checked (no second pass); the ring buffer keeps the
    # anomalous step and the 8 finished steps before it, and nothing older, until something goes wrong
    StatisticsSubscriber("run", keep_last=8, on_anomaly="raise")

The stages: each probed tensor's statistics go into a row on its device when its probe fires
(``probes.stats.rows``); when the phase ends (the root forward returned, or the step's backward ended)
the nan/inf counts and min/max of the phase's rows are read in one transfer (``check_rows``) and the
suspect rows checked by the one rule (``check``: ``probes.dump.anomaly``); then the sentinel warns once
per run or raises ``AnomalyError`` there, out of the model's forward or out of ``backward()``, in eager
PyTorch and under torch.compile. Under ORTModule an exception cannot leave ORT's forward with its type
and message, so an anomaly of the forward is raised at the end of that step's backward (or, with no
backward, at the next phase end outside ORT: ``SubscriberManager.flush()``). While nothing is found,
the sentinel changes nothing: it only reads tensors.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Literal, Sequence

import numpy as np

from exporters.adapters import ort_internals

from ..core import ProbeEvent, SubscriberBase
from ..dump import Record
from ..dump.anomaly import Anomaly, max_abs_problem, record_anomaly
from .one_tensor import process_rank
from .rows import StepRows

__all__ = ["AnomalyError", "AnomalySentinel", "AnomalyWarning", "AnomalyWatch"]

Action = Literal["warn", "raise"]
ACTIONS = ("warn", "raise")


class AnomalyError(FloatingPointError):
    """Raised at the end of the forward or backward in which the sentinel found an anomaly.

    ``anomaly``: the first anomalous record of that phase (``probes.dump.Anomaly``: rank, step,
    phase, name, module, tensor_index, nan, inf, numel).
    """

    stops_training = True  # the one error a probe raises on purpose (probes.core.failures)

    def __init__(self, anomaly: Anomaly, message: str) -> None:
        super().__init__(message)
        self.anomaly = anomaly


class AnomalyWarning(UserWarning):
    """The sentinel found an anomaly and its action is "warn" (issued once per run)."""


def check_max_abs(max_abs: float | None) -> float | None:
    problem = max_abs_problem(max_abs)
    if problem:
        raise ValueError(f"max_abs {problem}; None counts only nan and inf")
    return None if max_abs is None else float(max_abs)


class AnomalyWatch:
    """What a sentinel remembers: the first anomaly of the current phase and of the whole run.

        watch = AnomalyWatch(action="raise", max_abs=None)
        watch.check(record)                 # per record, when its probe fires
        watch.phase_end("forward", dump)    # raises AnomalyError (or warns) if this phase had one
    """

    def __init__(self, *, action: Action = "raise", max_abs: float | None = None) -> None:
        if action not in ACTIONS:
            raise ValueError(f"the sentinel's action (on_anomaly=) must be 'warn' or 'raise', got {action!r}")
        self.action = action
        self.max_abs = check_max_abs(max_abs)
        self.first: Anomaly | None = None  # the first anomaly of the run
        self.found = 0  # anomalous records so far
        self._pending: Anomaly | None = None  # the first anomaly of the phase running now

    def check(self, record: Record) -> Anomaly | None:
        """Checks one record; returns its anomaly (None when it is clean)."""
        anomaly = record_anomaly(record, max_abs=self.max_abs)
        if anomaly is not None:
            self.found += 1
            self.first = self.first or anomaly
            self._pending = self._pending or anomaly
        return anomaly

    def check_rows(self, rows: StepRows, *, rank: int) -> bool:
        """Checks the rows added since the last check in one read (``StepRows.anomalies``); True if any is anomalous.

        Only the rows whose counts or extremes look anomalous become records for ``check`` (the one rule).
        """
        found = []

        def find(stats: np.ndarray, entries: list[tuple]) -> None:
            nan, inf, low, high = stats.T
            suspect = (nan > 0) | (inf > 0)
            if self.max_abs is not None:
                integer = np.array([entry.described.integer for entry in entries], dtype=bool)
                # Integer extremes are bit patterns here: those rows go to the rule itself.
                extremes = np.abs(np.stack([low, high]))
                magnitude = np.where(np.isfinite(extremes), extremes, 0.0).max(axis=0)
                suspect |= integer | (magnitude > self.max_abs)
            for position in np.flatnonzero(suspect):
                entry = entries[position]
                names, described = entry.names, entry.described
                extremes = stats[position, 2:4]
                if described.integer:
                    lo, hi = (int(value) for value in extremes.view(np.int64))
                else:
                    lo, hi = (float(value) if np.isfinite(value) else None for value in extremes)
                record = {"rank": rank, "step": entry.step, "phase": entry.phase, "seq": entry.seq, "name": names.name,
                          "module": names.module, "tensor_index": names.tensor_index, "numel": described.numel,
                          "nan": int(stats[position, 0]), "inf": int(stats[position, 1]), "min": lo, "max": hi}
                if self.check(record) is not None:
                    found.append(record)

        rows.anomalies(find)
        return bool(found)

    def phase_end(self, phase: str, kept: str | None = None) -> None:
        """The forward (or the step's backward) ended: warn or raise for its first anomaly, if any.

        ``kept``: where the dump of the anomalous step is (said in the message).
        """
        anomaly = self._pending
        if anomaly is None:
            return
        if self.action == "raise" and ort_internals.inside_ort_graph():
            return  # ORT would swallow the error's type and message: raised at the next phase end outside ORT
        self._pending = None
        message = f"probes: anomaly at {anomaly}"
        if kept:
            message += f"; the dump of this step and the steps before it is kept in {kept}"
        if self.action == "raise":
            late = (": under ORTModule an error cannot leave the forward intact"
                    if phase != anomaly.phase and anomaly.phase != "recompute" else "")
            raise AnomalyError(anomaly, message + f"; raised at the end of the {phase}{late}")
        if anomaly is self.first:  # warn once per run; later ones are counted in ``found``
            warnings.warn(message + "; later anomalies are counted, not warned about", AnomalyWarning, stacklevel=2)


class AnomalySentinel(SubscriberBase):
    """A subscriber that finds the first nan or inf (or ``|x| > max_abs``) in any activation or gradient.

    Args:
        action: "raise" (``AnomalyError`` at the end of that forward or backward) or "warn" (once).
        max_abs: also flag finite values beyond this magnitude (e.g. 65504.0 for float16), or None.
        start_step, end_step: check steps in ``[start_step, end_step)``.
        observe_inputs: also check module inputs.
        every_n_steps, steps, modules, exclude_modules, phases: check only those steps, modules and
            phases (``SubscriberBase``; ``probes.core.selection`` has the rules).

    It writes nothing. Each tensor's statistics go into a row on its device (the same single pass
    ``StatisticsSubscriber`` makes, without samples); a phase's rows are read once, when it ends. With a
    ``StatisticsSubscriber`` already subscribed, use its ``on_anomaly=`` option instead, which checks
    the rows it computes anyway.
    ``found`` counts anomalous records, ``first`` is the run's first ``Anomaly``.
    """

    event_kinds = frozenset({"forward", "backward", "forward_end", "step_end"})

    def __init__(self, *, action: Action = "raise", max_abs: float | None = None, start_step: int | None = None,
                 end_step: int | None = None, observe_inputs: bool = False, every_n_steps: int | None = None,
                 steps: Iterable[int] | None = None, modules: str | Sequence[str] | None = None,
                 exclude_modules: str | Sequence[str] | None = None,
                 phases: str | Sequence[str] | None = None, ops: str | Sequence[str] | None = None) -> None:
        super().__init__(start_step, end_step, every_n_steps=every_n_steps, steps=steps, modules=modules,
                         exclude_modules=exclude_modules, phases=phases, ops=ops)
        self.watch = AnomalyWatch(action=action, max_abs=max_abs)
        self.observe_inputs = observe_inputs
        self.rank = process_rank()
        self._rows = StepRows(rank=self.rank, sample_count=0)

    @property
    def first(self) -> Anomaly | None:
        return self.watch.first

    @property
    def found(self) -> int:
        return self.watch.found

    def on_event(self, event: ProbeEvent) -> None:
        kind = event.kind
        if kind == "forward" or kind == "backward":
            for index, tensor in enumerate(event.tensors):
                if tensor is not None:  # a gradient that never came
                    self._rows.add(event, index, tensor)  # a tensor without readable data: no row, nothing to check
        elif kind == "forward_end":
            self.watch.check_rows(self._rows, rank=self.rank)
            self.watch.phase_end("forward")
        elif kind == "step_end":
            self.watch.check_rows(self._rows, rank=self.rank)
            self._rows.clear()
            self.watch.phase_end("backward")
