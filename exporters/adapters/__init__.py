"""Adapters over the private internals of torch, onnxruntime-training and DeepSpeed: the one place each private
name is used, each with a version check and an error that says what changed and what to do.

Every floor uses them (probes' core, stats and zero3 as much as the exporters), so they sit at the bottom, in
the package that imports nothing of ``probes``.

    from exporters.adapters import torch_internals, ort_internals, deepspeed_internals
    if ort_internals.is_exporting(): ...
"""
