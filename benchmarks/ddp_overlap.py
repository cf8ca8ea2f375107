"""Run the DDP allreduce-then-step benchmark and print a table.

    python benchmarks/ddp_overlap.py [--quick] [--rounds N] [--json] [--plot FILE.png]

The same as `overlapkit bench --only overlap_ddp`: the figures in docs/benchmarks.md.
"""

import sys

from overlapkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "overlap_ddp", *sys.argv[1:]]))
