"""Statistics of tensors split in contiguous shards across ranks, merged exactly without gathering the tensors.

    shards = ShardRows(step_rows, group=group)        # step_rows: the subscriber's StepRows; group: the ranks holding shards
    shards.add(names, step, "param", seq, shard, full_shape=(7, 5), bounds=((0, 18), (18, 35)), rank=rank)
    shards.flush()                                    # one all_gather of every row added; a merged record each in step_rows

Made for DeepSpeed ZeRO-3, where each rank holds a slice of each parameter's fp32 master copy, of its gradient
and of its optimizer state (``exporters.adapters.deepspeed_internals.zero3_stepping``); usable for any tensor whose
flattened elements are split in contiguous ranges, one per rank (``bounds[r] = (start, end)``, empty allowed).

- ``add`` computes the shard's row on its device (``probes.stats.rows``' layout: the accumulated statistics of
  ``probes.dump.statistics``, then samples), with no host read. Its samples are the full tensor's
  (``sample_indices(full_numel, count)``) that fall in this shard.
- ``flush`` gathers every row added since the last flush with one ``torch.distributed.all_gather`` (on the
  rows' device: on CUDA it stays there), merges each tensor's rows (``merge_shard_rows``: the registry's
  merge rules in ``numerics.merge_rows``, k-way around a shift of 0) and puts the merged row in the
  ``StepRows`` (``add_row``): a record of the whole tensor, ``shape`` its full shape, as if it had been read
  whole. Every rank gets the same merged rows.

Every rank must add the same tensors (same order, same full sizes) and flush together: ``flush`` is a
collective. A shard whose statistics fail on one rank still takes part (its row is nan), so no rank waits
forever; that rank's record says "unsupported", the others' hold nan statistics.
"""

from __future__ import annotations

import bisect
import functools
import math
from typing import Any, NamedTuple, Sequence

import torch

from ..dump.rowblock import ACCUMULATED_WIDTH, Described, RecordNames
from ..dump.statistics import ACCUMULATED
from . import kernel
from .kernel import KernelRow, default_backend
from .numerics import _WIDENED, DEFAULT_BUCKET_SIZE, device_row, device_samples, kernel_reads_whole, merge_rows, sample_index_tensor, sample_indices
from .rows import _EMPTY_FILL, _SLOT, StepRows, unsupported_description
from .views import check_readable, dtype_name

__all__ = ["ShardGroups", "ShardRows", "ShardSpec", "merge_shard_rows", "shard_row"]

# merge_rows reads KernelRow's columns: the accumulated statistics, then shift and deviation.
if KernelRow._fields != tuple(stat.name for stat in ACCUMULATED) + ("shift", "deviation"):
    raise RuntimeError("probes.stats.shards builds KernelRow-shaped rows: update it with KernelRow")
_FINITE, _MEAN = _SLOT["finite"], _SLOT["mean"]


class ShardSpec(NamedTuple):
    """How one tensor is split: its element count and every rank's ``(start, end)`` of its flattened elements."""

    numel: int
    bounds: tuple[tuple[int, int], ...]

    def check(self) -> None:
        """ValueError unless the ranges cover ``[0, numel)`` in rank order without gap or overlap."""
        ends = [0, *(end for _, end in self.bounds)]
        if not self.bounds or any(start != ends[r] or end < start for r, (start, end) in enumerate(self.bounds)) \
                or ends[-1] != self.numel:
            raise ValueError(f"shard bounds {self.bounds} do not split {self.numel} elements into contiguous ranges "
                             "in rank order; give every rank's (start, end), empty ranges included")


@functools.lru_cache(maxsize=4096)
def _sample_slots(spec: ShardSpec, count: int) -> tuple[tuple[int, int], ...]:
    """Per rank, the range ``[a, b)`` of the full tensor's sample slots its shard holds."""
    positions = sample_indices(spec.numel, count)
    return tuple((bisect.bisect_left(positions, start), bisect.bisect_left(positions, end)) for start, end in spec.bounds)


