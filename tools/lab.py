"""`make lab`: JupyterLab on the course, started the same way on a laptop, in a container or on CI.

    python tools/lab.py [extra jupyter lab options, e.g. --port 8899]

- serves the repository root, so a chapter's link to its exercise (`../exercises/…`) opens, and
  opens on `chapters/`;
- adds `--allow-root` when running as root (containers, CI machines: JupyterLab refuses otherwise)
  and `--no-browser` on a Linux machine without a display;
- silences JupyterLab's "get notified about Jupyter news?" prompt and its update checks for the
  course (an `overrides.json` in the virtual environment's lab settings; nothing outside it changes).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}


def lab_command(argv: list[str], euid: int | None = None, env: dict[str, str] | None = None,
                platform: str = sys.platform) -> list[str]:
    env = os.environ if env is None else env
    if euid is None:
        euid = os.geteuid() if hasattr(os, "geteuid") else 1
    cmd = [str(Path(sys.executable).parent / "jupyter"), "lab", f"--ServerApp.root_dir={REPO}",
           "--LabApp.default_url=/lab/tree/chapters"]
    if euid == 0:
        cmd.append("--allow-root")
    if platform.startswith("linux") and not (env.get("DISPLAY") or env.get("WAYLAND_DISPLAY")):
        cmd.append("--no-browser")
    return cmd + argv


def silence_news() -> Path:
    settings = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings"
    settings.mkdir(parents=True, exist_ok=True)
    path = settings / "overrides.json"
    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(OVERRIDES)
    path.write_text(json.dumps(current, indent=2) + "\n")
    return path


def main() -> None:
    silence_news()
    cmd = lab_command(sys.argv[1:])
    os.chdir(REPO)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
