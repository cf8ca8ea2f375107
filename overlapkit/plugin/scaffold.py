"""``overlapkit new-plugin``: the files of a complete, installable plugin package.

What is written works as it is — ``pip install -e .[test]`` then ``pytest`` passes,
because the generated test calls the conformance checks on a minimal implementation
that conforms — so an author starts from something green and changes it. One kind per
extension point a user sees: an overlapped optimizer, a model averager, a comm hook.
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path
from textwrap import dedent

from overlapkit.errors import ConfigurationError

__all__ = ["KINDS", "overlapkit_requirement", "plugin_files", "write_plugin"]

#: what ``--kind`` may be
KINDS = ("optimizer", "averager", "comm-hook")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _check_name(name: str) -> str:
    normalized = name.strip().lower().replace("-", "_")
    if not _NAME.match(normalized) or keyword.iskeyword(normalized):
        raise ConfigurationError(
            f"plugin name {name!r} must be a word of lower-case letters, digits and "
            "underscores (or dashes) starting with a letter, e.g. 'my_sgd'."
        )
    return normalized


def _pyproject(name: str, module: str, kind: str) -> str:
    return dedent(f'''\
        [build-system]
        requires = ["setuptools>=77"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "overlapkit-{name.replace("_", "-")}"
        version = "0.1.0"
        description = "An overlapkit {kind} plugin."
        requires-python = ">=3.10"
        license = "BSD-3-Clause"
        # torch pinned as overlapkit pins it: another pin downloads the CUDA builds
        dependencies = ["overlapkit>=0.1", "torch==2.13.0"]

        [project.optional-dependencies]
        test = ["pytest>=8", "pytest-timeout>=2.3"]

        # The line that makes this package an overlapkit plugin.
        [project.entry-points.overlapkit]
        {name} = "{module}.plugin"

        [tool.setuptools.packages.find]
        where = ["src"]

        [tool.pytest.ini_options]
        testpaths = ["tests"]
        timeout = 300
        ''')


def overlapkit_requirement() -> str:
    """The requirement that installs the overlapkit this scaffold comes from.

    overlapkit is installed from a checkout (no package index has it yet), so the
    plugin's ``tox.ini`` names the same source: the folder or wheel pip recorded in
    ``direct_url.json`` (PEP 610) when overlapkit was installed; the released version
    otherwise.
    """
    import json

    import importlib_metadata

    try:
        distribution = importlib_metadata.distribution("overlapkit")
    except importlib_metadata.PackageNotFoundError:
        return "overlapkit"
    recorded = distribution.read_text("direct_url.json")
    url = json.loads(recorded).get("url", "") if recorded else ""
    if url.startswith("file://"):
        return f"overlapkit @ {url}"
    return f"overlapkit=={distribution.version}"


def _tox(requirement: str) -> str:
    # tox installs deps before the package, so the package's own "overlapkit>=0.1"
    # is already met by the source named here
    return dedent(f'''\
        [tox]
        env_list = py311

        [testenv]
        description = the plugin's tests, installed as users install it
        deps =
            torch==2.13.0
            {requirement}
        extras = test
        commands = pytest -q {{posargs}}
        ''')


def _optimizer_files(name: str, module: str, cls: str) -> dict[str, str]:
    plugin = dedent(f'''\
        """The overlapkit plugin: ``{cls}`` buckets are stepped by ``{cls}Overlapped``."""

        from __future__ import annotations

        from collections.abc import Sequence

        import torch

        import overlapkit
        from overlapkit.plugin import OptimizerRecord, OverlapEngine, ParamGroup


        class {cls}(torch.optim.Optimizer):
            """Plain SGD (``p -= lr * grad``): replace it with your optimizer."""

            def __init__(self, params, lr: float = 0.01) -> None:
                if lr <= 0:
                    raise ValueError(f"lr must be positive, got {{lr}}")
                super().__init__(params, {{"lr": lr}})

            @torch.no_grad()
            def step(self, closure=None):
                loss = None if closure is None else closure()
                for group in self.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            param.add_(param.grad, alpha=-group["lr"])
                return loss


        class {cls}Overlapped(OverlapEngine):
            """Steps exactly the given parameters of one DDP bucket, with the same
            arithmetic as {cls}.step() (the conformance check compares them bitwise)."""

            def step_groups(self, groups: Sequence[tuple[ParamGroup, list[torch.Tensor]]]
                            ) -> None:
                with torch.no_grad():
                    for group, params in groups:
                        for param in params:
                            param.add_(param.grad, alpha=-group["lr"])


        @overlapkit.hookimpl
        def overlapkit_register_optimizers() -> OptimizerRecord:
            return OptimizerRecord(optim_cls={cls}, overlapped_cls={cls}Overlapped,
                                   description="{cls}: one bucket at a time")
        ''')
    test = dedent(f'''\
        """The overlapkit conformance check: overlap_ddp with {cls} equals {cls}.step()."""

        from overlapkit.testing import check_overlapped_optimizer
        from {module}.plugin import {cls}


        def test_{name}_conforms() -> None:
            check_overlapped_optimizer({cls}, {{"lr": 0.05}})
        ''')
    return {f"src/{module}/plugin.py": plugin, f"tests/test_{name}.py": test}


def _averager_files(name: str, module: str, cls: str) -> dict[str, str]:
    plugin = dedent(f'''\
        """The overlapkit plugin: the averager ``{name}``."""

        from __future__ import annotations

        import overlapkit
        from overlapkit.plugin import AveragerRecord, PeriodicAverager


        class {cls}Averager(PeriodicAverager):
            """Averages every ``period`` steps after warm-up: override ``average(params,
            group)`` to change what averaging means (an outer optimizer, ...)."""


        @overlapkit.hookimpl
        def overlapkit_register_averagers() -> AveragerRecord:
            return AveragerRecord(name="{name}", build={cls}Averager,
                                  description="periodic averaging, as a starting point")
        ''')
    test = dedent(f'''\
        """The overlapkit conformance check: exact averaging in the documented limit."""

        from overlapkit.testing import check_averager


        def test_{name}_conforms() -> None:
            check_averager("{name}", {{"period": 2, "warmup_steps": 1}})
        ''')
    return {f"src/{module}/plugin.py": plugin, f"tests/test_{name}.py": test}


def _comm_hook_files(name: str, module: str, cls: str) -> dict[str, str]:
    plugin = dedent(f'''\
        """The overlapkit plugin: the DDP comm hook ``{name}``."""

        from __future__ import annotations

        from typing import Any

        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        import overlapkit
        from overlapkit.plugin import CommHookRecord


        def build(*, process_group: Any = None) -> tuple[Any, Any]:
            """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``: DDP's
            own averaging allreduce, as a starting point."""
            return process_group, default_hooks.allreduce_hook


        @overlapkit.hookimpl
        def overlapkit_register_comm_hooks() -> CommHookRecord:
            return CommHookRecord(name="{name}", build=build,
                                  description="allreduce, as a starting point")
        ''')
    test = dedent(f'''\
        """The overlapkit conformance check: DDP with the hook matches its reference."""

        from overlapkit.testing import check_comm_hook


        def test_{name}_conforms() -> None:
            check_comm_hook("{name}", tolerance=0.0)
        ''')
    return {f"src/{module}/plugin.py": plugin, f"tests/test_{name}.py": test}


def plugin_files(name: str, kind: str = "optimizer") -> dict[str, str]:
    """Path (relative to the package folder) -> content, for a plugin called ``name``.

    :raises ConfigurationError: a name that is not a Python identifier-like word, or an
        unknown kind.
    """
    name = _check_name(name)
    if kind not in KINDS:
        raise ConfigurationError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}.")
    module = f"overlapkit_{name}"
    cls = "".join(part.capitalize() for part in name.split("_"))
    make = {"optimizer": _optimizer_files, "averager": _averager_files,
            "comm-hook": _comm_hook_files}[kind]
    files = {
        "pyproject.toml": _pyproject(name, module, kind),
        "tox.ini": _tox(overlapkit_requirement()),
        "README.md": f"# overlapkit-{name.replace('_', '-')}\n\nAn overlapkit {kind} plugin. "
                     "Install it with `pip install -e .[test]`, test it with `pytest` (or "
                     "`tox`); `overlapkit plugins` lists it once installed.\n",
        f"src/{module}/__init__.py": f'"""The overlapkit plugin package {module}."""\n',
    }
    files.update(make(name, module, cls))
    return files


def write_plugin(directory: Path, name: str, kind: str = "optimizer") -> list[Path]:
    """Write the package into ``directory`` (created; must not exist or be empty).

    :raises ConfigurationError: ``directory`` is a non-empty folder or a file.
    """
    files = plugin_files(name, kind)
    if directory.exists() and (directory.is_file() or any(directory.iterdir())):
        raise ConfigurationError(
            f"{directory} exists and is not empty; choose a new folder for the plugin.")
    written = []
    for relative, content in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written
