"""`make lab`: JupyterLab on the course, started the same way on a laptop, in a container or on CI.

    python tools/lab.py [extra jupyter lab options, e.g. --port 8899]
    python tools/lab.py --reset chapters/06_memory_pressure.ipynb   # take the course's version again

- opens a **workspace copy** of chapters/ and exercises/ (`workspace/`, ignored by git through its
  own `.gitignore`), so running or editing a notebook never touches a tracked file and a later
  `git pull` of course updates cannot conflict (docs/lab.md says why this design);
- refreshes that copy from the tracked notebooks at every start: a copy whose cell sources are still
  the ones it was copied with (only run: outputs, counts, widget state changed) takes the course's
  new version; a copy the learner edited is kept, and the update is reported (`--reset` takes it,
  after moving the learner's file to `workspace/.replaced/`);
- serves the repository root, so a chapter's link to its exercise (`../exercises/…`) opens in the
  workspace, and opens on `workspace/chapters/`;
- adds `--allow-root` when running as root (containers, CI machines: JupyterLab refuses otherwise)
  and `--no-browser` on a Linux machine without a display;
- silences JupyterLab's "get notified about Jupyter news?" prompt and its update checks for the
  course (an `overrides.json` in the virtual environment's lab settings; nothing outside it changes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKSPACE_NAME = "workspace"
COPIED_DIRS = ("chapters", "exercises")
MANIFEST_NAME = ".lab-copies.json"  # {"chapters/NN_x.ipynb": digest of the cell sources copied}
OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}


def source_digest(path: Path) -> str:
    """A digest of what the learner writes in a notebook (cell types and sources), blind to what a
    run changes (outputs, execution counts, cell and notebook metadata, JupyterLab's formatting)."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    except (ValueError, KeyError) as error:
        raise ValueError(f"{path} is not a notebook JupyterLab saved ({error}); "
                         f"move it away or `--reset` it to take the course's copy") from None
    text = json.dumps([[c["cell_type"], "".join(c["source"])] for c in cells])
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Refresh:
    """What `refresh_workspace` did, one list of relative paths per outcome."""

    created: list[str] = field(default_factory=list)  # new in the course (or first start)
    updated: list[str] = field(default_factory=list)  # only run by the learner: took the course's new version
    kept: list[str] = field(default_factory=list)  # edited by the learner, and the course changed it too

    def report(self) -> str:
        lines = []
        if self.created:
            lines.append(f"workspace: copied {len(self.created)} notebooks from the course")
        if self.updated:
            lines.append("workspace: course updates taken (your runs' outputs in them are reset): "
                         + ", ".join(self.updated))
        for rel in self.kept:
            lines.append(f"workspace: the course updated {rel}, and you edited your copy, so yours is kept; "
                         f"`python tools/lab.py --reset {rel}` takes the course's version "
                         f"(yours is moved to {WORKSPACE_NAME}/.replaced/)")
        return "\n".join(lines)


def _tracked_notebooks(repo: Path) -> list[str]:
    return sorted(p.relative_to(repo).as_posix() for d in COPIED_DIRS for p in (repo / d).glob("*.ipynb"))


def _load_manifest(workspace: Path) -> dict[str, str]:
    path = workspace / MANIFEST_NAME
    return json.loads(path.read_text()) if path.exists() else {}


def refresh_workspace(repo: Path = REPO) -> Refresh:
    """Create or refresh `repo/workspace/{chapters,exercises}` from the tracked notebooks."""
    workspace = repo / WORKSPACE_NAME
    workspace.mkdir(exist_ok=True)
    (workspace / ".gitignore").write_text("# make lab's copies of the course: yours, never committed\n*\n")
    manifest = _load_manifest(workspace)
    done = Refresh()
    for rel in _tracked_notebooks(repo):
        course, mine = repo / rel, workspace / rel
        course_digest = source_digest(course)
        if not mine.exists():
            done.created.append(rel)
        elif source_digest(mine) != manifest.get(rel):  # the learner edited a cell: never overwrite it
            if course_digest != manifest.get(rel):
                done.kept.append(rel)
            continue
        elif course_digest == manifest[rel]:
            continue  # the course did not change it: keep the learner's outputs
        else:
            done.updated.append(rel)
        mine.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(course, mine)
        manifest[rel] = course_digest
    (workspace / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return done


def reset_copy(rel: str, repo: Path = REPO) -> Path:
    """Replace the workspace copy of `rel` (e.g. "chapters/06_memory_pressure.ipynb") with the
    course's; the learner's file is moved to workspace/.replaced/ first. Returns where it went."""
    rel = Path(rel).as_posix().removeprefix(f"{WORKSPACE_NAME}/")
    if rel not in _tracked_notebooks(repo):
        raise ValueError(f"--reset takes a course notebook such as chapters/06_memory_pressure.ipynb or "
                         f"exercises/ex06_preemption.ipynb; {rel!r} is not one")
    workspace = repo / WORKSPACE_NAME
    mine = workspace / rel
    backup = workspace / ".replaced" / f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(rel).name}"
    if mine.exists():
        backup.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(mine, backup)
    manifest = _load_manifest(workspace)
    manifest.pop(rel, None)
    (workspace / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    refresh_workspace(repo)
    return backup


def lab_command(argv: list[str], euid: int | None = None, env: dict[str, str] | None = None,
                platform: str = sys.platform) -> list[str]:
    env = os.environ if env is None else env
    if euid is None:
        euid = os.geteuid() if hasattr(os, "geteuid") else 1
    cmd = [str(Path(sys.executable).parent / "jupyter"), "lab", f"--ServerApp.root_dir={REPO}",
           f"--LabApp.default_url=/lab/tree/{WORKSPACE_NAME}/chapters"]
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--reset"]:
        if len(argv) < 2:
            print("--reset takes one or more course notebooks, e.g. chapters/06_memory_pressure.ipynb",
                  file=sys.stderr)
            return 2
        for rel in argv[1:]:
            backup = reset_copy(rel)
            print(f"{rel}: the course's version is in {WORKSPACE_NAME}/; yours, if any, is {backup.relative_to(REPO)}")
        return 0
    report = refresh_workspace().report()
    if report:
        print(report)
    silence_news()
    cmd = lab_command(argv)
    os.chdir(REPO)
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
