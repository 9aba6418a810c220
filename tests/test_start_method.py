"""Plain scripts work: ranks forked where safe, spawned otherwise (issue 28, item 1; minillm.executor.start_method).

What is checked: the choice and its reason (no CUDA context and no non-daemon thread: fork; a
non-daemon thread, a CUDA context, or the environment variable: spawn; fork forced over CUDA is
refused); the main-guard check reads the script (guarded, unguarded, `python -c`); a script without
`if __name__ == "__main__":`, a `python -c` and a notebook each run TP 2 × PP 2 (4 ranks, forked)
and print the one-process tokens; forced spawn on that script fails before any rank starts, naming
the guard, without multiprocessing's bootstrapping traceback, and the guarded script then works.
Every command's processes are found by a marker in their environment and counted: the ranks exist
while the engine runs, none is left after.

CI cost, in counts: four engines of 4 ranks, each in a subprocess or kernel of its own (three forked:
no interpreter start per rank), and one reference engine; the rest is a few subprocesses that start
no rank. Marked slow, in the "distributed" xdist group with the other multi-process tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import uuid

import psutil
import pytest

from minillm.executor import start_method
from minillm.executor.start_method import (
    START_METHOD_ENV,
    check_main_guard,
    choose_start_method,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed")]

COMMAND_TIMEOUT_S = 300
PROMPTS = ["In the beginning God created the heaven and the earth.", "Blessed are the meek"]
KNOBS = dict(tensor_parallel_size=2, pipeline_parallel_size=2, max_num_seqs=2, max_model_len=64)
# The engine, as a new user writes it: no main guard, no function. It prints one JSON line.
ENGINE_CODE = textwrap.dedent(f"""\
    import json, psutil
    from minillm import LLM, SamplingParams
    def ranks():  # child processes, multiprocessing's resource tracker (a spawn helper) left out
        return len([c for c in psutil.Process().children() if not c.cmdline()[-1].startswith("from multiprocessing")])
    before = ranks()
    llm = LLM(dtype="float64", **{KNOBS!r})
    during = ranks()
    outs = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    method = llm.engine.executor.start_method.name
    llm.shutdown()
    print("RESULT " + json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in outs], "method": method,
                                  "before": before, "during": during,
                                  "after": ranks()}}))
    """)


@pytest.fixture(scope="module")
def one_process_tokens() -> list[list[int]]:
    from minillm import LLM, SamplingParams

    llm = LLM(dtype="float64", max_num_seqs=2, max_model_len=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def marked_env(**extra: str) -> tuple[dict, str]:
    marker = uuid.uuid4().hex
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "MINILLM_TEST_MARKER": marker}
    env.pop(START_METHOD_ENV, None)
    env.update(extra)
    return env, marker


def left_behind(marker: str) -> list[int]:
    """Processes still alive that carry the command's marker (its ranks would)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MINILLM_TEST_MARKER") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def run(args: list[str], cwd, **extra: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    env, marker = marked_env(**extra)
    done = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    return done, left_behind(marker)


