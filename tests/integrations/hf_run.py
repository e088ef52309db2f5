"""A Hugging Face Trainer run with the probes callback, as a user's script launched by torchrun:
``torchrun --nproc_per_node 2 hf_run.py OUT [deepspeed]`` (DDP over gloo, or a DeepSpeed ZeRO-3 engine)."""

from __future__ import annotations

import sys

import torch
import transformers

from helpers import tiny_gpt2
from probes.integrations.transformers import ProbesCallback
from trainers import examples

if __name__ == "__main__":
    out = sys.argv[1]
    extra = {"gradient_accumulation_steps": 2}
    if sys.argv[2:] == ["deepspeed"]:
        from exporters.adapters import deepspeed_internals

        deepspeed_internals.skip_shm_comm_build()
        extra["deepspeed"] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "zero_optimization": {"stage": 3}}
        # transformers 4.46 enters DeepSpeed's no_sync() between micro-batches, which ZeRO-3 refuses.
        extra["gradient_accumulation_steps"] = 1
    args = transformers.TrainingArguments(
        output_dir=f"{out}_hf", per_device_train_batch_size=2, max_steps=2,
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        ddp_backend="gloo", disable_tqdm=True, seed=0, **extra)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=examples(16),
                                   callbacks=[ProbesCallback(out)])
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double().sum().item()
    print(f"rank {args.process_index} of {args.world_size} wrapped {wrapped} weights {weights:.12e}", flush=True)
    # A gloo group left to the interpreter's exit may abort a rank ("terminate called without an active
    # exception", seen once in a loaded suite): both ranks leave it together.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
