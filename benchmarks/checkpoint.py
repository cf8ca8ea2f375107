"""Checkpoint load time and peak RSS: overlapkit.checkpoint.load vs torch's DCP path.

    python benchmarks/checkpoint.py [--quick] [--rounds N] [--world-size N] [--json]
                                    [--plot FILE.png]

The same as `overlapkit bench --only checkpoint`: the figures in docs/benchmarks.md.
"""

import sys

from overlapkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "checkpoint", *sys.argv[1:]]))
