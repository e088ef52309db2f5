"""What both trainer callbacks do, whatever the trainer: build, subscribe, pause, map steps, finish.

    recording = TrainerRecording.of("out", config=None, options={"every_n_steps": 50}, owner="ProbesCallback")
    recording.start(model)            # train begin: subscribe, paused (sanity checks, evaluation)
    recording.resume()                # a training micro-batch begins
    recording.pause()                 # it ended (Lightning: before validation may run)
    recording.update_done(trainer_step=3, epoch=0.75)   # the optimizer ran: pause, map the steps
    recording.stop()                  # train end, or an exception: unsubscribe, the dump is complete

``RecordingCallback`` is the part both ``ProbesCallback`` classes share: their arguments and what they show.

The stages of a run: the options are checked when the callback is made (``probes.config``: a bad
option or file fails before the trainer starts); the subscribers are built at train begin, once the
process knows its rank; between a trainer's training micro-batches the subscription is paused, so its
evaluation forwards are neither recorded nor counted as steps; each optimizer update appends the
trainer's step for the probes steps it consumed to the dump (``probes.dump.trainer_steps``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Mapping

import torch

from ..config import ENV_VAR, ConfigError, ProbesConfig, env_config, load_config, options_config
from ..core import SubscriberBase, SubscriberManager
from ..dump.trainer_steps import TrainerStep, TrainerStepLog
from ..stats import StatisticsSubscriber


class TrainerRecording:
    """One callback's subscription; see the module docstring."""

    def __init__(self, config: ProbesConfig | None, *, owner: str) -> None:
        self.config = config
        self.owner = owner
        # Made at train begin: a subscription is not picklable, and Lightning's spawn strategies pickle callbacks.
        self.manager: SubscriberManager | None = None
        self.subscribers: tuple[SubscriberBase, ...] = ()
        self._logs: list[TrainerStepLog] = []
        self._unmapped = 0  # the first probes step not yet given a trainer step
        self._running = False

    @classmethod
    def of(cls, output_dir: str | os.PathLike | None, *, config: str | os.PathLike | None,
           options: Mapping[str, Any], owner: str) -> "TrainerRecording":
        """Options in code, else ``config``, else the file ``PROBES_CONFIG`` names, else nothing to record."""
        if output_dir is not None or options:
            if config is not None:
                raise ConfigError(owner, "config", "give either config= or the options in code, not both")
            if output_dir is None:
                raise ConfigError(owner, "output_dir", f"is required with options: {owner}('out', ...)")
            return cls(options_config({"output_dir": output_dir, **options}, source=owner), owner=owner)
        if config is not None:
            return cls(load_config(config), owner=owner)
        return cls(env_config(), owner=owner)

    def start(self, model: torch.nn.Module | None) -> None:
        """Build the subscribers and subscribe ``model`` (wrapped or not), paused."""
        self.stop()
        if self.config is None:
            warnings.warn(f"{self.owner} was given no options and {ENV_VAR} is not set: nothing is recorded",
                          stacklevel=3)
            return
        subscribers = self.config.build()
        if not subscribers:  # the config says enabled: false
            return
        if model is None:
            raise ValueError(f"{self.owner}: the trainer gave no model to subscribe")
        self.subscribers = tuple(subscribers)
        self.manager = SubscriberManager()
        self._logs = [TrainerStepLog(s.output_dir, rank=s.rank) for s in subscribers
                      if isinstance(s, StatisticsSubscriber)]
        for log in self._logs:
            log.clear()  # the writer accepted the directory (new, or override_output_dir): a new run
        self.manager.subscribe(model, list(subscribers))
        self.manager.pause()
        self._unmapped = self.manager.step
        self._running = True

    def resume(self) -> None:
        if self._running and self.manager is not None:
            self.manager.resume()

    def pause(self) -> None:
        if self._running and self.manager is not None:
            self.manager.pause()

    def update_done(self, *, trainer_step: int | None, epoch: float | None = None) -> None:
        """The optimizer ran (the trainer's count is now ``trainer_step``): the probes steps since the last
        update are its micro-batches."""
        if not self._running or self.manager is None:
            return
        self.manager.pause()
        self._map(trainer_step, epoch)

    def stop(self) -> None:
        """Unsubscribe; steps that no update followed are mapped to ``trainer_step`` None."""
        if not self._running or self.manager is None:
            return
        self._running = False
        try:
            self.manager.unsubscribe()
        finally:
            self._map(None, None)
            self._logs = []
            self.subscribers = ()

    def _map(self, trainer_step: int | None, epoch: float | None) -> None:
        assert self.manager is not None
        steps = range(self._unmapped, self.manager.step)
        self._unmapped = self.manager.step
        entries = [TrainerStep(step=step, trainer_step=trainer_step, micro_step=index, epoch=epoch)
                   for index, step in enumerate(steps)]
        for log in self._logs:
            log.append(entries)



class RecordingCallback:
    """What both callbacks take and show: ``ProbesCallback("out", **options)``, ``config=``, ``PROBES_CONFIG``.

    ``manager`` is the ``SubscriberManager`` of the run (None before it begins), ``subscribers`` what it
    built (empty outside training).
    """

    def __init__(self, output_dir: str | os.PathLike | None = None, *, config: str | os.PathLike | None = None,
                 **options: Any) -> None:
        self._recording = TrainerRecording.of(output_dir, config=config, options=options, owner="ProbesCallback")

    @property
    def manager(self) -> SubscriberManager | None:
        return self._recording.manager

    @property
    def subscribers(self) -> tuple[SubscriberBase, ...]:
        return self._recording.subscribers
