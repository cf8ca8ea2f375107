"""tox's install command: every environment shares one install of torch.

Each tox environment used to install the 190 MiB torch wheel (894 MiB unpacked) on its
own: 17 to 45 s apiece, six times in the README's test command. Here torch is installed
once, with ``pip install --target``, into ``.tox/.shared-torch-<version>``, and each
environment that needs it gets a ``.pth`` file pointing there before pip runs. pip
then sees ``torch==2.13.0`` as installed (it reads every ``sys.path`` entry of the
environment's interpreter) and installs only what torch itself requires (small pure
Python packages) and what the environment asks for.

Used as ``install_command`` in ``tox.ini``; run with the environment's interpreter.
Environments that ask for no torch (``lint``) are left alone. A file lock makes
parallel environments (``tox p``) install the shared copy once.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import sysconfig
from pathlib import Path

#: the one torch this project targets (any other pin downloads the CUDA builds)
TORCH = "torch==2.13.0"
ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".tox" / f".shared-{TORCH.replace('==', '-')}"
PTH_NAME = "overlapkit-shared-torch.pth"


def _wants_torch(packages: list[str]) -> bool:
    """Whether this install may pull torch: torch itself, the project (a wheel or a
    source path) or a requirement that names the project."""
    return any(
        arg.startswith(("torch", "-r", "-e", ".", "/")) or arg.endswith(".whl")
        or "overlapkit" in arg
        for arg in packages
    )


def _install_shared() -> None:
    """Install torch once into :data:`SHARED` (under a lock; a marker file says the
    install finished, so an interrupted one is redone)."""
    SHARED.parent.mkdir(parents=True, exist_ok=True)
    with open(SHARED.parent / ".shared-torch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = SHARED / ".installed"
        if done.exists():
            return
        print(f"tox_install: installing {TORCH} once for every environment into {SHARED}",
              flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--upgrade", "--target", str(SHARED), TORCH], check=True)
        done.write_text(TORCH + "\n", encoding="utf-8")


def _link_shared() -> None:
    """Put :data:`SHARED` on this environment's ``sys.path`` (a ``.pth`` file)."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    (purelib / PTH_NAME).write_text(str(SHARED) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    if _wants_torch(argv):
        _install_shared()
        _link_shared()
    return subprocess.run([sys.executable, "-m", "pip", "install", *argv]).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
