"""``python -m probes {show,compare,merge} ...``: see ``probes.cli``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
