"""The tool shelf under every room of probes: argument checks, options declared once as dataclass fields (keywords,
flags, help, checks), pytree tensor leaves, text tables, the interpreter-exit sequence. Imports nothing of probes.

    from probes.utils import check_int, TensorLeaves, text_table, at_exit
"""


__all__: list[str] = []
