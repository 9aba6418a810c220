"""Every command in README.md and docs/*.md runs as written (issue 31); the runner: tests/doc_commands.py.

Each fenced block is one test: its commands run in order from the repository root with the
course's environment first on PATH (what `source .venv/bin/activate` gives a reader); servers are
started, waited for, and stopped with every process they started (counted). A block followed by
the output it prints, where that output is deterministic, is compared with it. Each distinct `python ...`
command quoted in prose is one test too (as written, smaller, or skipped with its reason). None may
leave a file that git sees in the root, bench/ or docs/.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import doc_commands as docs
import httpx
import psutil
import pytest

# Same xdist group as tests/test_router.py: both start servers on ports probed free a moment earlier, and two
# probes at once can be handed the same port (seen: a replica lost its port to a documented server).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("router")]

BIN = Path(sys.executable).parent  # the course's environment: python, minillm, pytest
START_TIMEOUT_S = 240.0  # a TP 2 x PP 2 world or a PD pair on a loaded 2-core CI machine
RUN_TIMEOUT_S = 300.0


def environment() -> dict[str, str]:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(BIN.parent),
               VENV=str(BIN.parent))  # make targets use this environment, wherever it lives
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the test suite's own (conftest.py), not a reader's: a page sets it where needed
    return env


def as_run_here(command: str) -> str:
    """The command as a reader runs it: `.venv/bin/X` and `source .venv/bin/activate` name the
    environment this test runs in (a worktree or a CI clone may keep it elsewhere)."""
    command = command.replace("source .venv/bin/activate", f"source {BIN / 'activate'}")
    return re.sub(r"(?<![\w/])\.venv/bin/", f"{BIN}/", command)


def stray_files() -> set[str] | None:
    """Files git would see (untracked, not ignored) where a documented command could leave one: the
    repository's root, bench/ and docs/. None outside a git checkout (a student release)."""
    done = subprocess.run(["git", "-C", str(docs.ROOT), "ls-files", "--others", "--exclude-standard"],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return None
    return {name for name in done.stdout.splitlines() if "/" not in name or name.startswith(("bench/", "docs/"))}


def assert_left_nothing(before: set[str] | None, what: str) -> None:
    after = stray_files()
    if before is not None and after is not None:
        assert after <= before, (f"{what} left {sorted(after - before)} where git sees it: a bench writes under "
                                 "bench/results/ (bench/_machine.py's results_path), which .gitignore excludes")


def documented_blocks() -> list[docs.Block]:
    return [b for page in docs.PAGES for b in docs.blocks_of(page)
            if (b.language in ("bash", "sh", "shell") and b.commands) or b.language == "python"]


def wait_healthy(proc: subprocess.Popen, port: int, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    # One client for every poll: httpx.get() builds a client, and its TLS context, per call, CPU taken from
    # the start-up being waited for.
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"{what!r} exited with {proc.returncode} before it was healthy:\n{tail(proc)}")
            try:
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise AssertionError(f"{what!r} was not healthy on port {port} within {START_TIMEOUT_S:.0f} s:\n{tail(proc)}")


def tail(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        return "(still running)"
    return (out or "")[-3000:]


def stop(proc: subprocess.Popen) -> None:
    """Stop a server and everything it started (its own session: servers, ranks, routers)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # ranks and replicas exit after their parent
        left = [p for p in psutil.process_iter(["pid"]) if _session_of(p) == proc.pid]
        if not left:
            return
        time.sleep(0.5)
    for p in left:
        p.kill()
    raise AssertionError(f"processes left behind by {proc.args!r}: {[p.pid for p in left]}")


def _session_of(p: psutil.Process) -> int | None:
    try:
        return os.getsid(p.pid)
    except (ProcessLookupError, PermissionError, psutil.Error):
        return None


def start_server(command: str, stack: ExitStack) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", "-c", as_run_here(command)], cwd=docs.ROOT, env=environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    stack.callback(stop, proc)
    wait_healthy(proc, docs.port_of(command), command)
    return proc


def run(command: str) -> str:
    done = subprocess.run(["bash", "-c", as_run_here(command)], cwd=docs.ROOT, env=environment(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{command!r} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


DOCUMENTED_PORTS = (8000, 8001, 8002, 14579, 29500)  # the pages' ports (14579: the PD pair's KV port; 29500: a
# multi-node world's TCPStore, docs/multinode.md)
SERVER_STARTS = ("minillm serve", "python -m minillm serve", ".venv/bin/minillm serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortMap:
    """The pages' fixed ports swapped, consistently within a block, for free ones: other tests run
    servers at the same time (xdist), and a fixed port would be taken. A server started without
    --port (8000 by default) is given the port 8000 maps to."""

    def __init__(self) -> None:
        self.ports = {port: free_port() for port in DOCUMENTED_PORTS}

    def __call__(self, text: str) -> str:
        for port, free in self.ports.items():
            text = re.sub(rf"(?<![\d.]){port}(?!\d)", str(free), text)
        if "--port" not in text:
            if text.startswith(SERVER_STARTS):
                text += f" --port {self.ports[8000]}"
            elif text.startswith("make serve"):
                text = (text.replace('ARGS="', f'ARGS="--port {self.ports[8000]} ', 1) if 'ARGS="' in text
                        else f'{text} ARGS="--port {self.ports[8000]}"')
        return text


def run_block(block: docs.Block) -> None:
    local = PortMap()
    with ExitStack() as stack:
        for command in block.commands:
            what, detail = docs.decide(command.text)
            command = docs.Command(local(command.text), command.background)
            if what == docs.SKIP:
                continue
            if what == docs.START:  # nothing to wait for: started now, stopped (with what it started) at the end
                proc = subprocess.Popen(["bash", "-c", as_run_here(command.text)], cwd=docs.ROOT, env=environment(),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
                stack.callback(stop, proc)
                continue
            if what == docs.SMALL:
                for written, smaller in detail:
                    command = docs.Command(command.text.replace(written, smaller), command.background)
                what = docs.RUN
            if command.background or what == docs.KEEP:
                start_server(command.text, stack)
            elif what == docs.SERVE:
                with ExitStack() as once:
                    start_server(command.text, once)
            else:
                out = run(command.text)
                if block.quoted_output is not None and command is block.commands[-1]:
                    assert out.strip() == block.quoted_output.strip(), (
                        f"{block.page}:{block.line} prints\n{out}\nwhere the page says\n{block.quoted_output}")


def test_every_documented_command_has_a_decision():
    unknown = []
    for block in documented_blocks():
        for command in block.commands:
            try:
                docs.decide(command.text)
            except LookupError:
                unknown.append(f"{block.page}:{block.line}: {command.text[:100]}")
        if block.language == "python" and not any(block.body.startswith(s) for s, _ in docs.PYTHON_BLOCKS):
            unknown.append(f"{block.page}:{block.line}: python block {block.body.splitlines()[0]!r}")
    assert not unknown, "documented commands with no decision in tests/doc_commands.py:\n" + "\n".join(unknown)


@pytest.mark.parametrize("block", documented_blocks(), ids=lambda b: f"{b.page}:{b.line}")
def test_documented_block_runs(block: docs.Block):
    if block.language == "python":
        needs = next(n for s, n in docs.PYTHON_BLOCKS if block.body.startswith(s))
        local = PortMap()
        with ExitStack() as stack:
            if needs:
                start_server(local(needs), stack)
            done = subprocess.run([sys.executable, "-c", local(block.body)], cwd=docs.ROOT, env=environment(),
                                  capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
            assert done.returncode == 0, f"{block.page}:{block.line} failed:\n{done.stderr[-3000:]}"
        return
    if all(docs.decide(c.text)[0] == docs.SKIP for c in block.commands):
        pytest.skip("; ".join(str(docs.decide(c.text)[1]) for c in block.commands))
    before = stray_files()
    run_block(block)
    assert_left_nothing(before, f"{block.page}:{block.line}")


def inline_python_commands() -> list:
    """Each distinct `python ...` command quoted in prose, with the first page that quotes it."""
    seen: dict[str, str] = {}
    for page in docs.PAGES:
        for command in docs.inline_commands(page):
            if docs.split_env(command)[1].startswith("python"):
                seen.setdefault(command, str(page.relative_to(docs.ROOT)))
    return [pytest.param(page, command, id=f"{page}: {command[:70]}") for command, page in seen.items()]


def test_every_inline_python_command_has_a_decision():
    unknown = []
    for param in inline_python_commands():
        page, command = param.values
        try:
            docs.decide_inline(command)
        except LookupError:
            unknown.append(f"{page}: {command}")
    assert not unknown, "python commands in prose with no decision in tests/doc_commands.py:\n" + "\n".join(unknown)


# Starts no server: a group of its own (xdist names it docs-inline_router), beside the servers' group, not in it.
@pytest.mark.xdist_group("docs-inline")
@pytest.mark.parametrize("page,command", inline_python_commands())
def test_inline_python_command_runs(page: str, command: str):
    what, detail = docs.decide_inline(command)
    if what == docs.SKIP:
        pytest.skip(str(detail))
    if what == docs.SMALL:
        command = f"{command} {detail}"
    before = stray_files()
    out = run(command)
    if what == docs.RUN and detail:
        printed = " ".join(out.split())  # compared with runs of spaces as one: a table's column widths are not the claim
        missing = [quoted for quoted in detail if " ".join(quoted.split()) not in printed]
        assert not missing, f"{page}: `{command}` does not print {missing} as the page says; it printed:\n{out[-3000:]}"
    assert_left_nothing(before, f"{page}: `{command}`")


def flags_of(command: str) -> list[str]:
    return re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", command)


def test_inline_commands_name_real_scripts_and_flags():
    """`python bench/x.py --flag`, `python -m pkg.mod --flag` and `minillm SUB --flag` in prose: the
    script or module exists and knows each flag."""
    problems, helps = [], {}
    for page in docs.PAGES:
        quoted = []
        for command in docs.inline_commands(page):  # `python bench/repeat.py -n 3 -- CMD`: each side on its own
            head, _, tail = command.partition(" -- ")
            quoted += [head] + ([tail] if tail.startswith(("python", "minillm")) else [])
        for command in quoted:
            words = docs.split_env(command)[1].split()
            where = f"{page.relative_to(docs.ROOT)}: {command}"
            if words[0].startswith("python") and len(words) > 1 and words[1].endswith(".py"):
                source = docs.ROOT / words[1]
                if not source.is_file():
                    problems.append(f"{where}: no such script")
                    continue
                text = source.read_text()
                problems += [f"{where}: {source.name} has no {flag}" for flag in flags_of(command)
                             if f'"{flag}"' not in text and words[1] not in docs.PASSES_OPTIONS_ON]
            elif words[0].startswith("python") and words[1:2] == ["-m"]:
                module = words[2]
                if module == "minillm":  # python -m minillm SUB ... is the CLI
                    words = ["minillm", *words[3:]]
                else:
                    path = docs.ROOT / (module.replace(".", "/") + ".py")
                    if not path.is_file():
                        problems.append(f"{where}: no module {module}")
                        continue
                    text = path.read_text()
                    problems += [f"{where}: {module} has no {flag}" for flag in flags_of(command)
                                 if f'"{flag}"' not in text]
                    continue
            if words[0] == "minillm":
                sub = [w for w in words[1:3] if not w.startswith("-")]
                sub = sub[:2] if sub[:1] == ["bench"] else sub[:1]
                key = " ".join(sub)
                if key not in helps:
                    done = subprocess.run([str(BIN / "minillm"), *sub, "--help"], capture_output=True, text=True,
                                          env=environment(), timeout=120)
                    helps[key] = done.stdout if done.returncode == 0 else None
                if helps[key] is None:
                    problems.append(f"{where}: `minillm {key} --help` failed")
                    continue
                problems += [f"{where}: `minillm {key}` has no {flag}" for flag in flags_of(command)
                             if flag not in helps[key] and flag != "--help"]
    assert not problems, "\n".join(problems)


def test_inline_make_commands_name_real_targets():
    targets = docs.make_targets()
    assert {"lab", "test", "grade", "bench", "student-release"} <= targets, targets  # the Makefile was read
    unknown = [f"{page.relative_to(docs.ROOT)}: make {target}" for page in docs.PAGES
               for target in docs.inline_make_targets(page)
               if target not in targets and target not in docs.NOT_MAKE_TARGETS]
    assert not unknown, "`make X` in prose where the Makefile has no target X:\n" + "\n".join(unknown)


def test_the_runner_splits_commands_as_bash_does():
    script = ('a --x 1 \\\n    --y 2 &  b --port 8002 &\nc "multi\nline # not a comment" # a comment\n'
              "d && e\n")
    got = [(c.text, c.background) for c in docs.split_commands(script)]
    assert got == [("a --x 1 --y 2", True), ("b --port 8002", True), ('c "multi\nline # not a comment"', False),
                   ("d && e", False)], got
    assert shutil.which("bash")
