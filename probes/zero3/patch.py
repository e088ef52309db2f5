"""Make DeepSpeed's ZeRO-3 engines use probes' parameter hooks.

    from probes.zero3 import configure_ort_compatible_zero_stage3
    configure_ort_compatible_zero_stage3()            # before deepspeed.initialize(...)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

After the call, every ZeRO-3 engine DeepSpeed creates installs its parameter hooks through a
``SubscriberManager`` holding a ``ZeROOffloadSubscriber`` (``DeepSpeedZeRoOffload.setup_zero_stage3_hooks``
is replaced; DeepSpeed's code is not modified). ``restore_zero_stage3_hooks()``, the returned
handle's ``remove()``/``restore()`` or leaving ``with configure_ort_compatible_zero_stage3():`` undoes
that for engines created afterwards. Everything that touches DeepSpeed's internals is in
``exporters/adapters/deepspeed_internals.py``.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from exporters.adapters import deepspeed_internals, ort_internals
from exporters.handles import Handle

from ..core import SubscriberBase, SubscriberManager
from ..stats import StatisticsSubscriber
from .ortmodule import prepare_ortmodule_export
from .offload import ZeROOffloadSubscriber


def manager_of(offload: Any) -> SubscriberManager | None:
    """The SubscriberManager holding the ZeRO-3 hooks of ``offload`` (``engine.optimizer.parameter_offload``;
    also its ``probes_manager`` attribute)."""
    manager = deepspeed_internals.attached_manager(offload)
    return manager if isinstance(manager, SubscriberManager) else None


@dataclass
class Zero3Settings:
    """What ``configure_ort_compatible_zero_stage3`` asked for; read when an engine is created."""

    debug: bool = False
    stats_output_dir: str = "./"
    stats_overwrite: bool = False
    stats_options: dict[str, Any] = field(default_factory=dict)  # more StatisticsSubscriber options


class _Configured:
    """The settings of the last ``configure_ort_compatible_zero_stage3`` still in force (None: not configured).
    Process-wide, as the patch is: DeepSpeed's class reads them for every engine created afterwards."""

    settings: Zero3Settings | None = None


_CONFIGURED = _Configured()


def _debug_subscribers(settings: Zero3Settings) -> list[SubscriberBase]:
    if not settings.debug:
        return []

    def create() -> SubscriberBase:
        return StatisticsSubscriber(output_dir=settings.stats_output_dir, override_output_dir=settings.stats_overwrite,
                                    **settings.stats_options)

    # Every rank dumps under the same directory: rank 0 creates it before the others look at it.
    # (Engine creation is collective, so every rank reaches this barrier.)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return [create()]
    rank = torch.distributed.get_rank()
    subscriber = create() if rank == 0 else None
    torch.distributed.barrier()
    return [subscriber if subscriber is not None else create()]


def _setup_zero_stage3_hooks_with_probes(offload: Any) -> None:
    """Replacement for ``DeepSpeedZeRoOffload.setup_zero_stage3_hooks`` (called by its __init__)."""
    settings = _CONFIGURED.settings or Zero3Settings()
    model = deepspeed_internals.offload_root(offload)
    hooks = ZeROOffloadSubscriber(offload)
    manager = SubscriberManager()
    subscription = manager.subscribe(model, [hooks, *_debug_subscribers(settings)])
    # DeepSpeed removes this handle where it removes its own hooks (engine destroy); removed, it is no
    # longer active while the subscription closes, so the subscriber knows the engine let its hooks go.
    hooks.engine_handle = Handle(subscription.remove)
    deepspeed_internals.finish_setup(offload, hooks.engine_handle, manager=manager)
    if ort_internals.is_ortmodule(model):
        prepare_ortmodule_export(model)


class Zero3Patch(Handle):
    """Handle returned by ``configure_ort_compatible_zero_stage3``: ``remove()`` (or ``restore()``, its
    documented name, or leaving a ``with`` block) gives DeepSpeed its own hooks back."""

    def __init__(self, settings: Zero3Settings) -> None:
        super().__init__(self._restore)
        self.settings = settings

    @property
    def active(self) -> bool:
        return _CONFIGURED.settings is self.settings and deepspeed_internals.setup_hooks_replaced()

    def restore(self) -> None:
        self.remove()

    def _restore(self) -> None:
        if self.active:
            restore_zero_stage3_hooks()


def configure_ort_compatible_zero_stage3(debug: bool = False, stats_output_dir: str | os.PathLike = "./",
                                         stats_overwrite: bool = False, *,
                                         stats_options: Mapping[str, Any] | None = None) -> Zero3Patch:
    """Make every DeepSpeed ZeRO-3 engine created from now on use probes' parameter hooks.

    ``debug=True`` also subscribes a ``StatisticsSubscriber`` writing to ``stats_output_dir``
    (each rank under ``rank_<r>/``; ``stats_overwrite`` replaces an earlier dump of the rank), with
    ``stats_options`` (more of its options, e.g. ``{"parameters": True}``: the fp32 master shards' records).
    Engines created before the call keep their hooks. Calling again replaces the settings.

    Raises ImportError when DeepSpeed is not installed, DeepSpeedVersionError when its version is
    outside ``exporters.adapters.deepspeed_internals.SUPPORTED_RANGE``.
    """
    deepspeed_internals.require_deepspeed()
    options = dict(stats_options or {})
    if options and not debug:
        raise ValueError("stats_options are the statistics subscriber's options: give them with debug=True")
    reserved = sorted({"output_dir", "override_output_dir"} & set(options))
    if reserved:
        raise ValueError(f"stats_options may not set {', '.join(reserved)}: use stats_output_dir and stats_overwrite")
    inspect.signature(StatisticsSubscriber).bind(stats_output_dir, **options)  # an unknown option fails here, not at the engine
    settings = Zero3Settings(bool(debug), os.fspath(stats_output_dir), bool(stats_overwrite), options)
    deepspeed_internals.replace_setup_hooks(_setup_zero_stage3_hooks_with_probes)
    _CONFIGURED.settings = settings
    return Zero3Patch(settings)


def restore_zero_stage3_hooks() -> bool:
    """Give DeepSpeed back its own ZeRO-3 hooks for engines created from now on; False if not patched."""
    _CONFIGURED.settings = None
    return deepspeed_internals.restore_setup_hooks()


def is_configured() -> bool:
    """True while DeepSpeed's ZeRO-3 hook setup is replaced by probes'."""
    return deepspeed_internals.setup_hooks_replaced()
