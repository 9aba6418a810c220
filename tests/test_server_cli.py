"""`python -m minillm serve` as a learner starts it: flags with vLLM's names, 127.0.0.1 by default,
MINILLM_API_KEY from the environment, a clear error for a bad flag, and a start-up line that says
where the start-up time went (issue 29)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest
from conftest import wait_until_healthy

from minillm.server.serve import engine_knobs, parse_startup_line, process_age_s, startup_line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(*argv):
    from minillm.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_engine_flags_use_vllm_names():
    args = parse("--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--block-size", "8",
                 "--enable-prefix-caching", "--max-model-len", "256",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert engine_knobs(args) == {"max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 8,
                                  "enable_prefix_caching": True, "max_model_len": 256,
                                  "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    assert parse().host == "127.0.0.1" and parse().port == 8000
    with pytest.raises(ValueError, match="--speculative-config must be JSON"):
        engine_knobs(parse("--speculative-config", "{ngram"))


@pytest.mark.slow
def test_python_dash_m_minillm_serve_starts_and_answers():
    port = free_port()
    env = {**os.environ, "MINILLM_API_KEY": "k", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", str(port), "--max-model-len", "128",
                             "--max-num-seqs", "2", "--served-model-name", "toy"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_healthy(proc, port, 120)
        url = f"http://127.0.0.1:{port}/v1"
        assert httpx.get(url + "/models").status_code == 401  # the key came from MINILLM_API_KEY
        models = httpx.get(url + "/models", headers={"Authorization": "Bearer k"}).json()
        assert [m["id"] for m in models["data"]] == ["toy"] and models["data"][0]["max_model_len"] == 128
        r = httpx.post(url + "/completions", json={"model": "toy", "prompt": "In", "max_tokens": 3},
                       headers={"Authorization": "Bearer k"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}/v1" in out
    [line] = [line for line in out.splitlines() if line.startswith("minillm serve: ready")]
    ready_s, phases = parse_startup_line(line)
    assert list(phases) == ["python + imports", "tokenizer", "model + engine", "warm-up", "chat template", "API server"]
    assert all(s >= 0 for s in phases.values()) and phases["python + imports"] > 0.1  # torch alone takes longer
    assert ready_s is not None and sum(phases.values()) - 0.05 <= ready_s  # the phases happened within it


def test_startup_line_reads_back():
    phases = {"python + imports": 3.104, "tokenizer": 0.9, "model + engine": 0.41, "warm-up": 2.0}
    line = startup_line(8.412, phases)
    assert line == ("minillm serve: ready in 8.41 s since launch: python + imports 3.10 s, tokenizer 0.90 s, "
                    "model + engine 0.41 s, warm-up 2.00 s")
    assert parse_startup_line(line) == (8.41, {"python + imports": 3.10, "tokenizer": 0.90, "model + engine": 0.41,
                                               "warm-up": 2.00})
    assert parse_startup_line(startup_line(None, {"API server": 0.2})) == (None, {"API server": 0.2})
    with pytest.raises(ValueError, match="not a start-up line"):
        parse_startup_line("minillm serve: warm-up: compiled")
    age = process_age_s()
    if sys.platform.startswith("linux"):  # this test process started at least the imports ago, and not a day ago
        assert age is not None and 0.0 < age < 86400


def test_bad_flag_value_is_a_clear_error(capsys):
    from minillm.cli import main

    assert main(["serve", "--max-num-queued-reqs", "0"]) == 2
    assert "--max-num-queued-reqs must be >= 1, got 0" in capsys.readouterr().err


def test_chunk_policy_flag(capsys):
    from minillm.cli import main

    args = parse("--enable-chunked-prefill", "--chunk-policy", "splitfuse", "--max-num-batched-tokens", "256")
    assert engine_knobs(args) == {"enable_chunked_prefill": True, "chunk_policy": "splitfuse",
                                  "max_num_batched_tokens": 256}
    # checked before the model loads: a name not known, and SplitFuse without chunked prefill
    assert main(["serve", "--chunk-policy", "fastgen"]) == 2
    assert "chunk_policy='fastgen'; choose one of ('sarathi', 'splitfuse')" in capsys.readouterr().err
    assert main(["serve", "--chunk-policy", "splitfuse"]) == 2
    assert "needs enable_chunked_prefill=True" in capsys.readouterr().err
