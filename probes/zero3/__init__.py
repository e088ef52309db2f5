"""DeepSpeed ZeRO stage 3 parameter hooks as probes: the same Python in eager PyTorch and in ORTModule.

    from probes.zero3 import configure_ort_compatible_zero_stage3
    configure_ort_compatible_zero_stage3()            # before deepspeed.initialize(...)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

Rooms: ``functions`` (the gather/release autograd Functions), ``subscriber`` (ZeROOffloadSubscriber),
``patch`` (configure/restore: DeepSpeed's hook setup replaced), ``ort`` (ORTModule export of such models).
See docs/zero3.md.
"""

from .patch import configure_ort_compatible_zero_stage3, restore_zero_stage3_hooks
from .offload import DeepCopiedModuleError, ZeROOffloadSubscriber

__all__ = [
    "DeepCopiedModuleError", "ZeROOffloadSubscriber", "configure_ort_compatible_zero_stage3",
    "restore_zero_stage3_hooks",
]
