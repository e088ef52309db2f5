"""Statistics rows of one step on each tensor's own device: no host read on the training thread.

    rows = StepRows(rank=0, sample_count=32)
    rows.add(event, 0, tensor)          # statistics and samples into a row of a buffer on tensor.device
    rows.add_event(event)               # add() of each of a probe event's tensors, in one call (the record path)
    rows.add_row(names, step, phase, seq, row, described)   # a row computed elsewhere (merged shards: stats/shards.py)
    StepRows(rank=0, sample_count=32, hash=True)   # each row also ends with the tensor's hash (hashing.py)
    rows.anomalies(check)               # the sentinel: one read of the nan/inf/min/max of the rows since the last call
    blocks = rows.take()                # the rows since the last take: one copy per device (a RowBlock per step)

The stages: ``add`` computes a tensor's statistics into the next row of its device's buffer (the C++
kernel for CPU tensors, torch ops on other devices, ``probes.stats.numerics``) and appends one entry
(what names the record, held once per site) to a list; ``take`` hands the used rows to the host in one
copy per device (on CUDA non-blocking, into pinned memory, with an event the writer thread waits on)
and starts a fresh buffer; the writer thread builds the record columns from the rows
(``probes.dump.rowblock.RowBlock``).
"""

from __future__ import annotations

import functools
import math
import operator
import threading
from typing import Callable

import numpy as np
import torch

from ..core import ProbeEvent, ProbeSite
from ..dump.rowblock import ACCUMULATED_WIDTH, Described, Entry, RecordNames, RowBlock
from ..dump.statistics import ACCUMULATED
from . import kernel
from .hashing import tensor_hash
from .kernel import default_backend
from .numerics import (_WIDENED, DEFAULT_BUCKET_SIZE, device_row, device_samples, kernel_reads_whole, sample_index_tensor, sample_indices,
                       summarize)
from .views import check_readable, dtype_name, is_dense, layout_name, or_none, shape_of, statistics_view

__all__ = ["StepRows", "unsupported_description"]

_FIRST_CAPACITY = 64
_CPU = torch.device("cpu")
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_STEP = operator.attrgetter("step")
_SLOT = {stat.name: slot for slot, stat in enumerate(ACCUMULATED)}
# An empty tensor's row: no element, none finite (mean nan, min +inf, max -inf: "none" on the host).
_EMPTY_FILL = {"mean": math.nan, "min": math.inf, "max": -math.inf}


@functools.lru_cache(maxsize=4096)
def _sample_positions(numel: int, count: int, device: torch.device) -> torch.Tensor:
    """``sample_index_tensor``, made once per size and device."""
    return sample_index_tensor(numel, count, device)


@functools.lru_cache(maxsize=4096)
def _sample_list(numel: int, count: int) -> list[int]:
    return sample_indices(numel, count)


class _Buffer:
    """The rows of one device: a float64 tensor that doubles when full (a copy on the device)."""

    __slots__ = ("capacity", "device", "rows", "used", "width")

    def __init__(self, device: torch.device, width: int, capacity: int) -> None:
        self.device = device
        self.width = width
        self.rows = torch.empty((capacity, width), dtype=torch.float64, device=device)
        self.capacity = capacity
        self.used = 0

    def next_row(self) -> int:
        if self.used == self.capacity:
            self.grow()
        self.used += 1
        return self.used - 1

    def grow(self) -> None:
        grown = torch.empty((2 * self.capacity, self.width), dtype=torch.float64, device=self.device)
        grown[:self.used].copy_(self.rows[:self.used])
        self.rows = grown
        self.capacity *= 2


