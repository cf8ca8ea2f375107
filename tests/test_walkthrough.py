"""The plugin author's walkthrough in docs/plugins.rst is true: the files it shows are
the ones ``overlapkit new-plugin`` writes, in full, and its commands, run exactly as
written in a new virtual environment, give a package whose conformance test passes."""

from __future__ import annotations

import os
import re
import site
import subprocess
import venv
from pathlib import Path

from overlapkit.plugin.scaffold import overlapkit_requirement, plugin_files

DOCS = Path(__file__).parent.parent / "docs" / "plugins.rst"
PACKAGE = "overlapkit-my-sgd"


def _code_blocks() -> dict[str, str]:
    """caption -> the dedented body of every ``.. code-block::`` with a caption."""
    blocks: dict[str, str] = {}
    pattern = re.compile(
        r"^\.\. code-block:: \w+\n    :caption: (?P<caption>[^\n]+)\n\n"
        r"(?P<body>(?:    [^\n]*\n|\n)+)", re.MULTILINE)
    for match in pattern.finditer(DOCS.read_text()):
        lines = match["body"].rstrip("\n").split("\n")
        blocks[match["caption"]] = "\n".join(line[4:] for line in lines) + "\n"
    return blocks


def test_the_docs_show_every_generated_file_in_full() -> None:
    shown = {caption.removeprefix(f"{PACKAGE}/"): body
             for caption, body in _code_blocks().items() if caption.startswith(PACKAGE)}
    written = plugin_files("my_sgd")
    written["tox.ini"] = written["tox.ini"].replace(
        overlapkit_requirement(), "overlapkit @ file:///path/to/your/overlapkit")
    code = {path for path in written if not path.endswith(("README.md", "__init__.py"))}
    assert set(shown) == code
    for path in code:
        assert shown[path] == written[path], f"docs/plugins.rst shows another {path}"


def test_the_walkthrough_commands_work_as_written_in_a_new_venv(tmp_path: Path) -> None:
    commands = [line.removeprefix("$ ") for line in
                _code_blocks()["the walkthrough, command by command"].splitlines()
                if line.startswith("$ ")]
    assert commands[0].startswith("python -m overlapkit new-plugin")
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=True)
    # The new environment sees this one's packages (torch, overlapkit, pytest) instead
    # of downloading torch again: a .pth line that starts with "import" is executed.
    new_site = next((environment / "lib").glob("python*/site-packages"))
    here = [*site.getsitepackages(), site.getusersitepackages()]
    (new_site / "outer.pth").write_text(
        "".join(f"import site; site.addsitedir({path!r})\n" for path in here))
    bin_dir = environment / ("Scripts" if os.name == "nt" else "bin")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("OVERLAPKIT_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    work = tmp_path / "work"
    work.mkdir()
    script = " && ".join(commands)
    run = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{script}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert "1 passed" in run.stdout, run.stdout
    installed = subprocess.run([str(bin_dir / "python"), "-m", "pip", "show", PACKAGE],
                               env=env, capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0 and str(work / PACKAGE) in installed.stdout, (
        installed.stdout + installed.stderr)
