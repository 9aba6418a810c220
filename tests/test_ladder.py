"""Chapter 10's warm-up ladder as puzzles (minillm.kernels.ladder): right kernels pass and wrong
ones fail for their own reason, on the simulator in a fresh process (tests/ladder_checks.py; ~5 s
of CPU). The tracer under it (minillm.kernels.trace) is what finds a missing barrier every run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT


@pytest.mark.slow
def test_ladder_checkers_pass_right_kernels_and_fail_wrong_ones_for_their_reason():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "ladder_checks.py")], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 12 and all(line.startswith("PASS") for line in lines), proc.stdout
