"""`make lab` starts anywhere (as root and as a normal user, without a display) and serves the whole course
from a git-ignored workspace copy, so a learner's runs leave the tracked notebooks clean and a later
`git pull` of course updates does not conflict."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("course_lab", REPO_ROOT / "tools" / "lab.py")
lab = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = lab  # its dataclass looks the module up while the class is built
_spec.loader.exec_module(lab)


def test_flags_follow_the_machine():
    headless_root = lab.lab_command([], euid=0, env={}, platform="linux")
    assert "--allow-root" in headless_root and "--no-browser" in headless_root
    assert f"--ServerApp.root_dir={REPO_ROOT}" in headless_root
    assert "--LabApp.default_url=/lab/tree/workspace/chapters" in headless_root
    desktop_user = lab.lab_command(["--port", "9999"], euid=1000, env={"DISPLAY": ":0"}, platform="linux")
    assert "--allow-root" not in desktop_user and "--no-browser" not in desktop_user
    assert desktop_user[-2:] == ["--port", "9999"]
    assert "--no-browser" not in lab.lab_command([], euid=501, env={}, platform="darwin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Both users from either side: a user namespace makes this process look like uid 0 (`--map-root-user`)
# or like uid 1000 (`--map-user`) to JupyterLab, which decides on `os.geteuid()`, while the files it
# reads stay accessible. Run as root (CI), "root" is the plain run; run as a user, "user" is.
_AS = {"root": ["unshare", "--user", "--map-root-user"],
       "user": ["unshare", "--user", "--map-user=1000", "--map-group=1000"]}


def _as(who: str) -> list[str]:
    if (os.geteuid() == 0) == (who == "root"):
        return []
    prefix = _AS[who]
    if shutil.which("unshare") is None or subprocess.run(prefix + ["true"], capture_output=True).returncode:
        pytest.skip(f"cannot run as {who} here: no unprivileged user namespaces (unshare)")
    return prefix


@pytest.mark.slow
@pytest.mark.parametrize("who", ["root", "user"])
def test_make_lab_serves_chapters_and_the_exercises_they_link_to(who):
    port, token = free_port(), "minillm-test"
    prefix = _as(who)
    probe = subprocess.run(prefix + [sys.executable, "-c", "import os; print(os.geteuid())"],
                           capture_output=True, text=True, check=True)
    assert (probe.stdout.strip() == "0") == (who == "root")
    proc = subprocess.Popen(prefix + [sys.executable, str(REPO_ROOT / "tools" / "lab.py"), f"--port={port}",
                                      "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/")
    base = f"http://127.0.0.1:{port}"

    def get(path: str):
        req = urllib.request.Request(base + path, headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()

    try:
        for _ in range(120):
            try:
                if get("/api/status")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
            if proc.poll() is not None:  # e.g. "Running as root is not recommended. Use --allow-root"
                break
        else:
            pytest.fail(f"JupyterLab ({who}) did not start in 60 s")
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab ({who}) exited at once: {proc.stdout.read().decode()[-2000:]}")
        status, body = get("/api/contents/workspace/chapters")
        names = {item["name"] for item in json.loads(body)["content"]}
        assert status == 200 and "04_continuous_batching.ipynb" in names
        chapter = json.loads(get("/api/contents/workspace/chapters/05_paged_kv.ipynb")[1])["content"]
        links = {part.split(")")[0] for cell in chapter["cells"] if cell["cell_type"] == "markdown"
                 for part in "".join(cell["source"]).split("](")[1:] if part.startswith("../exercises/")}
        assert links, "chapter 05 links to its exercise"
        for link in links:  # relative to workspace/chapters/: the workspace copy of the exercise
            target = (Path("workspace/chapters") / link.split("#")[0]).as_posix().replace("chapters/../", "")
            assert target.startswith("workspace/exercises/")
            assert get(f"/api/contents/{target}")[0] == 200
        assert get("/lab/tree/workspace/chapters")[0] == 200
        settings = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
        assert json.loads(settings.read_text())["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# --- the workspace: a learner's runs and a course update, then `git pull` ------------------------------


def _notebook(*sources: str, outputs: list | None = None) -> str:
    cells = [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {},
              "outputs": outputs or [], "source": s} for i, s in enumerate(sources)]
    return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1) + "\n"


def _git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.org", GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=check)


@pytest.fixture
def course(tmp_path):
    """A bare origin with a two-notebook course, a teacher's clone and a learner's clone of it."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    seed = tmp_path / "seed"
    (seed / "chapters").mkdir(parents=True)
    (seed / "exercises").mkdir()
    (seed / "chapters" / "06_x.ipynb").write_text(_notebook("print('chapter v1')"))
    (seed / "exercises" / "ex06_x.ipynb").write_text(_notebook("# TODO: your code"))
    _git(seed, "init", "-q", "-b", "main")
    _git(seed, "add", "-A")
    _git(seed, "commit", "-q", "-m", "course v1")
    _git(tmp_path, "clone", "-q", "--bare", str(seed), "origin.git")
    for who in ("teacher", "learner"):
        _git(tmp_path, "clone", "-q", "origin.git", who)
    return tmp_path / "origin.git", tmp_path / "teacher", tmp_path / "learner"


