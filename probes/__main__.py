"""``python -m probes {show,compare,export,tensorboard,merge} ...`` (the ``probes`` command): see ``probes.cli``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
