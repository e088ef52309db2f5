"""Trainer integrations: the probes as a callback of the trainer a user already has.

    from probes.integrations.transformers import ProbesCallback     # Hugging Face Trainer
    from probes.integrations.lightning import ProbesCallback        # Lightning

Each submodule imports its trainer library; this package imports neither.
"""

__all__: list[str] = []
