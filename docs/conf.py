"""Sphinx configuration for the overlapkit docs (built with warnings as errors)."""

project = "overlapkit"
author = "overlapkit maintainers"
# the footer reads "© <copyright>": without it Sphinx writes "©. |"
copyright = "2026, overlapkit maintainers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.intersphinx", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "alabaster"
nitpicky = False
suppress_warnings = ["myst.header"]
