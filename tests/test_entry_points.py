"""Real entry points: tiny plugin distributions on PYTHONPATH of a fresh interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
from plugin_dists import make_plugin_dist, plugins_json, run_python

HOOK_PLUGIN = """
    from overlapkit import hookimpl, CommHookRecord

    def build(*, process_group=None, **options):
        return process_group, lambda state, bucket: None

    @hookimpl
    def overlapkit_register_comm_hooks():
        return CommHookRecord(name="{hook}", build=build, description="from {dist}")
"""


def _hook_dist(root: Path, dist: str, module: str, hook: str, ep: str = "demo") -> Path:
    return make_plugin_dist(
        root, dist=dist, version="1.2.3", entry_points={ep: module},
        modules={module: HOOK_PLUGIN.format(hook=hook, dist=dist)},
    )


def test_installed_plugin_is_listed_with_its_distribution(tmp_path: Path) -> None:
    path = _hook_dist(tmp_path, "overlapkit-demo", "demo_plugin", "demo_hook")
    listed = {p["name"]: p for p in plugins_json(path)}
    assert listed["demo"]["distribution"] == "overlapkit-demo"
    assert listed["demo"]["version"] == "1.2.3"
    assert listed["demo"]["status"] == "active"
    assert listed["demo"]["provides"] == {"comm_hooks": ["demo_hook"]}
    assert listed["overlapkit.comm_hooks"]["source"] == "builtin"


def test_installed_plugin_is_used_by_name(tmp_path: Path) -> None:
    path = _hook_dist(tmp_path, "overlapkit-demo", "demo_plugin", "demo_hook")
    proc = run_python(
        """
        import overlapkit
        state, hook = overlapkit.build_comm_hook("demo-hook", process_group="pg")
        print(state, hook.__module__)
        """,
        path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["pg", "demo_plugin"]


@pytest.mark.parametrize(
    ("env", "status"),
    [
        ({"OVERLAPKIT_DISABLE_PLUGINS": "other, demo"}, "blocked"),
        ({"OVERLAPKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}, "not loaded"),
    ],
)
def test_blocked_or_not_autoloaded_plugin_is_never_imported(
    tmp_path: Path, env: dict[str, str], status: str
) -> None:
    path = _hook_dist(tmp_path, "overlapkit-demo", "demo_plugin", "demo_hook")
    proc = run_python(
        """
        import sys, overlapkit
        infos = {i.name: i for i in overlapkit.list_plugins()}
        print("imported" if "demo_plugin" in sys.modules else "not imported")
        print(infos["demo"].status)
        try:
            overlapkit.build_comm_hook("demo_hook")
        except overlapkit.UnknownNameError as exc:
            print("unknown:", exc)
        """,
        path, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "not imported"
    assert lines[1] == status
    assert lines[2].startswith("unknown: unknown comm hook 'demo_hook'; valid names: 'allreduce'")


def test_plugin_failing_to_import_names_entry_point_and_distribution(tmp_path: Path) -> None:
    path = make_plugin_dist(
        tmp_path, dist="overlapkit-broken", version="0.3", entry_points={"broken": "broken_plugin"},
        modules={"broken_plugin": "raise RuntimeError('the plugin is broken')\n"},
    )
    proc = run_python(
        """
        import overlapkit
        try:
            overlapkit.list_plugins()
        except overlapkit.PluginLoadError as exc:
            assert isinstance(exc, ImportError)
            print(exc)
            print(type(exc.__cause__).__name__, exc.__cause__)
        """,
        path,
    )
    assert proc.returncode == 0, proc.stderr
    message, cause = proc.stdout.splitlines()
    assert "'broken'" in message and "overlapkit-broken 0.3" in message
    assert "the plugin is broken" in message
    assert "OVERLAPKIT_DISABLE_PLUGINS=broken" in message
    assert cause == "RuntimeError the plugin is broken"


def test_cli_reports_a_broken_plugin_in_one_line(tmp_path: Path) -> None:
    path = make_plugin_dist(
        tmp_path, dist="overlapkit-broken", entry_points={"broken": "broken_plugin"},
        modules={"broken_plugin": "import does_not_exist\n"},
    )
    proc = run_python(
        "import sys; from overlapkit.cli import main; sys.exit(main(['plugins']))", path
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("overlapkit: error: error importing overlapkit plugin 'broken'")


@pytest.mark.parametrize("code", ["2", "'usage: plugin.py [-h]'"])
def test_a_plugin_calling_sys_exit_as_it_is_imported_is_named(tmp_path: Path,
                                                               code: str) -> None:
    # be7423f: the process ended at the first set-up with the module's exit code (and
    # its message, if any), nothing naming the plugin or its distribution
    path = make_plugin_dist(
        tmp_path, dist="overlapkit-exits", entry_points={"exits": "exits_plugin"},
        modules={"exits_plugin": f"import sys\nsys.exit({code})\n"},
    )
    proc = run_python(
        """
        import overlapkit
        try:
            overlapkit.build_comm_hook("allreduce")
        except overlapkit.PluginLoadError as exc:
            print(exc)
        """, path)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert "'exits'" in proc.stdout and "overlapkit-exits 1.0.0" in proc.stdout
    assert "SystemExit(" in proc.stdout and "sys.exit()" in proc.stdout
    assert "OVERLAPKIT_DISABLE_PLUGINS=exits" in proc.stdout
    cli = run_python(
        "import sys; from overlapkit.cli import main; sys.exit(main(['plugins']))", path)
    assert cli.returncode == 2
    assert cli.stderr.strip().splitlines()[-1].startswith(
        "overlapkit: error: error importing overlapkit plugin 'exits'")


def test_blocking_a_broken_plugin_lets_the_rest_load(tmp_path: Path) -> None:
    path = make_plugin_dist(
        tmp_path, dist="overlapkit-broken", entry_points={"broken": "broken_plugin"},
        modules={"broken_plugin": "import does_not_exist\n"},
    )
    listed = plugins_json(path, env={"OVERLAPKIT_DISABLE_PLUGINS": "broken"})
    assert {p["name"]: p["status"] for p in listed}["broken"] == "blocked"


def test_two_plugins_providing_one_name_fail_naming_both(tmp_path: Path) -> None:
    path = _hook_dist(tmp_path / "a", "overlapkit-a", "plugin_a", "shared", ep="alpha")
    other = _hook_dist(tmp_path / "b", "overlapkit-b", "plugin_b", "shared", ep="beta")
    proc = run_python(
        """
        import overlapkit
        try:
            overlapkit.build_comm_hook("shared")
        except overlapkit.PluginConflictError as exc:
            print(exc)
        """,
        path, other,
    )
    assert proc.returncode == 0, proc.stderr
    assert "comm hook 'shared' is provided by two plugins" in proc.stdout
    assert "'alpha'" in proc.stdout and "'beta'" in proc.stdout


def test_plugin_can_replace_a_blocked_builtin(tmp_path: Path) -> None:
    path = _hook_dist(tmp_path, "overlapkit-myreduce", "my_reduce", "allreduce")
    proc = run_python(
        """
        import overlapkit
        state, hook = overlapkit.build_comm_hook("allreduce")
        print(hook.__module__)
        """,
        path, env={"OVERLAPKIT_DISABLE_PLUGINS": "overlapkit.comm_hooks"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "my_reduce"


def test_trace_shows_hook_calls_on_stderr(tmp_path: Path) -> None:
    path = _hook_dist(tmp_path, "overlapkit-demo", "demo_plugin", "demo_hook")
    proc = run_python(
        "import overlapkit; overlapkit.build_comm_hook('demo_hook')",
        path, env={"OVERLAPKIT_TRACE_PLUGINS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "overlapkit_register_comm_hooks" in proc.stderr


def test_misspelled_hook_is_rejected(tmp_path: Path) -> None:
    path = make_plugin_dist(
        tmp_path, dist="overlapkit-typo", entry_points={"typo": "typo_plugin"},
        modules={"typo_plugin": """
            from overlapkit import hookimpl

            @hookimpl
            def overlapkit_register_optimisers():
                return []
        """},
    )
    proc = run_python(
        """
        import overlapkit
        try:
            overlapkit.list_plugins()
        except overlapkit.PluginValidationError as exc:
            print(exc)
        """,
        path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "overlapkit_register_optimisers" in proc.stdout and "'typo'" in proc.stdout


def test_two_distributions_with_one_entry_point_name_fail_naming_both(tmp_path: Path) -> None:
    first = _hook_dist(tmp_path / "a", "overlapkit-first", "first_plugin", "one", ep="same")
    second = _hook_dist(tmp_path / "b", "overlapkit-second", "second_plugin", "two", ep="same")
    proc = run_python(
        """
        import overlapkit
        try:
            overlapkit.build_comm_hook("one")
        except overlapkit.PluginConflictError as exc:
            print(exc)
        """,
        first, second,
    )
    assert proc.returncode == 0, proc.stderr
    assert "two installed distributions register an overlapkit plugin named 'same'" in (
        proc.stdout)
    assert "overlapkit-first" in proc.stdout and "overlapkit-second" in proc.stdout


def test_one_distribution_found_twice_is_loaded_once(tmp_path: Path) -> None:
    path = _hook_dist(tmp_path, "overlapkit-twice", "twice_plugin", "twice_hook", ep="twice")
    listed = plugins_json(path, path)
    assert [p["name"] for p in listed].count("twice") == 1


def test_an_entry_point_named_like_a_builtin_is_refused_keeping_the_builtin(
        tmp_path: Path) -> None:
    path = _hook_dist(tmp_path, "overlapkit-impostor", "impostor", "extra",
                      ep="overlapkit.comm_hooks")
    proc = run_python(
        "import sys; from overlapkit.cli import main; sys.exit(main(['plugins']))", path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert "has the name of a built-in overlapkit plugin" in message
    assert "overlapkit-impostor" in message and "Rename the entry point" in message
    assert "OVERLAPKIT_DISABLE_PLUGINS" not in message


def test_a_hook_that_raises_is_one_line_naming_plugin_distribution_and_hook(
        tmp_path: Path) -> None:
    path = make_plugin_dist(
        tmp_path, dist="overlapkit-raises", entry_points={"raises": "raises_plugin"},
        modules={"raises_plugin": """
            import overlapkit

            @overlapkit.hookimpl
            def overlapkit_register_averagers():
                raise RuntimeError("config file missing")
            """},
    )
    proc = run_python(
        "import sys; from overlapkit.cli import main; sys.exit(main(['plugins']))", path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert "'raises'" in message and "overlapkit-raises" in message
    assert "overlapkit_register_averagers" in message and "config file missing" in message


def test_one_module_under_two_entry_point_names_is_one_line_naming_both(
        tmp_path: Path) -> None:
    # 968cf42: pluggy's bare "ValueError: Plugin already registered under a different
    # name", a traceback (a distribution keeping an old entry point beside a new one)
    path = make_plugin_dist(
        tmp_path, dist="overlapkit-renamed", entry_points={"old": "shared", "new": "shared"},
        modules={"shared": HOOK_PLUGIN.format(hook="h1", dist="overlapkit-renamed")})
    proc = run_python(
        "import sys; from overlapkit.cli import main; sys.exit(main(['plugins']))", path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert "the plugin 'shared' is registered twice, as 'old' and as 'new'" in message


def test_one_plugin_returning_a_name_twice_is_named_as_one_plugin(tmp_path: Path) -> None:
    # 968cf42: "comm hook 'h1' is provided by two plugins: 'dup' and 'dup'"
    path = make_plugin_dist(
        tmp_path, dist="overlapkit-dup", entry_points={"dup": "dup_plugin"},
        modules={"dup_plugin": """
            from overlapkit import hookimpl, CommHookRecord

            def build(*, process_group=None, **options):
                return process_group, lambda state, bucket: None

            @hookimpl
            def overlapkit_register_comm_hooks():
                return [CommHookRecord(name="h1", build=build),
                        CommHookRecord(name="h1", build=build)]
            """})
    proc = run_python(
        "import sys; from overlapkit.cli import main; sys.exit(main(['plugins']))", path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert "plugin 'dup' returns two comm hooks named 'h1'" in message
