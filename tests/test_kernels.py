"""numba.cuda kernels (chapter 10), tested without a GPU: against their torch references on numba's
CUDA simulator (tests/kernel_checks.py, a fresh process with NUMBA_ENABLE_CUDASIM=1), and compiled
for real to PTX for sm_80 and sm_90 (a process without the simulator: it has no compiler)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from minillm import LLM
from minillm.kernels import KERNELS


def run(args: list[str], simulator: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_kernels_match_their_references_in_the_simulator_and_the_engine_agrees():
    proc = run([str(REPO_ROOT / "tests" / "kernel_checks.py")], simulator=True)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum(line.startswith("PASS") for line in lines) == 7 and not any(line.startswith("FAIL") for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("cc", [80, 90])
def test_every_kernel_compiles_to_ptx(cc):
    proc = run(["-m", "minillm.kernels.ptx", "--cc", str(cc)], simulator=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(KERNELS)
    assert all(line.endswith("ok") and f"sm_{cc}" in line for line in lines)


def test_the_numba_backend_on_a_cpu_without_the_simulator_says_what_to_do():
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("this process runs the simulator")
    llm = LLM(max_num_seqs=2, attention_backend="numba")
    with pytest.raises(RuntimeError, match="NUMBA_ENABLE_CUDASIM=1"):
        llm.generate(["In the beginning"], use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.kv.allocator.num_in_use == 0
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(attention_backend="triton")
