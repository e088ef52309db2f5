"""Parameter, gradient and optimizer-state records: what an optimizer's update used and produced.

    records = ParameterRecords(rows, selection=selection, optimizer_state=True, finish=finish, warn=warn)
    records.attach(model)              # "subscribe": the parameters and their names; torch's global optimizer hooks
    records.step_started(step)         # "step_start": a step waiting for its update is over: finish its file
    if not records.step_ended(step, seq=next_seq):  # "step_end": True when the step's file waits for the update
        finish(step)
    records.settle()                   # flush()/close(): a waiting step is finished now
    records.detach()                   # close(): the hooks are removed

The records (``StatisticsSubscriber(parameters=True, optimizer_state=True)``), ``kind="parameter"``, ``module`` the
owning module's qualified name (``"<root>"`` for the root's own), ``name`` the parameter's qualified name in the
user's module, wrappers removed (``probes.core.wrappers``; a shared parameter has its first name):

- ``phase="grad"``, ``blocks.0.fc.weight``: the gradient the optimizer used (``p.grad``: after accumulation, after
  clipping and ``GradScaler.unscale_`` done before ``step()``, after DDP's all-reduce);
- ``phase="param"``: the parameter after the update;
- ``phase="optim"``, ``blocks.0.fc.weight.exp_avg``: each tensor of ``optimizer.state[p]`` after the update,
  for any optimizer whose state of a parameter is a dict (non-tensor values, and other kinds of state, are left out).

When: torch's global optimizer hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook`` and ``_post_hook``)
see every ``step()`` of every ``torch.optim`` optimizer; only those holding parameters of the model (matched by
identity, cached per optimizer, weakly) are recorded, in their post-hook, after the update. The gradient is read
there too: with a closure (LBFGS, Lightning's automatic optimization) it exists only after ``step()`` began, and a
fused optimizer under ``GradScaler`` leaves the unscaled gradient in ``p.grad``; torch's optimizers never change
``p.grad`` in place otherwise. An optimizer stepping inside another's step (``ZeroRedundancyOptimizer``'s local
one) is left to the outer one, whose post-hook sees the final parameters.

Which step: a step closes when its backward ends, before ``optimizer.step()``; the update belongs to the step whose
backward just ran (with gradient accumulation, the micro-step at which the optimizer runs). So ``step_ended``
keeps that step's file open, and it is finished when every parameter of the model that requires grad was
updated (one optimizer, or several), when the next step opens, or at ``settle()``. Until then the step file is
``.partial``: a crash leaves it unfinished, like any step cut short. Records of a step are ordered grad, param,
optim after its forward and backward ones (``seq`` continues the step's; parameters in model order; with
several optimizers the file holds each one's records in turn, and ``seq`` still gives that order). Special
cases, chosen so that a record always means the same thing:

- No optimizer has stepped the model's parameters yet in this subscription: the gradients are recorded at the
  step's end (there is nothing else to wait for), and no param records. Should an optimizer then step for that
  step, its records replace them. Under gradient accumulation that gives the micro-steps before the first update
  grad records of the gradient accumulated so far: nothing can tell that an optimizer will come. From the first
  update on, only micro-steps whose optimizer ran have grad/param/optim records.
- A step ``GradScaler`` skips (inf/nan gradients: it does not call ``optimizer.step()``) has no grad, param or
  optim records, since nothing changed the weights; its backward records show the inf/nan.
- An update after the next step's forward began (an evaluation forward while not paused) is not recorded: that
  step's file was finished already. A second ``step()`` in one step likewise.

Costs: the names are made once per parameter (and per state key); statistics go through ``StepRows.add_named``
(no host read); the per-step Python work is one pass over the optimizer's parameters.

A probe is an observer: a tensor without statistics is an "unsupported" record and one warning (``warn``); any
other failure in the hooks is one ``ProbeFailureWarning`` and an "unsupported" record named ``<parameters>``,
never an exception out of ``optimizer.step()`` (errors of the dump itself, ``DumpWriteError``, are raised as
everywhere else). ``on_anomaly`` does not check these records.

``ModelParameters`` is where the tensors come from: the model's own parameters. Under a DeepSpeed ZeRO-3 engine
the model's parameters are partitioned and its inner optimizer steps flat fp32 partitions: the records are then
of each rank's shards of the fp32 master copy, its gradient and its optimizer state, merged exactly across
ranks without gathering (``probes.stats.zero3_updates``); the gradient is read in the pre-hook there (DeepSpeed
frees it after the update), once per sub-group, and the step's file is finished after the last sub-group.

FSDP2 (``torch.distributed.fsdp.fully_shard``): the parameters, their gradients and the optimizer's state of them
are DTensors, matched by identity as any parameter. A DTensor's record goes through ``probes.stats.dtensors``:
with one ``Shard(0)`` placement on a 1-D mesh (FSDP2's), each rank's shard row is merged exactly with the
others' into the record of the whole tensor, on every rank, by one ``all_gather`` per step when the step's file
is finished (``settle``: after the last optimizer's update), without gathering the tensor; a ``Replicate()`` one
is recorded as its local tensor (it is whole); any other placement is an "unsupported" record naming it.
FSDP1 (``FullyShardedDataParallel(use_orig_params=True)``) is not supported: its parameters are plain views of
each rank's part of a flat parameter, so each rank records its own flattened slice under the full name
(a 1-D shape, possibly empty, no grad record where the slice is empty); without ``use_orig_params``, each
rank's part of each unit's ``_flat_param``. Use FSDP2.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..core.failures import ProbeFailureWarning, failure_reason
from ..utils.names import ROOT_NAME
from ..core.selection import Selection
from ..core.wrappers import user_named_modules
from ..dump.layout import DumpWriteError
from ..dump.rowblock import RecordNames
from .dtensors import DTensorRecords
from .rows import StepRows
from .shards import ShardGroups
from .views import is_dtensor
from .zero3_updates import Zero3Updates

__all__ = ["KIND", "ModelParameters", "ParameterRecords", "Tracked"]

KIND = "parameter"  # the ``kind`` of every grad, param and optim record
FAILED = "<parameters>"  # the name of the record that says the hooks themselves failed


class Tracked:
    """One parameter of the model: the tensor, its place in model order and what names its records."""

    __slots__ = ("index", "module", "module_class", "name", "names", "selected", "state_names", "tensor")

    def __init__(self, tensor: torch.Tensor, index: int, name: str, module: str, module_class: str, depth: int,
                 selected: bool) -> None:
        self.tensor = tensor
        self.index = index
        self.name = name
        self.module = module
        self.module_class = module_class
        self.selected = selected
        self.names = RecordNames(name, 0, module, module_class, KIND, depth, name, None)
        self.state_names: dict[str, RecordNames] = {}

    def state_name(self, key: str) -> RecordNames:
        """The names of the record of its optimizer state ``key`` (``<name>.<key>``), made once."""
        names = self.state_names.get(key)
        if names is None:
            name = f"{self.name}.{key}"
            names = self.state_names[key] = self.names._replace(name=name, legacy_name=name)
        return names


class ModelParameters:
    """The parameters of the user's module by identity, with their wrapper-free qualified names.

    ``wants(module, module_class)`` is the selection's rule for the owning module (``Selection.wants_names``).
    """

    def __init__(self, root: torch.nn.Module, wants: Callable[[str, str], bool]) -> None:
        self.tracked: dict[int, Tracked] = {}
        for module_name, module in user_named_modules(root):
            owner = module_name or ROOT_NAME
            module_class = type(module).__name__
            depth = module_name.count(".") + 1 if module_name else 0
            selected = wants(owner, module_class)
            for local, tensor in module.named_parameters(recurse=False):
                if tensor is None or id(tensor) in self.tracked:
                    continue  # a shared parameter keeps its first name, as named_parameters() does
                name = f"{module_name}.{local}" if module_name else local
                self.tracked[id(tensor)] = Tracked(tensor, len(self.tracked), name, owner, module_class, depth, selected)

    def holds(self, optimizer: torch.optim.Optimizer) -> tuple[Tracked, ...]:
        """The model's parameters that ``optimizer`` holds, in model order."""
        found: dict[int, Tracked] = {}
        for group in optimizer.param_groups:
            for tensor in group["params"]:
                tracked = self.tracked.get(id(tensor))
                if tracked is not None and tracked.tensor is tensor:
                    found[tracked.index] = tracked
        return tuple(found[index] for index in sorted(found))

    def everything(self) -> tuple[Tracked, ...]:
        """Every parameter of the model, in model order."""
        return tuple(self.tracked.values())

    def trainable(self) -> Iterator[Tracked]:
        """The parameters an update is expected to change: those that require grad."""
        return (tracked for tracked in self.tracked.values() if tracked.tensor.requires_grad)

    def grad(self, tracked: Tracked) -> torch.Tensor | None:
        return tracked.tensor.grad

    def value(self, tracked: Tracked) -> torch.Tensor:
        return tracked.tensor

    def state(self, optimizer: torch.optim.Optimizer, tracked: Tracked) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) of ``optimizer.state[p]`` when it is a dict; nothing otherwise."""
        state = optimizer.state.get(tracked.tensor)  # .get: state is a defaultdict, and must not grow here
        if not isinstance(state, dict):
            return
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield str(key), value


class ParameterRecords:
    """The grad, param and optim records of one subscriber, and when its step files are finished (module doc).

    ``finish(step)`` sends the rows so far and finishes the step's file; ``warn(name, phase, error)`` warns once
    about a tensor without statistics.
    """

    def __init__(self, rows: StepRows, *, selection: Selection, optimizer_state: bool,
                 finish: Callable[[int], None], warn: Callable[[str, str, BaseException], None]) -> None:
        self._rows = rows
        self._selection = selection
        wanted = ("grad", "param", "optim") if optimizer_state else ("grad", "param")
        self.phases = tuple(phase for phase in wanted if selection.wants_phase(phase))
        self._finish = finish
        self._warn = warn
        self._source: ModelParameters | None = None
        self._handles: list = []
        self._holding: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (signature, tracked)
        self._stepping: list[torch.optim.Optimizer] = []  # optimizers inside step(), outermost first
        self._optimized: set[int] = set()  # ids of parameters an optimizer has stepped in this subscription
        self._pending: int | None = None  # the step whose file waits for its update
        self._seq = 0  # the pending step's first free seq: grad records take seq + index, param seq + count + index
        self._next_seq = 0  # the next free seq after those (optim records, failures)
        self._updated: set[int] = set()  # ids of parameters updated in the pending step
        self._step_end_grads = False  # the rows hold the pending step's gradients read at its end
        self._phase = "grad"  # what the hooks are recording now (named by a failure record)
        self._failed_once = False
        self._shards = ShardGroups(rows)  # ZeRO-3's and DTensors' shard rows, merged once per step in settle()
        self._zero3 = Zero3Updates(self._shards)
        self._dtensors = DTensorRecords(rows, self._shards)

    # ------------------------------------------------------------------ the subscriber's calls

    def attach(self, model: torch.nn.Module) -> None:
        """The model's parameters and names; the global optimizer hooks (weakly bound: a lost subscriber costs nothing)."""
        self.detach()
        self._source = ModelParameters(model, self._selection.wants_names)
        this = weakref.ref(self)

        def before(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            records = this()
            if records is not None:
                records._before_step(optimizer)

        def after(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            records = this()
            if records is not None:
                records._after_step(optimizer)

        self._handles = [register_optimizer_step_pre_hook(before),
                         register_optimizer_step_post_hook(after)]

    def detach(self) -> None:
        """Removes the hooks and forgets the model (a waiting step is the caller's to settle first)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._source = None
        self._holding = weakref.WeakKeyDictionary()
        self._stepping.clear()

    def step_started(self, step: int) -> None:
        if self._pending is not None:
            self.settle()

    def step_ended(self, step: int, *, seq: int) -> bool:
        """Step ``step``'s backward ended (its rows are sent): True when its file waits for the update."""
        if self._source is None or not self.phases:
            return False
        self._pending, self._seq, self._updated = step, seq, set()
        self._next_seq = seq + 2 * len(self._source.tracked)
        if not self._optimized and "grad" in self.phases:  # no optimizer so far: the gradients now
            self._guarded(step, lambda: self._record_grads(step, self._source.everything()))
            self._step_end_grads = True
        return True

    def settle(self) -> None:
        """Finishes the waiting step now (with what it has): the shards (ZeRO-3, DTensors) merged first (a collective)."""
        if self._pending is not None:
            self._guarded(self._pending, self._shards.flush)
        step, self._pending = self._pending, None
        self._step_end_grads = False
        if step is not None:
            self._finish(step)

    # ------------------------------------------------------------------ the optimizer hooks

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._stepping:  # left there by a step() that raised: an optimizer does not re-enter
            del self._stepping[self._stepping.index(optimizer):]
        self._stepping.append(optimizer)
        if self._source is not None and self._pending is not None and "grad" in self.phases:
            self._guarded(self._pending, lambda: self._zero3_grads(optimizer))

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._stepping:
            del self._stepping[len(self._stepping) - 1 - self._stepping[::-1].index(optimizer)]
        if self._source is None:
            return
        self._guarded(self._pending, lambda: self._update(optimizer))

    def _update(self, optimizer: torch.optim.Optimizer) -> None:
        owner = self._zero3_owner(optimizer)
        if owner is not None:
            return self._zero3_update(owner, optimizer)
        tracked = self._holds(optimizer)
        if not tracked or any(self._holds(outer) for outer in self._stepping):
            return  # not this model's, or stepped inside an outer optimizer's step (which records)
        self._optimized.update(id(t.tensor) for t in tracked)
        step = self._pending
        if step is None:
            return  # a step not recorded (selection), or one already finished
        tracked = tuple(t for t in tracked if id(t.tensor) not in self._updated)  # each parameter's first update
        self._drop_step_end_grads()
        with torch.no_grad():
            if "grad" in self.phases:
                self._record_grads(step, tracked)
            if "param" in self.phases:
                self._phase = "param"
                base = self._seq + len(self._source.tracked)
                for t in tracked:
                    if t.selected:
                        self._add(t.names, step, "param", base + t.index, self._source.value(t))
            if "optim" in self.phases:
                self._phase = "optim"
                for t in tracked:
                    if t.selected:
                        for key, tensor in self._source.state(optimizer, t):
                            self._add(t.state_name(key), step, "optim", self._next_seq, tensor)
                            self._next_seq += 1
        self._updated.update(id(t.tensor) for t in tracked)
        if all(id(t.tensor) in self._updated for t in self._source.trainable()):
            self.settle()

    # ZeRO-3: the inner optimizer steps flat fp32 partitions, once per sub-group (``zero3_updates``).

    def _zero3_owner(self, optimizer: torch.optim.Optimizer) -> object | None:
        assert self._source is not None
        return self._zero3.owner_of(optimizer, lambda: (t.tensor for t in self._source.everything()))

    def _zero3_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Pre-hook: the gradient shards this sub-group's update uses."""
        owner = self._zero3_owner(optimizer)
        if owner is None:
            return
        assert self._source is not None and self._pending is not None
        self._drop_step_end_grads()
        self._phase = "grad"
        for shard in self._zero3.shards(owner, optimizer).shards:
            t = self._source.tracked.get(id(shard.param))
            if t is not None and t.selected and shard.grad is not None:
                self._add_shard(t.names, self._pending, "grad", self._seq + t.index, shard.grad, shard)

    def _zero3_update(self, owner: object, optimizer: torch.optim.Optimizer) -> None:
        """Post-hook: the updated master and state shards; after the last sub-group, the merge and the step's end."""
        assert self._source is not None
        stepping = self._zero3.shards(owner, optimizer)
        self._optimized.update(id(shard.param) for shard in stepping.shards)
        step = self._pending
        if step is None:
            return
        base = self._seq + len(self._source.tracked)
        for shard in stepping.shards:
            t = self._source.tracked.get(id(shard.param))
            if t is None or not t.selected:
                continue
            if "param" in self.phases:
                self._phase = "param"
                self._add_shard(t.names, step, "param", base + t.index, shard.master, shard)
            if "optim" in self.phases:
                self._phase = "optim"
                for key in sorted(shard.state):
                    self._add_shard(t.state_name(key), step, "optim", self._next_seq, shard.state[key], shard)
                    self._next_seq += 1
        if stepping.last:
            self.settle()

    def _add_shard(self, names: RecordNames, step: int, phase: str, seq: int, tensor: torch.Tensor, shard: object) -> None:
        error = self._zero3.add(names, step, phase, seq, tensor, shard)
        if error is not None:
            self._warn(names.name, phase, error)

    def _drop_step_end_grads(self) -> None:
        if self._step_end_grads:  # the first update: its gradients replace those read at the step's end
            self._rows.clear()
            self._shards.clear()
            self._step_end_grads = False

    def _record_grads(self, step: int, tracked: tuple[Tracked, ...]) -> None:
        self._phase = "grad"
        assert self._source is not None
        for t in tracked:
            if t.selected:
                grad = self._source.grad(t)
                if grad is not None:
                    self._add(t.names, step, "grad", self._seq + t.index, grad)

    def _add(self, names: RecordNames, step: int, phase: str, seq: int, tensor: torch.Tensor) -> None:
        if is_dtensor(tensor):
            error = self._dtensors.add(names, step, phase, seq, tensor)
        else:
            error = self._rows.add_named(names, step, phase, seq, tensor)
        if error is not None:
            self._warn(names.name, phase, error)

    def _holds(self, optimizer: torch.optim.Optimizer) -> tuple[Tracked, ...]:
        """The model's parameters ``optimizer`` holds, cached until its parameter groups change."""
        signature = tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)
        cached = self._holding.get(optimizer)
        if cached is not None and cached[0] == signature:
            return cached[1]
        assert self._source is not None
        tracked = self._source.holds(optimizer)
        self._holding[optimizer] = (signature, tracked)
        return tracked

    def _guarded(self, step: int | None, work: Callable[[], None]) -> None:
        """``work``; should it raise, one warning and an "unsupported" record: a probe never stops training."""
        try:
            work()
        except DumpWriteError:
            raise  # the dump's own errors reach the training thread, as everywhere
        except Exception as error:
            reason = failure_reason(error)
            if not self._failed_once:
                self._failed_once = True
                warnings.warn(f"probes: recording parameters ({self._phase}) raised: {reason}. Training goes on; "
                              f"the step's records say so (\"{FAILED}\"). This warning is not repeated.",
                              ProbeFailureWarning, stacklevel=4)
            if step is not None and step == self._pending:
                self._rows.add_unsupported_named(RecordNames(FAILED, 0, ROOT_NAME, "", KIND, 0, FAILED, None), step, self._phase,
                                                 self._next_seq, None, f"probe failed: {reason}")
                self._next_seq += 1
