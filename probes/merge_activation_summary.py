"""``python -m probes.merge_activation_summary``, the original onnxruntime tool's name (same flags).

The tool lives in ``probes.compare.merge``; ``python -m probes merge`` runs it too.
"""

import sys

from .compare.merge import MergeConfig, generate_summaries_per_step, main

__all__ = ["MergeConfig", "generate_summaries_per_step", "main"]

if __name__ == "__main__":
    sys.exit(main())
