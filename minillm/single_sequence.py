"""One sequence through the model, with and without a KV cache (chapters 00–01).

`full_logits` recomputes the whole sequence, as a model without a cache must do at every step;
`incremental_logits` prefills once and then feeds one token at a time, reading every earlier
token's K/V from the cache. Chapter 01 times both; the parity tests use both to compare with
HF transformers.
"""

from __future__ import annotations

import torch

from minillm.attention.flat_pool import FlatPoolAttention
from minillm.kv.slab import SlabKVManager
from minillm.model.llama import LlamaModel
from minillm.request import Request, RequestStatus, SamplingParams
from minillm.scheduler.base import SchedulerPlan
from minillm.scheduler.output import SchedulerOutputBuilder
from minillm.worker.model_runner import ModelRunner


class SingleSequence:
    """A model plus a one-slab KV cache: feed tokens, get logits for each fed token."""

    def __init__(self, model: LlamaModel, max_len: int | None = None) -> None:
        c = model.config
        self.model = model
        self.kv = SlabKVManager(c.num_layers, c.num_kv_heads, c.head_dim, num_slabs=1,
                                slab_len=max_len or model.rope.max_positions, dtype=model.dtype,
                                device=str(model.device))
        self.runner = ModelRunner(model, self.kv.cache_spec)
        self.plans = SchedulerOutputBuilder(self.kv)
        self.request = Request("single", [], SamplingParams(max_tokens=1, temperature=0.0), 0.0)

    def reset(self) -> None:
        self.kv.free(self.request)
        self.request.status = RequestStatus.FINISHED_ABORTED  # the worker forgets it at the next plan
        self.request = Request("single", [], SamplingParams(max_tokens=1, temperature=0.0), 0.0)

    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` to the sequence; logits [len(token_ids), vocab], one row per fed token."""
        req = self.request
        req.all_token_ids.extend(token_ids)
        if not self.kv.allocate(req, len(token_ids)):
            raise RuntimeError("the single-sequence KV slab is full")
        plan = self.plans.build(SchedulerPlan([req], [len(token_ids)]))
        self.runner.update_state(plan)  # a fresh slab is zeroed before first use
        inputs = self.runner.prepare(plan)
        attention = FlatPoolAttention(self.runner.k_pool, self.runner.v_pool, inputs.meta,
                                      self.model.config.sliding_windows)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, attention).hidden
        req.num_computed_tokens += len(token_ids)  # no scheduler here: this class is its own
        return self.model.compute_logits(hidden)


def full_logits(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """Logits [n, vocab] of a whole sequence computed from scratch (no cache reused)."""
    return SingleSequence(model, len(token_ids)).feed(token_ids)


def incremental_logits(model: LlamaModel, token_ids: list[int], prefill_len: int) -> torch.Tensor:
    """Same logits, but only the first `prefill_len` tokens are computed together; the rest are
    decoded one by one against the KV cache."""
    seq = SingleSequence(model, len(token_ids))
    rows = [seq.feed(token_ids[:prefill_len])]
    rows += [seq.feed([t]) for t in token_ids[prefill_len:]]
    return torch.cat(rows)
