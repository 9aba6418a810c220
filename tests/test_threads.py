"""Threads chosen per step (minillm/worker/threads.py): the table's lookup, the cap, the knob, and the
engine's default following the rule (issue 29, item 4)."""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.worker.threads import THREADS_BY_TOKENS, StepThreads, threads_for

TABLE = {torch.float32: [(1, 1), (64, 2), (512, 4)]}


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("tokens", "available", "want"), [
    (1, 8, 1), (63, 8, 1), (64, 8, 2), (511, 8, 2), (512, 8, 4), (5000, 8, 4), (5000, 2, 2), (5000, 1, 1)])
def test_the_table_gives_threads_by_step_size_capped_by_what_torch_had(tokens, available, want):
    assert threads_for(tokens, torch.float32, available, TABLE) == want


def test_a_dtype_not_in_the_table_runs_on_one_thread():
    assert threads_for(10_000, torch.bfloat16, 8, TABLE) == 1


def test_the_default_table_is_what_bench_threads_measured_on_the_course_vm():
    """float32: a second thread from 1024 tokens on (the only size whose worst round paid); bfloat16 and
    float64 (nothing paid, or the parity tests' dtype): one thread for every step."""
    assert [threads_for(n, torch.float32, 2) for n in (1, 16, 256, 1023, 1024, 4096)] == [1, 1, 1, 1, 2, 2]
    assert threads_for(4096, torch.float32, 1) == 1  # never more than torch had at start
    assert all(threads_for(n, dtype, 64) == 1 for dtype in (torch.bfloat16, torch.float64) for n in (1, 256, 4096))


def test_bad_thread_counts_are_refused_with_what_is_accepted():
    with pytest.raises(ValueError, match="num_threads must be an integer >= 1"):
        EngineConfig(num_threads=0)
    with pytest.raises(ValueError, match="integer >= 1 or None"):
        StepThreads(torch.float32, num_threads=-2)


def test_the_engine_default_follows_the_rule_and_the_knob_overrides_it(restore_threads):
    torch.set_num_threads(2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    texts = ["In the beginning", "And the king said", "Blessed are", "Thus saith", "Now the serpent"]
    llm = LLM(max_num_seqs=8, max_model_len=128)
    llm.generate(texts, params, use_tqdm=False)
    assert torch.get_num_threads() == threads_for(5, torch.float32, 2) == 1
    torch.set_num_threads(2)
    fixed = LLM(max_num_seqs=8, max_model_len=128, num_threads=2)
    fixed.generate(texts, params, use_tqdm=False)
    assert torch.get_num_threads() == 2


def test_a_table_that_varies_sets_threads_per_step(monkeypatch, restore_threads):
    torch.set_num_threads(2)
    monkeypatch.setitem(THREADS_BY_TOKENS, torch.float32, [(1, 1), (64, 2)])
    threads = StepThreads(torch.float32)
    assert threads.per_step
    assert threads.apply(8) == 1 and torch.get_num_threads() == 1
    assert threads.apply(200) == 2 and torch.get_num_threads() == 2
    assert not StepThreads(torch.float32, num_threads=1).per_step and torch.get_num_threads() == 1  # set once


def test_bench_threads_turns_measured_speedups_into_the_table():
    """bench/threads.py's rule: a count pays where its worst round is >= 1.10x one thread, there and at
    every larger size measured (for every kind of step measured at a size)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("threads_bench_under_test", bench / "threads.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    paying = {2: [1.2, 1.3]}
    assert module.rule({8: [{2: [0.9, 1.4]}], 64: [paying], 256: [{2: [1.5, 1.6]}]}) == [(1, 1), (64, 2)]
    assert module.rule({8: [paying], 64: [{2: [1.05, 1.5]}], 256: [paying]}) == [(1, 1), (256, 2)]
    assert module.rule({64: [paying, {2: [0.5]}]}) == [(1, 1)]  # a decode step at 64 pays, a prefill does not
