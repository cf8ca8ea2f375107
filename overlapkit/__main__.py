"""``python -m overlapkit``: the same as the ``overlapkit`` command."""

import sys

from overlapkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
