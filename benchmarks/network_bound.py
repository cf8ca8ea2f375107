"""Run the network-bound benchmark (a simulated link at several speeds) and print a table.

    python benchmarks/network_bound.py [--quick] [--rounds N] [--json] [--plot FILE.png]

The same as `overlapkit bench --only network_bound`: the figures in docs/benchmarks.md.
"""

import sys

from overlapkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "network_bound", *sys.argv[1:]]))
