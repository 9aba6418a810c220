"""bench/step_profile.py classifies the ops that really run (issue 31): profile a short generate of
the bundled model in float32 and in float64 and check that every matmul-like op the profiler saw
lands in the matmul category, that matmuls are a real share of the model's time, and that the
share the bench computes is the one torch.profiler's own printed table gives."""

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


def matmul_share_of_torch_table(prof) -> float:
    """The matmuls' share read off torch.profiler's own printed table: torch's `Self CPU %` column summed
    over the rows whose op name looks like a matmul (the reading a reader of that table would make)."""
    lines = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=-1).splitlines()
    header = next(i for i, line in enumerate(lines) if "Self CPU %" in line)
    end = lines[header].index("Self CPU %") + len("Self CPU %")  # the column's values are right-aligned under it
    percent, rows = 0.0, 0
    for line in lines[header + 1:]:
        words = line.split()
        if not words or set(line.replace(" ", "")) <= {"-"} or line.startswith("Self CPU time total"):
            continue
        rows += 1
        if looks_like_a_matmul(words[0]):
            percent += float(line[:end].split()[-1].rstrip("%"))
    assert rows > 10, "\n".join(lines[:20])  # the table was read
    return percent / 100


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
    # The bench's share (its "profiled" column) is torch's own table's, to its rounding (0.01 % a row).
    in_table = matmul_share_of_torch_table(prof)
    assert abs(share - in_table) < 0.001, f"step_profile says {share:.2%}, torch's table {in_table:.2%}"
    if dtype == "float32" and torch.backends.mkldnn.is_available():
        assert "mkldnn::_linear_pointwise" in seen
