"""Run the mixed precision (GradScaler) and global clipping benchmark and print a table.

    python benchmarks/mixed_precision.py [--quick] [--rounds N] [--json] [--plot FILE.png]

The same as `overlapkit bench --only mixed_precision`: the figures in docs/benchmarks.md.
"""

import sys

from overlapkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "mixed_precision", *sys.argv[1:]]))
