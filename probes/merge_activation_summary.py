"""``python -m probes.merge_activation_summary``, the original onnxruntime tool's name (same flags).

The tool is ``python -m probes merge`` (``probes.cli.merge``); this name is kept for existing scripts.
"""

import sys
from typing import Sequence

from .cli.merge import merge
from .compare.summaries import MergeConfig, generate_summaries_per_step


def main(argv: Sequence[str] | None = None) -> int:
    return merge(argv, prog="python -m probes.merge_activation_summary")


__all__ = ["MergeConfig", "generate_summaries_per_step", "main"]

if __name__ == "__main__":
    sys.exit(main())