def result_of(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout
    return json.loads(lines[-1][len("RESULT "):])


# ---- the choice (in this process) ------------------------------------------------------------------------
def test_fork_when_nothing_forbids_it_and_the_reason_says_what_was_checked(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    monkeypatch.setattr(start_method, "_other_threads", lambda: ([], []))
    chosen = choose_start_method()
    assert chosen.name == "fork"
    assert "torch.cuda.is_initialized() is False" in chosen.reason and "no non-daemon thread" in chosen.reason


def test_a_running_non_daemon_thread_means_spawn_and_a_daemon_one_does_not(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    release = threading.Event()
    busy = threading.Thread(target=release.wait, name="busy-worker", daemon=False)
    helper = threading.Thread(target=release.wait, name="quiet-helper", daemon=True)
    busy.start()
    helper.start()
    try:
        chosen = choose_start_method()
        assert chosen.name == "spawn" and "busy-worker" in chosen.reason
    finally:
        release.set()
        busy.join(5)
    release2 = threading.Event()
    helper = threading.Thread(target=release2.wait, name="quiet-helper", daemon=True)
    helper.start()
    try:
        monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread(), helper])
        chosen = choose_start_method()
        assert chosen.name == "fork" and "quiet-helper" in chosen.reason and "ignored" in chosen.reason
    finally:
        release2.set()


def test_a_cuda_context_means_spawn_and_forcing_fork_over_it_is_refused(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    monkeypatch.setattr(start_method, "_cuda_initialized", lambda: True)
    chosen = choose_start_method()
    assert chosen.name == "spawn" and "CUDA context" in chosen.reason
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="CUDA context.*use spawn"):
        choose_start_method()


def test_the_environment_variable_forces_one_and_a_wrong_value_is_named(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert choose_start_method() == start_method.StartMethod("spawn", f"forced by {START_METHOD_ENV}=spawn")
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match=r"MINILLM_WORKER_MULTIPROC_METHOD='forkserver': choose one of \('fork', "
                                         r"'spawn'\)"):
        choose_start_method()


def test_under_spawn_this_guarded_pytest_run_passes_the_check():
    check_main_guard(start_method.StartMethod("spawn", "test"))  # pytest's own __main__ is guarded: no error


GUARD_PROBE = """\
from minillm.executor.start_method import StartMethod, check_main_guard
def build():
    check_main_guard(StartMethod("spawn", "test"))
    print("OK")
"""


@pytest.mark.parametrize("tail, unguarded_line", [("build()\n", 5), ('if __name__ == "__main__":\n    build()\n', None)])
def test_the_guard_check_reads_the_script(tmp_path, tail, unguarded_line):
    script = tmp_path / "probe.py"
    script.write_text(GUARD_PROBE + tail)
    done, _ = run([str(script)], tmp_path)
    if unguarded_line is None:
        assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr
    else:
        assert done.returncode == 1
        assert f"spawn re-runs {script} in every rank, and its line {unguarded_line} starts the engine" in done.stderr
        assert 'if __name__ == "__main__":' in done.stderr
    done, _ = run(["-c", GUARD_PROBE + "build()\n"], tmp_path)  # no main file: nothing re-runs
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr


# ---- real ranks ----------------------------------------------------------------------------------------
def test_a_script_without_a_main_guard_runs_tp2_pp2_forked_with_one_process_tokens(tmp_path, one_process_tokens):
    script = tmp_path / "plain.py"
    script.write_text(ENGINE_CODE)
    done, left = run([str(script)], tmp_path)
    assert done.returncode == 0, done.stderr
    result = result_of(done.stdout)
    assert result["method"] == "fork"
    assert (result["before"], result["during"], result["after"]) == (0, 4, 0)
    assert result["tokens"] == one_process_tokens
    assert "bootstrapping" not in done.stderr and left == []


def test_python_c_runs_tp2_pp2_with_one_process_tokens(tmp_path, one_process_tokens):
    done, left = run(["-c", ENGINE_CODE], tmp_path)
    assert done.returncode == 0, done.stderr
    result = result_of(done.stdout)
    assert (result["method"], result["during"], result["after"]) == ("fork", 4, 0)
    assert result["tokens"] == one_process_tokens and left == []


def test_forced_spawn_on_an_unguarded_script_names_the_guard_and_the_guarded_script_works(tmp_path,
                                                                                         one_process_tokens):
    script = tmp_path / "plain.py"
    script.write_text(ENGINE_CODE)
    done, left = run([str(script)], tmp_path, **{START_METHOD_ENV: "spawn"})
    assert done.returncode == 1
    assert "MainGuardError" in done.stderr and 'if __name__ == "__main__":' in done.stderr
    assert f"unset {START_METHOD_ENV}" in done.stderr
    assert "bootstrapping" not in done.stderr and "EngineDeadError" not in done.stderr
    assert left == []  # refused before any rank started
    guarded = tmp_path / "guarded.py"
    guarded.write_text('if __name__ == "__main__":\n' + textwrap.indent(ENGINE_CODE, "    "))
    done, left = run([str(guarded)], tmp_path, **{START_METHOD_ENV: "spawn"})
    assert done.returncode == 0, done.stderr
    result = result_of(done.stdout)
    assert (result["method"], result["during"], result["after"]) == ("spawn", 4, 0)
    assert result["tokens"] == one_process_tokens and left == []


def test_a_notebook_runs_tp2_pp2_with_one_process_tokens(tmp_path, one_process_tokens, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    marker = uuid.uuid4().hex
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    monkeypatch.setenv("MINILLM_TEST_MARKER", marker)  # the kernel inherits this process's environment
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(ENGINE_CODE)])
    NotebookClient(notebook, timeout=COMMAND_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(out.get("text", "") for out in notebook.cells[0].outputs)
    result = result_of(text)
    assert (result["during"], result["after"]) == (4, 0)
    assert result["method"] == "fork"  # Jupyter's threads are daemons
    assert result["tokens"] == one_process_tokens
    assert left_behind(marker) == []
