"""Compile at start-up, not in generate (minillm/worker/warm_up.py, issue 25 point 7).

The first test runs a fresh interpreter on a numba cache directory that starts empty, so every
kernel must really be compiled: it reads how many compiled versions each numba function of minillm
holds right after `LLM()` and again after generate calls that run prefill and decode at several
batch sizes. Compiling inside generate would add versions after `LLM()`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from minillm import LLM, SamplingParams

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from minillm import LLM, SamplingParams

    def compiled():
        from numba.core.dispatcher import Dispatcher
        out = {}
        for name, module in list(sys.modules.items()):
            if name.startswith(("minillm", "kernels")):
                for attr, value in list(vars(module).items()):
                    if isinstance(value, Dispatcher):
                        out[f"{name}.{attr}"] = len(value.overloads)
        return out

    cache = os.environ["NUMBA_CACHE_DIR"]
    t0 = time.perf_counter()
    llm = LLM(dtype="float32", max_num_seqs=8)
    t1 = time.perf_counter()
    after_start = compiled()
    files_after_start = sum(len(f) for _, _, f in os.walk(cache))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    llm.generate(["Once upon a time"], greedy, use_tqdm=False)
    t2 = time.perf_counter()
    llm.generate(["The cat sat on the", "A", "Hello there my friend, how are"] * 2, greedy, use_tqdm=False)
    t3 = time.perf_counter()
    llm.generate(["Once upon a time there was"], greedy, use_tqdm=False)
    t4 = time.perf_counter()
    print(json.dumps({"after_start": after_start, "after_generate": compiled(),
                      "files_after_start": files_after_start, "report": str(llm.engine.warm_up_report),
                      "llm_s": t1 - t0, "first_generate_s": t2 - t1, "batch_generate_s": t3 - t2,
                      "later_generate_s": t4 - t3}))
""")


def test_kernels_compile_in_llm_not_in_generate(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    start, after = result["after_start"], result["after_generate"]
    print(result["report"], {k: round(v, 3) for k, v in result.items() if k.endswith("_s")})
    assert "ran decode at batch sizes 1-8" in result["report"], result["report"]
    # what the CPU float32 step runs was compiled during LLM(), into the empty cache ...
    for name in ("minillm.worker.step_layout.layout_step", "minillm.kernels.cpu_decode_attention.paged_decode_f32"):
        assert start.get(name, 0) >= 1, f"{name} was not compiled in LLM(): {start}"
    assert result["files_after_start"] > 0, "nothing was written to the empty numba cache during LLM()"
    # ... and generate compiled nothing more
    grown = {k: (start.get(k, 0), v) for k, v in after.items() if v != start.get(k, 0)}
    assert not grown, f"compiled inside generate (versions before, after): {grown}"


def test_warm_up_leaves_no_trace():
    """The dummies are gone: blocks all free, no rows held, counters at zero, greedy text unchanged."""
    llm = LLM(dtype="float64", max_num_seqs=4, num_kv_blocks=64, max_model_len=256)
    runner = llm.engine.executor.worker
    assert not runner.input_batch.requests
    stats = llm.engine.executor.stats()
    assert stats.keys_read == stats.keys_exist == 0 and stats.model_time_s == 0.0, stats
    assert llm.engine.kv.num_free_blocks == 64
    assert float(runner.k_pool.abs().sum()) == 0.0 and float(runner.v_pool.abs().sum()) == 0.0
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    first = [o.outputs[0].token_ids for o in llm.generate(["Once upon a time", "A"], greedy, use_tqdm=False)]
    cold = LLM(dtype="float64", max_num_seqs=4, num_kv_blocks=64, max_model_len=256, batching="static")  # no warm-up: padded path
    assert cold.engine.warm_up_report.skipped
    again = [o.outputs[0].token_ids for o in cold.generate(["Once upon a time", "A"], greedy, use_tqdm=False)]
    assert first == again


@pytest.mark.parametrize("blocks", [2, 5])
def test_a_small_pool_warms_what_fits(blocks):
    llm = LLM(dtype="float64", max_num_seqs=32, num_kv_blocks=blocks, max_model_len=32, max_num_batched_tokens=32)
    report = llm.engine.warm_up_report
    assert report.skipped or report.max_batch < 32, str(report)
    out = llm.generate(["A"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    json.dumps(str(report))
