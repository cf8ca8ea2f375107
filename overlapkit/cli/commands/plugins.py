"""``overlapkit plugins [--json]``: what is installed and what it provides."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from overlapkit.cli.textui import DefaultsHelpFormatter, format_table
from overlapkit.plugin.manager import PluginInfo, list_plugins


def _format_provides(info: PluginInfo) -> str:
    parts = [f"techniques: {', '.join(info.techniques)}"] if info.techniques else []
    parts += [f"{kind}: {', '.join(names)}" for kind, names in info.provides.items()]
    return "; ".join(parts) or "-"


def run(args: argparse.Namespace) -> int:
    """Print the plugin table (or JSON)."""
    infos = list_plugins()
    if args.json:
        json.dump([info.to_json() for info in infos], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    rows = [("name", "version", "status", "source", "provides")]
    rows += [
        (i.name, i.version or "-", i.status, i.source, _format_provides(i)) for i in infos
    ]
    print(format_table(rows))
    return 0


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "plugins", help="list installed plugins and what they provide",
        description="List every overlapkit plugin: the built-ins (the techniques "
        "overlap_ddp, optimizer_in_backward, post_local_sgd and checkpoint, and the "
        "standard comm hooks) and those installed from other packages through the "
        "'overlapkit' entry-point group, with version, status (active, blocked, not "
        "loaded) and what each provides. OVERLAPKIT_DISABLE_PLUGINS=a,b blocks plugins "
        "by name, OVERLAPKIT_DISABLE_PLUGIN_AUTOLOAD=1 loads the built-ins only, "
        "OVERLAPKIT_TRACE_PLUGINS=1 traces hook calls.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)
