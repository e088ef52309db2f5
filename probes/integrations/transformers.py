"""The probes as a Hugging Face ``Trainer`` callback.

    from probes.integrations.transformers import ProbesCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ProbesCallback("probes_out", every_n_steps=50)])
    trainer.train()            # then: probes show probes_out

What it records, whatever wraps the model (DDP, DeepSpeed, ``torch_compile=True``): the model the
Trainer trains, subscribed at train begin and unsubscribed at train end. A probes step is one
micro-batch (forward and backward), as in a plain loop; ``<dump>/rank_<r>/trainer_steps.jsonl`` maps
each to the Trainer's ``global_step`` after its update (``probes.dump.trainer_steps``). Evaluation and
prediction forwards run between training steps, while the subscription is paused: they are not
recorded and not counted. Options are ``StatisticsSubscriber``'s (``probes.config`` checks them when
the callback is made), or ``config="probes.yaml"``, or with neither the file ``PROBES_CONFIG`` names.
docs/transformers.md has a worked example.
"""

from __future__ import annotations

from transformers import TrainerCallback

from ._recording import RecordingCallback

__all__ = ["ProbesCallback"]


class ProbesCallback(RecordingCallback, TrainerCallback):
    """``Trainer(..., callbacks=[ProbesCallback("out", every_n_steps=50)])``; see the module docstring
    (options, ``manager`` and ``subscribers``: ``RecordingCallback``)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._recording.start(model)

    def on_step_begin(self, args, state, control, **kwargs):
        self._recording.resume()

    def on_step_end(self, args, state, control, **kwargs):
        self._recording.update_done(trainer_step=state.global_step, epoch=state.epoch)

    def on_train_end(self, args, state, control, **kwargs):
        self._recording.stop()
