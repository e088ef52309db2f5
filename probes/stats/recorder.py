"""StatisticsSubscriber: exact per-step statistics of every module output and of its gradient.

    from probes import SubscriberManager, StatisticsSubscriber
    SubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])
    ... train ...
    SubscriberManager.unsubscribe()        # finishes the last step and closes the dump
    records = probes.load_dump("pt_out")   # or: python -m probes show pt_out --step 0

Statistics are computed inside the probe Functions, so they are the same code in eager PyTorch and
in ORTModule. Each record (see ``probes.dump`` for the layout on disk) holds the tensor's shape,
dtype, numel, min/max/mean/std/norm over finite elements, nan/inf/neg/pos/zero counts and samples at
deterministic positions spread over the tensor (the statistics: ``probes.dump.statistics``);
``numerics.py`` computes them in float64 bucket by bucket, without cloning the tensor.

With ``parameters=True`` (and ``optimizer_state=True``) a step also has records of each parameter's gradient as
the optimizer used it, the parameter after the update and the optimizer's state (``parameters.py``).

The stages (``rows.py``): a probe writes its tensors' statistics into rows of a buffer on each
tensor's own device, with no host read; at the step's end the rows go to the host in one copy and the
writer thread builds the records (``probes.dump.rowblock.RowBlock``). With ``on_anomaly`` the nan/inf counts
of a phase's rows are read once, when the phase ends.

Tensors that are not dense real tensors (complex, sparse, quantized, nested, DTensor) are summarised
through what they hold; the record's ``"stats_of"`` says what (see ``views.statistics_view``). Tensors
without readable data (meta, FakeTensor, other ``__torch_dispatch__`` subclasses), and any tensor
whose statistics fail, get a record with ``"unsupported": "<reason>"`` and no statistics, and one
``UnsupportedTensorWarning`` per site, tensor and phase: a probe never stops training.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..core import ProbeEvent, SubscriberBase
from ..dump.writer import DumpWriter
from ..utils.checks import check_int
from .parameters import ParameterRecords
from .one_tensor import DEFAULT_BUCKET_SIZE, DEFAULT_SAMPLE_COUNT, process_rank, tensor_record, unsupported_reason
from .rows import StepRows
from .sentinel import Action, AnomalyWatch

__all__ = ["StatisticsSubscriber", "SubscriberClosedWarning", "UnsupportedTensorWarning", "process_rank",
           "tensor_record"]


class UnsupportedTensorWarning(UserWarning):
    """A probe met a tensor it cannot summarise; its records say ``"unsupported"`` instead.

        warnings.simplefilter("error", UnsupportedTensorWarning)   # make such tensors fail a test
    """


class SubscriberClosedWarning(UserWarning):
    """A closed StatisticsSubscriber was still called by its subscription; those records are not written."""


class StatisticsSubscriber(SubscriberBase):
    """Dumps statistics of module outputs (forward) and their gradients (backward), per rank and step.

        StatisticsSubscriber("out", every_n_steps=10, modules=["blocks.*", "Linear"], phases="forward")

    Args:
        output_dir: where the dump goes (``<output_dir>/rank_<r>/step_<N>.parquet``).
        start_step, end_step: record steps in ``[start_step, end_step)``.
        override_output_dir: replace this rank's earlier dump in ``output_dir``.
        run_on_cpu: move one bucket at a time to the CPU to compute (saves device memory).
        bucket_size: elements per statistics pass; bounds the extra memory.
        sample_count: how many samples to keep per tensor.
        observe_inputs: also record module inputs.
        keep_last: a ring buffer: only the newest ``keep_last`` finished steps stay on disk (None: all).
            Once an anomaly is found (``on_anomaly``), nothing more is removed: the anomalous step and
            the ``keep_last`` steps before it stay.
        on_anomaly: "raise" or "warn" at the first nan/inf in a record (see ``probes.stats.sentinel``),
            read from the record's own counts; None (default): no check.
        max_abs: with ``on_anomaly``, finite values beyond this magnitude are anomalies too.
        every_n_steps: record only steps ``start_step``, ``start_step + n``, ... (left-out steps still
            count and leave no step file); or ``steps``: only the steps listed (not both).
        modules, exclude_modules: glob patterns (or ``"re:<regex>"``) matched against each module's
            qualified name (``"<root>"`` for the root) and its class name; a module is recorded when an
            include pattern matches (or none is given) and no exclude pattern does. Patterns match each
            module on its own (``"blocks.*"`` selects the descendants of ``blocks``); modules nobody
            records get no probe.
        phases: any of "forward", "backward", "grad", "param", "optim" (None: all).
        ops: module patterns (the same rule) whose every torch operation gets a record of its outputs and
            their gradients, named ``<module>/<op>:<k>.output.<i>`` (the k-th call of ``op`` in one call of
            the module), e.g. ``ops="encoder.layers.0.self_attn", steps=[0]``; those modules' outputs are
            recorded too. None (default): no op records (docs/ops.md).
            The selection decides what is recorded, and so what ``on_anomaly`` checks: only recorded records.
        on_step_written: called off the training thread with ``(step, step_file)`` once each step's file
            is finished, e.g. ``probes.sinks.LiveTensorBoard("tb")`` (TensorBoard while training).
        dump_format: "parquet" (default: a Parquet file per rank and step, ``probes.dump.columns``) or
            "jsonl" (JSON Lines, the format of earlier versions). Both load the same way.
        parameters: also record, per step and parameter, ``phase="grad"`` (the gradient the optimizer used:
            accumulated, clipped, unscaled) and ``phase="param"`` (the parameter after the update), named by
            the parameter's qualified name (``blocks.0.fc.weight``), ``kind="parameter"``; the selection
            applies by the owning module. Without an optimizer: grad records at the step's end, no param
            records. The update belongs to the step whose backward ran last, so that step's file is finished
            after ``optimizer.step()`` (or when the next step opens, or at ``flush()``/``close()``). See
            ``probes.stats.parameters`` for accumulation, skipped ``GradScaler`` steps and the costs.
        optimizer_state: with ``parameters``, also ``phase="optim"``: each tensor of the optimizer's state of
            a parameter after the update (``blocks.0.fc.weight.exp_avg``), for any optimizer whose state is a
            dict of tensors (Adam-like, SGD's ``momentum_buffer``).
        hash: each record also carries ``"hash"``, a 64-bit hash of the tensor's bytes (int64 bits;
            ``probes.stats.hashing``), computed with the statistics, no extra host read; for bit-exact
            checks (``probes compare --exact``, ``--ranks``). Records without it have none (None).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        start_step: int | None = None,
        end_step: int | None = None,
        override_output_dir: bool = False,
        run_on_cpu: bool = False,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        sample_count: int = DEFAULT_SAMPLE_COUNT,
        observe_inputs: bool = False,
        *,
        keep_last: int | None = None,
        on_anomaly: Action | None = None,
        max_abs: float | None = None,
        on_step_written: Callable[[int, Path], None] | None = None,
        dump_format: str = "parquet",
        parameters: bool = False,
        optimizer_state: bool = False,
        hash: bool = False,
        every_n_steps: int | None = None,
        steps: Iterable[int] | None = None,
        modules: str | Sequence[str] | None = None,
        exclude_modules: str | Sequence[str] | None = None,
        phases: str | Sequence[str] | None = None,
        ops: str | Sequence[str] | None = None,
    ) -> None:
        super().__init__(start_step, end_step, every_n_steps=every_n_steps, steps=steps, modules=modules,
                         exclude_modules=exclude_modules, phases=phases, ops=ops)
        if optimizer_state and not parameters:
            raise ValueError("optimizer_state=True needs parameters=True (the state is recorded with the update)")
        if max_abs is not None and on_anomaly is None:
            raise ValueError("max_abs needs on_anomaly='warn' or 'raise' (it is the sentinel's threshold)")
        self.watch = AnomalyWatch(action=on_anomaly, max_abs=max_abs) if on_anomaly is not None else None
        self.output_dir = Path(output_dir)
        self.run_on_cpu = run_on_cpu
        self.bucket_size = check_int(bucket_size, "bucket_size (elements)", minimum=1)
        self.sample_count = check_int(sample_count, "sample_count")
        self.observe_inputs = observe_inputs
        self.rank = process_rank()
        self._rows = StepRows(rank=self.rank, sample_count=self.sample_count, bucket_size=self.bucket_size,
                              run_on_cpu=run_on_cpu, describe_failure=unsupported_reason, hash=hash)
        self._writer = DumpWriter(self.output_dir, rank=self.rank, override=override_output_dir, keep_last=keep_last,
                                 on_step_written=on_step_written, format=dump_format)
        self._closed = False
        self._warned_closed = False
        self._warned_unsupported: set[tuple] = set()
        self._next_seq = 0  # the open step's next free seq (where parameter records begin)
        self._parameters = ParameterRecords(self._rows, selection=self.selection, optimizer_state=optimizer_state,
                                            finish=self._finish, warn=self._warn_parameter) if parameters else None

    def on_event(self, event: ProbeEvent) -> None:
        kind = event.kind
        if kind == "forward" or kind == "backward":  # the tensors, or their gradients (None where none came)
            if self._closed:
                if any(tensor is not None for tensor in event.tensors):
                    self._warn_closed(event.step)
                return
            errors = self._rows.add_event(event)
            if errors is not None:  # it had a tensor
                self._next_seq = event.seq + 1
                for index, error in errors:  # unsupported records (warned once per site, index, phase)
                    self._warn_unsupported((event.site.name, event.site.kind, index, event.phase),
                                           event.record_name(index), event.phase, error)
        elif kind == "step_end":
            self._step_ended(event.step)
        elif kind == "forward_end":
            if self.watch is not None and not self._closed:
                if self._check_rows():
                    self._send()
                    self._writer.flush()  # the anomalous step's records are on disk before the error leaves
                self.watch.phase_end("forward", kept=str(self.output_dir))
        elif kind == "step_start":
            if self._parameters is not None and not self._closed:
                self._parameters.step_started(event.step)
        elif kind == "site_failed":
            if not self._closed:
                self._rows.add_unsupported(event, 0, None, f"probe switched off: {event.reason}")
        elif kind == "subscribe":
            if self._parameters is not None and not self._closed:
                self._parameters.attach(event.model)

    def _step_ended(self, step: int) -> None:
        # After close() there is nothing to finish: close() finished every step that had records,
        # and records that arrived later were dropped with a warning.
        if not self._closed:
            anomalous = self.watch is not None and self._check_rows()
            self._send()
            seq, self._next_seq = self._next_seq, 0
            # The file waits for the optimizer's update, unless the sentinel is about to stop training.
            if anomalous or self._parameters is None or not self._parameters.step_ended(step, seq=seq):
                self._finish(step)
            if self.watch is not None:
                self.watch.phase_end("backward", kept=str(self.output_dir))

    def flush(self) -> None:
        """Block until every record so far is on disk (a step waiting for its update is finished now)."""
        if not self._closed:
            if self._parameters is not None:
                self._parameters.settle()
            self._send()
        self._writer.flush()

    def close(self) -> None:
        """Finish every step written so far and stop the writer; idempotent.

        Closing by hand before the subscription ends is allowed: later calls write nothing and warn once.
        """
        if self._closed:
            return
        try:
            if self._parameters is not None:
                self._parameters.settle()
                self._parameters.detach()
        finally:
            self._closed = True
            try:
                self._send()
            finally:
                self._writer.close()

    def _warn_closed(self, step: int) -> None:
        if self._warned_closed:
            return
        self._warned_closed = True
        warnings.warn(
            f"probes: StatisticsSubscriber({str(self.output_dir)!r}) was closed before its subscription ended; "
            f"records of step {step} and later are not written (the dump keeps what was written before "
            "close()). End the subscription instead: SubscriberManager.unsubscribe() closes its subscribers.",
            SubscriberClosedWarning,
            stacklevel=2,
        )

    def _warn_parameter(self, name: str, phase: str, error: BaseException) -> None:
        self._warn_unsupported((name, phase), name, phase, error)

    def _warn_unsupported(self, key: tuple, name: str, phase: str, error: BaseException) -> None:
        if key in self._warned_unsupported:
            return
        self._warned_unsupported.add(key)
        warnings.warn(
            f"probes: no statistics for {name} ({phase}): {unsupported_reason(error)}. "
            "Its records have \"unsupported\" set and no statistics; this warning is not repeated.",
            UnsupportedTensorWarning,
            stacklevel=4,
        )

    def _finish(self, step: int) -> None:
        """Sends the rows so far and finishes ``step``'s file."""
        if not self._closed:
            self._send()
            self._writer.finish_step(step)

    def _check_rows(self) -> bool:
        """The sentinel's check of the rows since the last one (one read); True when it found an anomaly."""
        assert self.watch is not None
        found = self.watch.check_rows(self._rows, rank=self.rank)
        if found:
            self._writer.keep_all()  # before this step finishes: it and the keep_last steps before it stay
        return found

    def _send(self) -> None:
        """Hands the rows so far to the writer (one copy per device); its thread builds the records."""
        for block in self._rows.take():
            self._writer.write(block.step, block)
