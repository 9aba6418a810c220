"""`make lab` starts anywhere (as root and as a normal user, without a display) and serves the whole course."""

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
_spec.loader.exec_module(lab)


def test_flags_follow_the_machine():
    headless_root = lab.lab_command([], euid=0, env={}, platform="linux")
    assert "--allow-root" in headless_root and "--no-browser" in headless_root
    assert f"--ServerApp.root_dir={REPO_ROOT}" in headless_root
    assert "--LabApp.default_url=/lab/tree/chapters" in headless_root
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
        status, body = get("/api/contents/chapters")
        names = {item["name"] for item in json.loads(body)["content"]}
        assert status == 200 and "04_continuous_batching.ipynb" in names
        chapter = json.loads(get("/api/contents/chapters/05_paged_kv.ipynb")[1])["content"]
        links = {part.split(")")[0] for cell in chapter["cells"] if cell["cell_type"] == "markdown"
                 for part in "".join(cell["source"]).split("](")[1:] if part.startswith("../exercises/")}
        assert links, "chapter 05 links to its exercise"
        for link in links:  # relative to chapters/: served because the root is the repository
            target = (Path("chapters") / link.split("#")[0]).as_posix().replace("chapters/../", "")
            assert get(f"/api/contents/{target}")[0] == 200
        assert get("/lab/tree/chapters")[0] == 200
        settings = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
        assert json.loads(settings.read_text())["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
