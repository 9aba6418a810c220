"""bench/llamacpp.py without llama.cpp (CI never installs it): what it refuses and why (issue 29).

The bench itself needs llama-cpp-python built into its own venv (`python bench/llamacpp.py --install`);
here: a missing peer is a clear error naming the fix, and a greedy mismatch stops the bench with
the first differing token, so no timing ever compares different work.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench():
    spec = importlib.util.spec_from_file_location("llamacpp_bench_under_test", BENCH / "llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_llama_cpp_python_it_says_how_to_install_it(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "llamacpp.py"), "--llamacpp-python", str(tmp_path / "python")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"no llama-cpp-python at {tmp_path / 'python'}" in done.stderr
    assert "python bench/llamacpp.py --install" in done.stderr


def test_sections_outside_2_to_5_are_refused():
    done = subprocess.run([sys.executable, str(BENCH / "llamacpp.py"), "--sections", "1,6"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "--sections takes numbers from 2,3,4,5; got '1,6'" in done.stderr


def test_a_greedy_difference_stops_the_bench_naming_the_first_differing_token():
    bench = load_bench()
    bench.require_identical("same", [[1, 2, 3], [4]], [[1, 2, 3], [4]])  # equal: passes
    with pytest.raises(SystemExit, match=r"NOT token-identical \(case\), prompt 1, first difference at output token 2"):
        bench.require_identical("case", [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 7]])
    with pytest.raises(SystemExit, match="prompt 0, first difference at output token 2"):
        bench.require_identical("shorter", [[1, 2]], [[1, 2, 3]])


def test_the_engine_share_of_a_first_token_is_read_from_the_ttft_histogram_sum():
    bench = load_bench()
    exposition = ('# TYPE vllm:time_to_first_token_seconds histogram\n'
                  'vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="minillm"} 1.0\n'
                  'vllm:time_to_first_token_seconds_count{model_name="minillm"} 1.0\n'
                  'vllm:time_to_first_token_seconds_sum{model_name="minillm"} 0.0271\n'
                  'vllm:e2e_request_latency_seconds_sum{model_name="minillm"} 0.05\n')
    assert bench._metric_sum(exposition, "vllm:time_to_first_token_seconds") == 0.0271
    assert bench._metric_sum(exposition, "vllm:inter_token_latency_seconds") == 0.0  # nothing observed yet
