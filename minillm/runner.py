"""From a scheduler's plan to model inputs and logits (chapter 04).

The runner only builds tensors: it flattens the new tokens of every scheduled request into one
ragged batch (`input_ids[T]`, `positions[T]`), asks the KV manager where their K/V go
(`slot_mapping[T]`) and where each request's keys live (`key_index`), runs the model, and keeps
the logits of the rows that need a next token: the last new token of each request that has
caught up with its known tokens (a prefill chunk that does not reach the end samples nothing).
"""

from __future__ import annotations

import torch

from minillm.attention.flat_pool import AttentionMetadata, FlatPoolAttention, PrefillSpan
from minillm.attention.padded import PaddedAttention
from minillm.kv.base import KVManager
from minillm.model.llama import LlamaModel
from minillm.request import Request
from minillm.sampling import sample
from minillm.scheduler.base import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVManager) -> None:
        self.model = model
        self.kv = kv

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(input_ids [T], positions [T], attention metadata, flattened rows that need logits)."""
        device = self.model.device
        token_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_reqs: list[Request] = []
        decode_lens: list[int] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            token_start = len(token_ids)
            token_ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if start + n == req.num_tokens:
                logits_rows.append(len(token_ids) - 1)
            if n == 1 and start > 0:
                decode_reqs.append(req)
                decode_lens.append(start + 1)
            else:
                key_index = self.kv.key_index([req], [start + n])[0]
                prefills.append(PrefillSpan(token_start, n, key_index.to(device)))
        meta = AttentionMetadata(
            slot_mapping=self.kv.slot_mapping(batch.requests, batch.num_new_tokens).to(device),
            num_decode=len(decode_reqs),
            decode_key_index=self.kv.key_index(decode_reqs, decode_lens).to(device) if decode_reqs else None,
            decode_context_lens=torch.tensor(decode_lens, device=device) if decode_reqs else None,
            prefills=prefills,
        )
        return (torch.tensor(token_ids, device=device), torch.tensor(positions, device=device), meta, logits_rows)

    def execute(self, batch: ScheduledBatch) -> tuple[list[Request], list[int]]:
        """Run one step: the requests that get a next token, and those tokens."""
        if batch.padded is not None:
            logits, rows = self.compute_padded_logits(batch)
        else:
            logits, rows = self.compute_logits(batch)
        return rows, sample(logits, rows)

    def compute_padded_logits(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """A static/dynamic step: every row of the rectangle is computed, pads and finished rows too."""
        step, cache, device = batch.padded, self.kv.cache, self.model.device
        width = step.num_new
        ids = torch.zeros(len(step.rows), width, dtype=torch.long)
        is_real = torch.zeros(len(step.rows), width, dtype=torch.bool)
        live_rows = []
        for i, req in enumerate(step.rows):
            if req.status.finished:
                continue  # a finished row computes a dummy token that nobody reads
            new = req.all_token_ids[req.num_computed_tokens : req.num_computed_tokens + width]
            ids[i, width - len(new):] = torch.tensor(new)
            is_real[i, width - len(new):] = True
            live_rows.append(i)
        attention = PaddedAttention(cache, width, is_real.to(device), self.model.config.sliding_windows)
        # Positions count real tokens only, as HF derives them from the attention mask.
        real_so_far = cache.is_real[:, : cache.length + width].long().cumsum(-1)[:, -width:]
        positions = (real_so_far - 1).clamp(min=0)
        hidden = self.model.forward(ids.to(device).flatten(), positions.flatten(), attention)
        attention.finish_step()
        last = torch.tensor([i * width + width - 1 for i in live_rows], device=device)
        return self.model.compute_logits(hidden.index_select(0, last)), [step.rows[i] for i in live_rows]

    def step_duration_s(self) -> float:
        """Time to charge a simulated clock for the last step: 0, real time passes by itself."""
        return 0.0

    def compute_logits(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """Run the model; return logits [N, vocab] and the request each row belongs to."""
        input_ids, positions, meta, logits_rows = self.prepare(batch)
        attention = FlatPoolAttention(self.kv.k_pool, self.kv.v_pool, meta, self.model.config.sliding_windows)
        hidden = self.model.forward(input_ids, positions, attention)
        rows = torch.tensor(logits_rows, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        sampled_reqs = [r for r, n in zip(batch.requests, batch.num_new_tokens)
                        if r.num_computed_tokens + n == r.num_tokens]
        return logits, sampled_reqs