@functools.lru_cache(maxsize=4096)
def _local_positions(numel: int, count: int, start: int, slots: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The shard's positions of the full tensor's samples ``slots``, made on ``device`` by formula (no host copy)."""
    return (sample_index_tensor(numel, count, device)[slots[0]:slots[1]] - start).contiguous()


@functools.lru_cache(maxsize=256)
def _sample_sources(specs: tuple[ShardSpec, ...], count: int, width: int, device: torch.device) -> torch.Tensor:
    """(rows, count) flat indices into the gathered ``(world, rows, width)`` rows: where each sample of each
    merged row is (the rank holding that position, its slot there); unused slots point at 0."""
    sources = []
    for index, spec in enumerate(specs):
        row = [0] * count
        for rank, (first, last) in enumerate(_sample_slots(spec, count)):
            base = (rank * len(specs) + index) * width + ACCUMULATED_WIDTH - first
            row[first:last] = range(base + first, base + last)
        sources.append(row)
    return torch.tensor(sources, dtype=torch.int64).to(device)  # once per set of tensors: cached


def merge_shard_rows(gathered: torch.Tensor, specs: Sequence[ShardSpec], *, integer: Sequence[bool]) -> torch.Tensor:
    """The rows of whole tensors from their shards' rows, on the rows' device with no host read.

    ``gathered``: ``(world, len(specs), width)``, rank ``r``'s rows (``ShardRows``' layout: accumulated statistics,
    then the samples its shard holds); ``integer[i]``: row ``i`` is of an integer tensor (min, max and samples
    as int64 bit patterns). Returns ``(len(specs), width)``: the accumulated statistics merged by the registry's
    rules (``numerics.merge_rows``), then the full tensor's samples at ``sample_indices(numel, width - ACCUMULATED_WIDTH)``.
    """
    world, count, width = gathered.shape
    if count != len(specs) or len(integer) != count or any(len(spec.bounds) != world for spec in specs):
        raise ValueError(f"merge_shard_rows: {count} rows of {world} ranks, but {len(specs)} specs and "
                         f"{len(integer)} integer flags (each spec with {world} bounds) were given")
    stats = gathered[..., :ACCUMULATED_WIDTH]
    finite = stats[..., _FINITE]
    # The k-way merge around one shift: shift 0, so each shard's deviation is its mean (0 when none is finite).
    deviation = torch.where(finite > 0, stats[..., _MEAN], torch.zeros((), dtype=stats.dtype, device=stats.device))
    bucket_rows = torch.cat([stats, torch.zeros_like(deviation).unsqueeze(-1), deviation.unsqueeze(-1)], dim=-1)
    bucket_rows = bucket_rows.transpose(0, 1)  # (rows, world, columns): merge_rows merges the second to last dim
    merged = torch.empty((count, width), dtype=torch.float64, device=gathered.device)
    for kind in (False, True):
        picked = [index for index, flag in enumerate(integer) if bool(flag) == kind]
        if picked:
            at = torch.tensor(picked, dtype=torch.int64).to(gathered.device) if len(picked) < count else slice(None)
            merged[at, :ACCUMULATED_WIDTH] = merge_rows(bucket_rows[at], integer=kind)
    merged[:, ACCUMULATED_WIDTH:] = gathered.reshape(-1)[_sample_sources(tuple(specs), width - ACCUMULATED_WIDTH,
                                                                         width, gathered.device)]
    return merged


def shard_row(shard: torch.Tensor, spec: ShardSpec, rank: int, *, sample_count: int,
              bucket_size: int = DEFAULT_BUCKET_SIZE) -> torch.Tensor:
    """Rank ``rank``'s row of a tensor split by ``spec``, on the shard's device with no host read: a float64
    vector of the accumulated statistics of ``shard``, then the full tensor's samples it holds (``ShardRows``)."""
    out = torch.empty((1, ACCUMULATED_WIDTH + sample_count), dtype=torch.float64, device=shard.device)
    _fill(out, shard, spec, rank, bucket_size)
    return out[0]


def _fill(out: torch.Tensor, shard: torch.Tensor, spec: ShardSpec, rank: int, bucket_size: int) -> None:
    """``shard_row`` into ``out[0]`` (a contiguous (1, width) float64 tensor: the kernel's form)."""
    check_readable(shard)
    values = shard.reshape(-1)
    if values.is_neg():  # a lazily negated view: the kernel reads memory, which holds -x
        values = values.resolve_neg()
    out[0, ACCUMULATED_WIDTH:].zero_()
    if values.numel() == 0:
        out[0, :ACCUMULATED_WIDTH].zero_()
        for name, value in _EMPTY_FILL.items():
            out[0, _SLOT[name]] = value
        if not (_WIDENED.get(values.dtype) or values.dtype).is_floating_point:
            bits = out[0].view(torch.int64)  # integer min/max are int64 bit patterns: the extremes any value replaces
            bits[_SLOT["min"]], bits[_SLOT["max"]] = 2**63 - 1, -2**63
        return
    count = out.shape[1] - ACCUMULATED_WIDTH
    slots = _sample_slots(spec, count)[rank]
    positions = _local_positions(spec.numel, count, spec.bounds[rank][0], slots, values.device)
    choice = default_backend()
    fused = kernel.load(required=choice == "cpp") if choice != "torch" and kernel_reads_whole(values, bucket_size) else None
    if fused is not None:
        fused.row_into(values, out, 0, positions)
        return
    out[0, :ACCUMULATED_WIDTH].copy_(device_row(values, bucket_size))
    out[0, ACCUMULATED_WIDTH:ACCUMULATED_WIDTH + positions.numel()].copy_(device_samples(values, positions))


class _ShardRecord(NamedTuple):
    """A shard's record waiting for the gather: what names it, and where its shard lies in the whole tensor."""

    names: RecordNames
    step: int
    phase: str
    seq: int
    described: Described
    spec: ShardSpec


