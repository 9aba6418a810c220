"""bench/step_profile.py classifies the ops that really run (issue 31): profile a short generate of
the bundled model in float32 and in float64 and check that every matmul-like op the profiler saw
lands in the matmul category, and that matmuls are a real share of the model's time."""

from __future__ import annotations

import pytest
import torch
from conftest import load_bench
from torch.profiler import ProfilerActivity, profile

from minillm import LLM, SamplingParams


def looks_like_a_matmul(name: str) -> bool:
    """(oneDNN's `_reorder_linear_weight` packs a weight once; it multiplies nothing.)"""
    return ("linear" in name and "reorder" not in name) or name.split("::")[-1] in ("mm", "addmm", "bmm", "matmul",
                                                                                     "baddbmm")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matmul_ops_are_classified_as_matmuls(dtype):
    step_profile = load_bench("step_profile")
    llm = LLM(dtype=dtype, max_num_seqs=4, max_model_len=256)
    llm.engine.executor.worker.compiled_decode = None  # the op-by-op forward, whose ops are classified
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(["Once upon a time", "The cat", "A"], SamplingParams(max_tokens=6, temperature=0.0),
                     use_tqdm=False)
    seen = {e.key for e in prof.key_averages() if e.self_cpu_time_total > 0}
    matmul_label = step_profile.CATEGORIES[0][0]
    unclassified = sorted(name for name in seen if looks_like_a_matmul(name) and name not in step_profile.MATMUL_OPS)
    assert not unclassified, f"matmul-like ops the step profile would call 'other': {unclassified}"
    seconds = step_profile.categorize(prof)
    share = seconds[matmul_label] / sum(seconds.values())
    assert share > 0.2, f"matmuls are only {share:.1%} of the profiled time in {dtype}: {dict(seconds)}"
    if dtype == "float32" and torch.backends.mkldnn.is_available():
        assert "mkldnn::_linear_pointwise" in seen
