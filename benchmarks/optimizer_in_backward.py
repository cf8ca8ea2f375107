"""Run the optimizer-in-backward benchmark and print a table.

    python benchmarks/optimizer_in_backward.py [--quick] [--rounds N] [--json] [--plot FILE.png]

The same as `overlapkit bench --only optimizer_in_backward`: the figures in docs/benchmarks.md.
"""

import sys

from overlapkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "optimizer_in_backward", *sys.argv[1:]]))
