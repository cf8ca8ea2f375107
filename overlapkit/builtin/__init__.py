"""The built-in plugins: each module is a plugin registered before any entry point.

They implement the same hooks third-party plugins do, and can be blocked by name
(``OVERLAPKIT_DISABLE_PLUGINS=overlapkit.comm_hooks``) so a plugin can replace one.
"""
