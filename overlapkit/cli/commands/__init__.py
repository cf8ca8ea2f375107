"""The subcommands of the ``overlapkit`` command line, one module each.

Each module defines ``register(commands)``, which adds its parser to the subparsers
action and sets ``func`` to a function ``(args) -> int`` (the exit status).
"""

#: modules under overlapkit.cli.commands, in the order ``overlapkit --help`` lists them
COMMAND_MODULES: tuple[str, ...] = ("plugins", "new_plugin", "demo", "bench", "checkpoint")
