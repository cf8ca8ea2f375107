"""Run the sharded-optimizer-state benchmark and print a table.

    python benchmarks/sharded_state.py [--quick] [--rounds N] [--json] [--plot FILE.png]

The same as `overlapkit bench --only sharded_state`: the figures in docs/benchmarks.md.
"""

import sys

from overlapkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "sharded_state", *sys.argv[1:]]))
