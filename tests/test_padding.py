"""minillm.padding: left padding and the slot counts of a static batch, checked by hand and against the engine."""

from __future__ import annotations

import pytest
import torch

from minillm.clock import SimClock
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, make_kv_manager, make_scheduler
from minillm.model.config import ModelConfig
from minillm.padding import (
    SlotCounts,
    pad_batch,
    padding_waste,
    static_batch_slots,
    static_batch_steps,
    static_run_slots,
)
from minillm.request import SamplingParams
from minillm.scheduler.base import ModelRunnerOutput


def test_pad_batch_pads_on_the_left_and_masks_the_pads():
    ids, mask = pad_batch([[5, 6, 7], [8], [9, 10]], pad_id=2)
    assert ids.dtype == torch.long and mask.dtype == torch.long
    assert ids.tolist() == [[5, 6, 7], [2, 2, 8], [2, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def test_pad_batch_of_one_and_of_equal_lengths_has_no_pads():
    ids, mask = pad_batch([[4]], pad_id=0)
    assert ids.tolist() == [[4]] and mask.tolist() == [[1]]
    ids, mask = pad_batch([[1, 2], [3, 4]], pad_id=0)
    assert mask.sum().item() == 4 and ids.tolist() == [[1, 2], [3, 4]]


def test_pad_batch_rejects_empty_input():
    with pytest.raises(ValueError):
        pad_batch([], pad_id=0)
    with pytest.raises(ValueError):
        pad_batch([[1], []], pad_id=0)


def test_static_batch_slots_by_hand():
    # B=2, S_max=3, O_max=4: prefill 2x3 = 6 slots (4 real), then 3 decode steps of 2 slots
    # (row 0 feeds 1 token, row 1 feeds 3): computed 12, useful 4 + 4 = 8, padding 4.
    counts = static_batch_slots([3, 1], [2, 4])
    assert counts == SlotCounts(computed_tokens=12, useful_tokens=8)
    assert counts.padding_tokens == 4
    assert padding_waste([3, 1], [2, 4]) == pytest.approx(1 / 3)


def test_static_batch_steps_by_hand():
    # Prefill 2x3 with 4 prompt tokens; decode steps 2..4 feed rows with o >= k: k=2 both, k=3,4 row 1 only.
    assert static_batch_steps([3, 1], [2, 4]) == [SlotCounts(6, 4), SlotCounts(2, 2), SlotCounts(2, 1),
                                                  SlotCounts(2, 1)]
    assert static_batch_steps([5], [1]) == [SlotCounts(5, 5)]  # one output token: the prefill step only
    lens = ([7, 1, 30, 4], [3, 12, 1, 5])
    assert sum(static_batch_steps(*lens), SlotCounts(0, 0)) == static_batch_slots(*lens)


def test_the_seeds_ten_and_four_thousand_token_batch():
    # One step (one output token each): 2 x 4000 slots, 4010 real. The 10-token row alone is
    # 3990/4000 = 99.75 % padding; the batch as a whole, 3990/8000.
    counts = static_batch_slots([10, 4000], [1, 1])
    assert counts.computed_tokens == 8000 and counts.padding_tokens == 3990
    assert counts.waste == pytest.approx(0.49875)
    assert 1 - 10 / 4000 == pytest.approx(0.9975)


def test_no_waste_without_a_length_spread():
    assert padding_waste([7], [5]) == 0.0
    assert padding_waste([4, 4, 4], [9, 9, 9]) == 0.0
    assert padding_waste([1], [1]) == 0.0


def test_static_batch_slots_rejects_bad_lengths():
    with pytest.raises(ValueError):
        static_batch_slots([3], [1, 2])
    with pytest.raises(ValueError):
        static_batch_slots([0], [1])


def test_static_run_slots_sums_fifo_batches():
    # Batches [3, 1 | 2] with outputs [2, 4 | 5]: 12/8 (above) + 1x(2+5-1) = 6/6.
    assert static_run_slots([3, 1, 2], [2, 4, 5], max_num_seqs=2) == SlotCounts(18, 14)


MODEL = ModelConfig(model_type="llama", vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position_embeddings=256, eos_token_ids=(2,))


class StandInExecutor:
    """Token 7 for every row that needs one; 1 ms per step. The padded plan is all we look at."""

    def execute(self, batch):
        rows = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens]
        return ModelRunnerOutput.from_rows(batch, rows, [7] * len(rows))

    def step_duration_s(self) -> float:
        return 0.001


def test_static_run_slots_predict_what_the_static_engine_records():
    prompt_lens = [5, 1, 17, 3, 3, 40, 2]
    output_lens = [4, 9, 1, 6, 6, 2, 11]
    config = EngineConfig(batching="static", max_num_seqs=3, max_model_len=128)
    resolved = config.resolve(MODEL.max_position_embeddings)
    kv = make_kv_manager(resolved, MODEL, allocate_pool=False)
    engine = LLMEngine(MODEL, config, kv=kv, scheduler=make_scheduler(resolved, kv), executor=StandInExecutor(),
                       clock=SimClock())
    engine.expect_more_requests = False
    for p, o in zip(prompt_lens, output_lens):
        engine.add_request({"prompt_token_ids": [5] * p}, SamplingParams(max_tokens=o, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    steps = engine.metrics.steps
    expected = static_run_slots(prompt_lens, output_lens, max_num_seqs=3)
    per_step = [c for i in range(0, 7, 3) for c in static_batch_steps(prompt_lens[i:i + 3], output_lens[i:i + 3])]
    assert [(s.num_computed_tokens, s.num_prefill_tokens + s.num_decode_tokens) for s in steps] == [
        (c.computed_tokens, c.useful_tokens) for c in per_step]
    assert sum(s.num_computed_tokens for s in steps) == expected.computed_tokens
    assert sum(s.num_padding_tokens for s in steps) == expected.padding_tokens
    assert engine.metrics.summary().padding_waste == pytest.approx(expected.waste, rel=1e-12)
    # Batches [5,1,17]x[4,9,1] -> 3*(17+9-1)=75; [3,3,40]x[6,6,2] -> 3*(40+6-1)=135; [2]x[11] -> 12.
    assert expected.computed_tokens == 75 + 135 + 12