class StepRows:
    """The rows and entries of one subscriber's records since the last ``take`` (see the module docstring).

    ``run_on_cpu``: a device tensor's statistics are computed on the CPU, one bucket at a time (saves
    device memory; each bucket is a host copy). ``bucket_size`` bounds the extra memory of a pass.
    ``hash``: the row's last slot holds the 64-bit hash of what the statistics read (``hashing.py``), as
    int64 bits, computed where the statistics are (the kernel for CPU tensors, torch ops otherwise).
    """

    def __init__(self, *, rank: int, sample_count: int, bucket_size: int = DEFAULT_BUCKET_SIZE, run_on_cpu: bool = False,
                 describe_failure: Callable[[BaseException], str] = str, hash: bool = False) -> None:
        self.rank = rank
        self.sample_count = sample_count
        self.bucket_size = bucket_size
        self.run_on_cpu = run_on_cpu
        self.hash = hash
        self.width = ACCUMULATED_WIDTH + sample_count + (1 if hash else 0)
        self._describe_failure = describe_failure
        self._buffers: dict[torch.device, _Buffer] = {}
        self._parts: list[_Buffer] = []  # buffers in the order of their first row since the last take
        self._part_of: dict[torch.device, int] = {}
        self._entries: list[Entry] = []
        self._checked = 0  # entries already read by ``anomalies``
        self._names: dict[tuple[ProbeSite, int, int], RecordNames] = {}  # (site, index, call) -> names
        self._described: dict[tuple, Described] = {}
        choice = default_backend()
        self._kernel = kernel.load(required=choice == "cpp") if choice != "torch" else None
        self._lock = threading.Lock()
        self._cpu: tuple[_Buffer, int] | None = None  # the CPU buffer and its part since the last take, once known
        # One callable for every block: the writer keeps a block's sample indices for the next one made by it.
        self._indices = functools.partial(_sample_list, count=sample_count)

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ adding records

    def add(self, event: ProbeEvent, index: int, tensor: torch.Tensor) -> BaseException | None:
        """Statistics of ``tensor`` (the ``index``-th of ``event``) into a row; on failure an entry without
        statistics, and the error returned."""
        names = self._names.get((event.site, index, event.call)) or self._names_of(event, index)
        return self.add_named(names, event.step, event.phase, event.seq, tensor)

    def add_event(self, event: ProbeEvent) -> list[tuple[int, BaseException]] | None:
        """``add`` of each tensor of a probe's event (None where none came): None when it had none, else the
        ``(index, error)`` of its records without statistics (usually none). The record path: one call per event."""
        errors = None
        site, call, step, phase, seq = event.site, event.call, event.step, event.phase, event.seq
        for index, tensor in enumerate(event.tensors):
            if tensor is not None:
                names = self._names.get((site, index, call)) or self._names_of(event, index)
                error = self.add_named(names, step, phase, seq, tensor)
                if errors is None:
                    errors = []
                if error is not None:
                    errors.append((index, error))
        return errors

    def add_named(self, names: RecordNames, step: int, phase: str, seq: int, tensor: torch.Tensor) -> BaseException | None:
        """``add`` for a record named by ``names`` (see ``probes.dump.rowblock``)."""
        try:
            # The common tensor in one kernel call (``Kernel.fast_row``: a plain contiguous CPU tensor of a kernel
            # dtype within one bucket, every check made there), inline: this runs once per record. The kernel
            # declines any other tensor (nothing written), which then takes the general path, ``_fill``.
            kernel = self._kernel
            if kernel is not None and type(tensor) in _PLAIN_TYPES and tensor.is_cpu:
                buffer, part = self._cpu or self._cpu_part()
                row = buffer.used  # (next_row, inlined: the row is taken only once it is written)
                if row == buffer.capacity:
                    buffer.grow()
                if kernel.fast_row(tensor, buffer.rows, row, self.sample_count, self.bucket_size):
                    if self.hash:
                        kernel.hash_into(tensor, buffer.rows, row, self.width - 1)
                    described = (self._described.get((tensor.shape, tensor.dtype))
                                 or self._describe(tensor, tensor, None, not tensor.dtype.is_floating_point))
                    buffer.used = row + 1
                    # Entry(...) less its Python __new__ (it only checks the count).
                    self._entries.append(tuple.__new__(Entry, (names, phase, seq, described, part, row, step)))
                    return None
            described, part, row = self._fill(tensor)
        except Exception as error:  # a probe is an observer: nothing about a tensor may stop training
            return self._failed(names, step, phase, seq, tensor, error)
        self._entries.append(tuple.__new__(Entry, (names, phase, seq, described, part, row, step)))
        return None

    def _failed(self, names: RecordNames, step: int, phase: str, seq: int, tensor: torch.Tensor,
                error: Exception) -> BaseException:
        """The entry of a record whose statistics failed; the error, without its frames (they would keep the
        tensor alive)."""
        self._entries.append(Entry(names, phase, seq, unsupported_description(tensor, self._describe_failure(error)),
                                   None, None, step))
        return error.with_traceback(None)

    def add_unsupported(self, event: ProbeEvent, index: int, tensor: torch.Tensor | None, reason: str) -> None:
        """An entry without statistics: what is known of ``tensor`` (None: nothing), and why."""
        self.add_unsupported_named(self._names_of(event, index), event.step, event.phase, event.seq, tensor, reason)

    def add_unsupported_named(self, names: RecordNames, step: int, phase: str, seq: int, tensor: torch.Tensor | None,
                              reason: str) -> None:
        """``add_unsupported`` for a record named by ``names``."""
        self._entries.append(Entry(names, phase, seq, unsupported_description(tensor, reason), None, None, step))

    def _names_of(self, event: ProbeEvent, index: int) -> RecordNames:
        site = event.site
        key = (site, index, event.call)  # sites hash by identity
        names = self._names.get(key)
        if names is None:
            names = self._names[key] = RecordNames(event.record_name(index), index, site.module, site.module_class,
                                                   site.kind, site.depth, site.legacy_name(index), site.inputs)
        return names

    def add_row(self, names: RecordNames, step: int, phase: str, seq: int, row: torch.Tensor | None,
                described: Described) -> None:
        """A record whose row was computed elsewhere (``probes.stats.shards``: merged from shards), copied into
        the buffer of its device; ``row`` None: a record without statistics (``described.unsupported`` says why).
        Such a row has statistics and samples only: with ``hash``, the record has no hash (None)."""
        if row is None:
            self._entries.append(Entry(names, phase, seq, described, None, None, step))
            return
        buffer, part = self._buffer(row.device)
        at = buffer.next_row()
        buffer.rows[at, :row.shape[-1]].copy_(row)
        if self.hash:
            described = described._replace(hashed=False)
        self._entries.append(Entry(names, phase, seq, described, part, at, step))

    def _fill(self, tensor: torch.Tensor) -> tuple[Described, int, int]:
        """Writes the statistics and samples of a tensor that ``add_named``'s kernel call declined (and its hash) into
        a row: (what it is, part, row)."""
        described, part, row, values = self._fill_statistics(tensor)
        if self.hash:
            buffer = self._parts[part]
            if buffer.device.type == "cpu" and self._kernel is not None and values.is_cpu and values.is_contiguous():
                self._kernel.hash_into(values, buffer.rows, row, self.width - 1)
            else:
                hashed = tensor_hash(values, on_cpu=buffer.device.type == "cpu")
                buffer.rows[row, self.width - 1:].view(torch.int64).copy_(hashed)
        return described, part, row

    def _cpu_part(self) -> tuple[_Buffer, int]:
        """The CPU buffer and its part since the last take, kept for the next rows."""
        self._cpu = self._buffer(_CPU)
        return self._cpu

    def _fill_statistics(self, tensor: torch.Tensor) -> tuple[Described, int, int, torch.Tensor]:
        """Writes the statistics and samples of ``tensor`` into a row: (what it is, part, row, what was read)."""
        fused = self._kernel
        if is_dense(tensor) and not tensor.is_complex():
            values, stats_of = tensor, None
        else:
            values, stats_of = statistics_view(tensor)
        check_readable(values)
        if values.is_neg():  # a lazily negated view: the kernel reads memory, which holds -x
            values = values.resolve_neg()
        numel = values.numel()
        integer = not (_WIDENED.get(values.dtype) or values.dtype).is_floating_point
        described = self._describe(tensor, values, stats_of, integer)
        if fused is not None and kernel_reads_whole(values, self.bucket_size):
            return described, *self._kernel_row(fused, values, numel), values
        if (self.run_on_cpu and not values.is_cpu) or (values.is_cpu and fused is not None):
            return described, *self._host_row(values, integer), values  # the kernel over buckets
        buffer, part = self._buffer(values.device)
        row = buffer.next_row()
        target = buffer.rows[row]
        if numel == 0:
            target[:ACCUMULATED_WIDTH].zero_()
            for name, value in _EMPTY_FILL.items():
                target[_SLOT[name]].fill_(value)
            return described, part, row, values
        target[:ACCUMULATED_WIDTH].copy_(device_row(values, self.bucket_size))
        taken = min(numel, self.sample_count)
        target[ACCUMULATED_WIDTH:ACCUMULATED_WIDTH + taken].copy_(
            device_samples(values, _sample_positions(numel, self.sample_count, values.device)))
        return described, part, row, values

    def _kernel_row(self, fused: kernel.Kernel, values: torch.Tensor, numel: int) -> tuple[int, int]:
        """(part, row) of a CPU tensor the kernel reads whole, written by one call."""
        buffer, part = self._buffer(_CPU)
        row = buffer.next_row()
        fused.row_into(values, buffer.rows, row, _sample_positions(numel, self.sample_count, _CPU))
        return part, row

    def _host_row(self, values: torch.Tensor, integer: bool) -> tuple[int, int]:
        """The row of a tensor computed on the CPU by ``summarize`` (buckets, widened dtypes, ``run_on_cpu``)."""
        summary = summarize(values, bucket_size=self.bucket_size, run_on_cpu=True)
        buffer, part = self._buffer(_CPU)
        row = buffer.next_row()
        slots = np.zeros(self.width)
        for slot, stat in enumerate(ACCUMULATED):
            value = getattr(summary, stat.name)
            if value is None:
                value = _EMPTY_FILL.get(stat.name, math.nan)
            elif integer and stat.column == "number":
                value = np.array(value, dtype=np.int64).view(np.float64)
            slots[slot] = value
        if values.numel():
            positions = _sample_positions(values.numel(), self.sample_count, values.device)
            samples = device_samples(values, positions).cpu().numpy()
            slots[ACCUMULATED_WIDTH:ACCUMULATED_WIDTH + len(samples)] = samples
        buffer.rows[row].copy_(torch.from_numpy(slots))
        return part, row

    def _describe(self, tensor: torch.Tensor, values: torch.Tensor, stats_of: str | None, integer: bool) -> Described:
        if stats_of is not None:  # an odd tensor (nested, sparse, ...): described afresh, its shape may be ragged
            layout = tensor.layout is not torch.strided or tensor.is_nested
            return Described(("shape", "dtype", "layout", "stats_of") if layout else ("shape", "dtype", "stats_of"),
                             shape_of(tensor), dtype_name(tensor), layout_name(tensor) if layout else None, stats_of,
                             integer=integer, numel=values.numel())
        key = (tensor.shape, tensor.dtype)
        described = self._described.get(key)
        if described is None:
            described = Described(("shape", "dtype"), list(tensor.shape), dtype_name(tensor), integer=integer,
                                  numel=values.numel())
            if len(self._described) < 4096:
                self._described[key] = described
        return described

    def _buffer(self, device: torch.device) -> tuple[_Buffer, int]:
        part = self._part_of.get(device)
        if part is not None:
            return self._parts[part], part
        # A model on several GPUs runs each device's backward on its own autograd thread: a device's first
        # row of a step is the one moment two threads may change the same lists.
        with self._lock:
            buffer = self._buffers.get(device)
            if buffer is None:
                buffer = self._buffers[device] = _Buffer(device, self.width, _FIRST_CAPACITY)
            part = self._part_of.get(device)
            if part is None:
                self._parts.append(buffer)
                part = self._part_of[device] = len(self._parts) - 1
            return buffer, part

    # ------------------------------------------------------------------ reading and handing over

    def anomalies(self, find: Callable[[np.ndarray, list[tuple]], None]) -> None:
        """Gives ``find`` the nan, inf, min and max slots of the rows added since the last call (one read
        per device) and their entries; min/max of integer tensors as int64 bit patterns."""
        entries = self._entries[self._checked:]
        self._checked = len(self._entries)
        if not entries:
            return
        slots = [_SLOT[name] for name in ("nan", "inf", "min", "max")]
        parts = {part: buffer.rows[:buffer.used, slots].cpu().numpy() for part, buffer in enumerate(self._parts)}
        stats = np.full((len(entries), len(slots)), np.nan)
        for position, entry in enumerate(entries):
            if entry.part is not None:
                stats[position] = parts[entry.part][entry.row]
        find(stats, entries)

    def clear(self) -> None:
        """Forgets the records since the last take (their rows are reused)."""
        for buffer in self._parts:
            buffer.used = 0
        self._reset()

    def _reset(self) -> None:
        """No entries, and no buffer taking part, since the last take."""
        self._entries = []
        self._checked = 0
        self._parts = []
        self._part_of = {}
        self._cpu = None

    def take(self) -> list[RowBlock]:
        """The records since the last take, a RowBlock per step; their rows leave in one copy per device."""
        if not self._entries:
            return []
        hosts: list[torch.Tensor] = []
        events = []
        for buffer in self._parts:
            used = buffer.rows[:buffer.used]
            if buffer.device.type == "cpu":
                hosts.append(used)
                # The block keeps this buffer: the next rows go to a new one of the same size.
                self._buffers[buffer.device] = _Buffer(buffer.device, self.width, buffer.capacity)
            elif buffer.device.type == "cuda":
                host = torch.empty(used.shape, dtype=torch.float64, pin_memory=True)
                host.copy_(used, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                events.append(event)
                hosts.append(host)
                buffer.used = 0  # stream order: later rows are written after this copy has read them
            else:  # other devices: one blocking copy
                hosts.append(used.to("cpu"))
                buffer.used = 0
        entries = self._entries
        by_step: dict[int, list[Entry]] = {}
        if len(set(map(_STEP, entries))) == 1:  # the common case: no loop per record on the training thread
            by_step[entries[0].step] = entries
        else:
            for entry in entries:
                by_step.setdefault(entry.step, []).append(entry)
        ready = _waiter(events)
        self._reset()
        return [RowBlock(step=step, rank=self.rank, sample_count=self.sample_count, parts=hosts, entries=entries,
                         ready=ready, indices=self._indices, hashed=self.hash) for step, entries in by_step.items()]


def unsupported_description(tensor: torch.Tensor | None, reason: str) -> Described:
    """What a record without statistics says: what is known of ``tensor`` (None: nothing), and why."""
    present = ("shape", "dtype", "layout", "stats_of", "unsupported")
    if tensor is None:
        return Described(present, unsupported=reason)
    return Described(present, shape_of(tensor), or_none(dtype_name, tensor), or_none(layout_name, tensor), None,
                     reason)


def _waiter(events: list) -> Callable[[], None] | None:
    if not events:
        return None

    def wait() -> None:
        for event in events:
            event.synchronize()
    return wait
