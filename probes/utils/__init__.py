"""The tool shelf under every room of probes: argument checks, pytree tensor leaves, text tables, the
interpreter-exit sequence. Imports nothing of probes.

    from probes.utils import check_int, TensorLeaves, text_table, at_exit
"""

from .checks import check_int
from .exit import at_exit
from .tables import printable, text_table
from .tree import TensorLeaves

__all__ = ["TensorLeaves", "at_exit", "check_int", "printable", "text_table"]