def _update_course(teacher: Path) -> None:
    (teacher / "chapters" / "06_x.ipynb").write_text(_notebook("print('chapter v2: a fixed claim')"))
    (teacher / "exercises" / "ex06_x.ipynb").write_text(_notebook("# TODO: your code (clearer hint)"))
    _git(teacher, "commit", "-q", "-am", "course v2")
    _git(teacher, "push", "-q", "origin", "main")


def _run_in_lab(path: Path, edit_source: str | None = None) -> None:
    """What running a notebook in JupyterLab and autosaving it does to the file: outputs and counts
    change, and, when the learner typed something, a cell's source."""
    notebook = json.loads(path.read_text())
    for i, cell in enumerate(notebook["cells"], start=1):
        cell["execution_count"] = i
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["ran\n"]}]
    if edit_source is not None:
        notebook["cells"][0]["source"] = edit_source
    notebook["metadata"]["widgets"] = {"state": {}}
    path.write_text(json.dumps(notebook, indent=1) + "\n")


def test_a_pull_after_running_in_the_workspace_does_not_conflict(course):
    _, teacher, learner = course
    first = lab.refresh_workspace(learner)
    assert sorted(first.created) == ["chapters/06_x.ipynb", "exercises/ex06_x.ipynb"]
    chapter, exercise = learner / "workspace" / "chapters" / "06_x.ipynb", learner / "workspace" / "exercises" / "ex06_x.ipynb"
    _run_in_lab(chapter)
    _run_in_lab(exercise, edit_source="def my_answer():\n    return 42\n")
    assert _git(learner, "status", "--porcelain").stdout == "", "the workspace must be invisible to git"

    _update_course(teacher)
    pull = _git(learner, "pull", "-q", "--no-rebase", "origin", "main", check=False)
    assert pull.returncode == 0, f"git pull after a run failed: {pull.stdout}{pull.stderr}"
    assert _git(learner, "status", "--porcelain").stdout == ""

    second = lab.refresh_workspace(learner)
    assert second.updated == ["chapters/06_x.ipynb"], "a chapter only run takes the course's update"
    assert "chapter v2" in chapter.read_text()
    assert second.kept == ["exercises/ex06_x.ipynb"], "an exercise the learner wrote in is never overwritten"
    assert "my_answer" in exercise.read_text()
    assert "--reset exercises/ex06_x.ipynb" in second.report()

    backup = lab.reset_copy("exercises/ex06_x.ipynb", learner)
    assert "my_answer" in backup.read_text() and "clearer hint" in exercise.read_text()
    assert lab.refresh_workspace(learner) == lab.Refresh(), "a second start changes nothing"


def test_the_same_run_on_the_tracked_notebook_conflicts(course):
    """The control: what happened before the workspace (the run autosaved into chapters/) fails the pull,
    so the test above would catch a lab that opened the tracked notebooks again."""
    _, teacher, learner = course
    _run_in_lab(learner / "chapters" / "06_x.ipynb")
    _update_course(teacher)
    pull = _git(learner, "pull", "-q", "--no-rebase", "origin", "main", check=False)
    assert pull.returncode != 0 and "chapters/06_x.ipynb" in pull.stdout + pull.stderr


def test_reset_refuses_what_is_not_a_course_notebook(course):
    _, _, learner = course
    lab.refresh_workspace(learner)
    with pytest.raises(ValueError, match="is not one"):
        lab.reset_copy("chapters/99_missing.ipynb", learner)
