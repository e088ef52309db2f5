"""The probes as a Lightning callback.

    from probes.integrations.lightning import ProbesCallback
    trainer = lightning.pytorch.Trainer(max_epochs=1, callbacks=[ProbesCallback("probes_out", every_n_steps=50)])
    trainer.fit(module, data)  # then: probes show probes_out

What it records: the ``LightningModule`` being fitted (names relative to it: ``net.0.output.0``), on
every strategy (one process, DDP), subscribed when fitting sets up and unsubscribed when it ends or
raises. A probes step is one training batch (forward and backward), so with
``accumulate_grad_batches=k`` an update is k probes steps; ``<dump>/rank_<r>/trainer_steps.jsonl`` maps
each to ``trainer.global_step`` after its update (``probes.dump.trainer_steps``). The sanity check and
validation run while the subscription is paused: not recorded, not counted. Options as for the Hugging
Face callback (``probes.integrations.transformers``); docs/lightning.md has a worked example.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from ._recording import RecordingCallback

__all__ = ["ProbesCallback"]


class ProbesCallback(RecordingCallback, Callback):
    """``Trainer(..., callbacks=[ProbesCallback("out", every_n_steps=50)])``; see the module docstring
    (options, ``manager`` and ``subscribers``: ``RecordingCallback``)."""

    def on_fit_start(self, trainer, pl_module):
        self._updates = trainer.global_step  # when the last update was mapped
        self._recording.start(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._recording.resume()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self._updates:  # the optimizer ran in this batch
            self._updates = trainer.global_step
            self._recording.update_done(trainer_step=trainer.global_step, epoch=trainer.current_epoch)
        else:  # a micro-batch of an update still accumulating; validation may run before the next
            self._recording.pause()

    def on_fit_end(self, trainer, pl_module):
        self._recording.stop()

    def on_exception(self, trainer, pl_module, exception):
        self._recording.stop()
