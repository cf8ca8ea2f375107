"""Run the engine-overhead benchmark (1 to 400 DDP buckets, 1 and 2 ranks) and print a table.

    python benchmarks/engine_overhead.py [--quick] [--rounds N] [--json] [--plot FILE.png]

The same as `overlapkit bench --only engine_overhead`: the figures in docs/benchmarks.md.
"""

import sys

from overlapkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "engine_overhead", *sys.argv[1:]]))