class ShardRows:
    """Rows of this rank's shards since the last flush, and the records they make (see the module docstring).

    ``rows``: the StepRows the merged records go to (its sample count and bucket size apply); ``group``: the
    process group whose ranks hold the shards (None: the default group).
    """

    def __init__(self, rows: StepRows, *, group: Any = None) -> None:
        self.rows = rows
        self.group = group
        self.width = ACCUMULATED_WIDTH + rows.sample_count  # statistics and samples (a merged row has no hash)
        self._pending: list[torch.Tensor] = []
        self._entries: list[_ShardRecord] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, names: RecordNames, step: int, phase: str, seq: int, shard: torch.Tensor, *,
            full_shape: Sequence[int], bounds: Sequence[tuple[int, int]], rank: int) -> BaseException | None:
        """The row of ``shard`` (rank ``rank``'s elements ``bounds[rank]`` of a tensor of ``full_shape``) for the
        record named by ``names``; on failure a nan row (the collective still matches) and the error returned.

        ValueError (nothing added) when the bounds do not split the full tensor or ``shard`` does not fit them.
        """
        spec = ShardSpec(math.prod(full_shape), tuple((int(start), int(end)) for start, end in bounds))
        spec.check()
        start, end = spec.bounds[rank]
        if shard.numel() != end - start:
            raise ValueError(f"the shard of {names.name!r} has {shard.numel()} elements, but rank {rank}'s bounds "
                             f"({start}, {end}) hold {end - start}")
        out = torch.empty((1, self.width), dtype=torch.float64, device=shard.device)
        integer = not (_WIDENED.get(shard.dtype) or shard.dtype).is_floating_point
        described = Described(("shape", "dtype"), [int(size) for size in full_shape], dtype_name(shard), integer=integer,
                              numel=spec.numel)
        failure = None
        try:
            _fill(out, shard, spec, rank, self.rows.bucket_size)
        except Exception as error:  # a probe is an observer: the rank still joins the gather
            out = torch.full((1, self.width), math.nan, dtype=torch.float64)  # the shard's device may hold no data
            failure = error.with_traceback(None)
            described = unsupported_description(shard, str(error) or type(error).__name__)._replace(
                shape=[int(size) for size in full_shape])
        self._pending.append(out)
        self._entries.append(_ShardRecord(names, step, phase, seq, described, spec))
        return failure

    def clear(self) -> None:
        """Drops the rows added since the last flush (no collective: every rank drops the same)."""
        self._pending, self._entries = [], []

    def flush(self) -> None:
        """Gathers the rows added since the last flush from every rank (one all_gather) and adds each merged
        row to the StepRows as a record. A collective: every rank calls it with the same tensors added."""
        if not self._entries:
            return
        pending, entries = self._pending, self._entries
        self._pending, self._entries = [], []
        world = len(entries[0].spec.bounds)
        # The rows travel, not the shards: to the accelerator where any is (offload may leave shards on the CPU).
        device = next((row.device for row in pending if row.device.type != "cpu"), pending[0].device)
        local = torch.cat([row.to(device) for row in pending]) if len(pending) > 1 else pending[0]
        gathered = self._gather(local, world)
        merged = merge_shard_rows(gathered, [entry.spec for entry in entries],
                                  integer=[entry.described.integer for entry in entries])
        for index, (names, step, phase, seq, described, _) in enumerate(entries):
            self.rows.add_row(names, step, phase, seq, None if described.unsupported else merged[index], described)

    def _gather(self, local: torch.Tensor, world: int) -> torch.Tensor:
        """``(world, rows, width)``: every rank's rows, by one all_gather on their device."""
        if world == 1:
            return local.unsqueeze(0)
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(group=self.group) != world:
            raise ValueError(f"the shards are split over {world} ranks, but the process group has "
                             f"{dist.get_world_size(group=self.group) if dist.is_initialized() else 'no'} ranks: "
                             "give ShardRows the group whose ranks hold them")
        if "nccl" in str(dist.get_backend(self.group)) and local.device.type != "cuda":
            local = local.to(torch.device("cuda", torch.cuda.current_device()))  # NCCL gathers device memory
        gathered = torch.empty((world, *local.shape), dtype=local.dtype, device=local.device)
        dist.all_gather(list(gathered.unbind(0)), local, group=self.group)
        return gathered


class ShardGroups:
    """One ``ShardRows`` per process group, flushed together: the shards of a step's records, whichever ranks hold them.

    ``add(..., group=group)`` is ``ShardRows.add`` for the shards ``group``'s ranks hold; ``flush()`` one all_gather
    per group, in the order the groups were first used (the same on every rank); ``clear()`` as ``ShardRows.clear``.
    """

    def __init__(self, rows: StepRows) -> None:
        self.rows = rows
        self._groups: dict[int, ShardRows] = {}  # id(process group) -> its shard rows (which keep the group alive)

    def add(self, names: RecordNames, step: int, phase: str, seq: int, shard: torch.Tensor, *, full_shape: Sequence[int],
            bounds: Sequence[tuple[int, int]], rank: int, group: Any) -> BaseException | None:
        rows = self._groups.get(id(group))
        if rows is None:
            rows = self._groups[id(group)] = ShardRows(self.rows, group=group)
        return rows.add(names, step, phase, seq, shard, full_shape=full_shape, bounds=bounds, rank=rank)

    def flush(self) -> None:
        for rows in self._groups.values():
            rows.flush()

    def clear(self) -> None:
        for rows in self._groups.values():
            rows.clear()
