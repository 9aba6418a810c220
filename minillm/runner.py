"""From a scheduler's plan to model inputs, logits and sampled tokens (chapter 04).

The runner only builds tensors and reports what it sampled; it never changes a request (the
scheduler's `update_from_output` does that with the `ModelRunnerOutput` returned here). For a step
it flattens the new tokens of every planned request into one ragged batch (`input_ids[T]`,
`positions[T]`), reads where their K/V go and where each request's keys live from the KV
manager's persistent block tables (`slot_mapping[T]`, `block_tables[B, max_blocks]`,
`query_start_loc`, `seq_lens`), runs the model, and samples the rows that need a next token: the
last new token of each request that has caught up with its known tokens (a prefill chunk that
does not reach the end samples nothing).

Before the forward it carries out the plan's KV moves: swap-out copies (device → host), zeroing
of freshly handed-out blocks, swap-in copies (host → device).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from minillm.attention.flat_pool import AttentionMetadata, RowGroup
from minillm.attention.padded import PaddedAttention
from minillm.attention.select import make_attention, resolve_backend
from minillm.kv.base import KVManager
from minillm.model.llama import LlamaModel
from minillm.request import Request
from minillm.sampling import sample, sampled_logprobs
from minillm.scheduler.base import ModelRunnerOutput, ScheduledBatch
from minillm.spec.rejection import rejection_sample

# Rows share one attention call while the keys it reads stay within this factor of the keys
# they have (in blocks); beyond it a new group starts. Grouping trades padded reads for calls.
KEY_READ_SLACK = 1.25


def group_by_length(num_blocks: list[int], slack: float = KEY_READ_SLACK) -> list[tuple[int, int]]:
    """Split rows sorted by length (longest first) into runs [start, end) whose padded reads
    (rows × longest) stay within `slack` × their real block counts."""
    groups, start, total = [], 0, 0
    for i, nb in enumerate(num_blocks):
        if i > start and (i - start + 1) * num_blocks[start] > slack * (total + nb):
            groups.append((start, i))
            start, total = i, 0
        total += nb
    if num_blocks:
        groups.append((start, len(num_blocks)))
    return groups


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVManager, attention_backend: str = "auto") -> None:
        self.model = model
        self.kv = kv
        self.attention_backend = resolve_backend(attention_backend, model.device, model.dtype)
        self.keys_read = 0  # decode attention, over the runner's life: keys gathered ...
        self.keys_exist = 0  # ... and keys the rows really have
        self.model_time_s = 0.0  # wall time in the model's forward and lm_head (CPU; a GPU would need syncs)

    # ---- inputs ------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(input_ids [T], positions [T], attention metadata, flattened rows that need logits).

        Rows are reordered for attention — decode rows longest first, then the rest longest first —
        and `self.last_order[j]` is the plan index of flattened sequence j; the logits rows come
        in plan order (`self.last_sampled` holds their plan indices)."""
        device, kv, bs = self.model.device, self.kv, self.kv.block_size
        reqs, counts = batch.requests, batch.num_new_tokens
        starts = [r.num_computed_tokens for r in reqs]
        lens = [s + n for s, n in zip(starts, counts)]
        decode = sorted((i for i in range(len(reqs)) if counts[i] == 1 and starts[i] > 0), key=lambda i: -lens[i])
        multi = sorted((i for i in range(len(reqs)) if not (counts[i] == 1 and starts[i] > 0)), key=lambda i: -lens[i])
        order = decode + multi
        token_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        row_of_plan = [0] * len(reqs)
        spec = batch.spec_token_ids
        for j, i in enumerate(order):
            req, s, n = reqs[i], starts[i], counts[i]
            row_of_plan[i] = j
            if n == 1:
                token_ids.append(req.all_token_ids[s])
                positions.append(s)
            else:
                guesses = spec.get(req.request_id, ())
                token_ids.extend(req.all_token_ids[s : s + n - len(guesses)])
                token_ids.extend(guesses)  # a speculative row: the pending token, then k unverified guesses
                positions.extend(range(s, s + n))
            query_start.append(query_start[-1] + n)
        # Rows that need logits: the last of each request that caught up with its tokens, and for a
        # speculative row all 1+k of them (the target's verdict on every guess, and the bonus).
        sampled = [i for i in range(len(reqs)) if lens[i] == reqs[i].num_tokens + len(spec.get(reqs[i].request_id, ()))]
        logits_rows: list[int] = []
        self.last_spans = []
        for i in sampled:
            end = query_start[row_of_plan[i] + 1]
            width = 1 + len(spec.get(reqs[i].request_id, ()))
            self.last_spans.append((len(logits_rows), width))
            logits_rows.extend(range(end - width, end))

        row_ids = np.fromiter((kv.block_table.row_of[reqs[i].request_id] for i in order), np.int64, len(order))
        seq_lens = np.fromiter((lens[i] for i in order), np.int64, len(order))
        q_lens = np.fromiter((counts[i] for i in order), np.int64, len(order))
        width = int(-(-seq_lens.max() // bs))
        tables = kv.block_table.gather(row_ids, width)
        pos = np.asarray(positions, dtype=np.int64)
        token_row = np.repeat(np.arange(len(order)), q_lens)
        slot_mapping = tables[token_row, pos // bs].astype(np.int64) * bs + pos % bs
        safe_tables = np.where(tables < 0, kv.null_block, tables).astype(np.int64)

        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(tables).to(device),
            num_decode=len(decode), block_size=bs, num_tokens=len(token_ids))
        blocks_of = -(-seq_lens // bs)
        nd = len(decode)
        for start, end in group_by_length(blocks_of[:nd].tolist()):
            meta.decode_groups.append(self._group(start, end, seq_lens, blocks_of, safe_tables, device))
        self.keys_read += sum(g.num_rows * g.key_len for g in meta.decode_groups)
        self.keys_exist += int(seq_lens[:nd].sum())
        fresh = [j for j in range(nd, len(order)) if seq_lens[j] == q_lens[j]]
        cached = [j for j in range(nd, len(order)) if seq_lens[j] != q_lens[j]]
        windowed = any(w is not None for w in self.model.config.sliding_windows)
        for j in fresh:
            g = self._group(j, j + 1, seq_lens, blocks_of, safe_tables, device)
            g.fresh_causal, g.token_slice = True, slice(query_start[j], query_start[j + 1])
            if windowed:  # a sliding-window layer cannot take the plain causal path: give it the general form
                g.q_max, g.query_lens = int(q_lens[j]), torch.tensor([[int(q_lens[j])]], device=device)
                g.query_index, g.valid = self._query_rows([j], query_start, q_lens, device)
                g.out_index = g.query_index
            meta.prefill_groups.append(g)
        work = [int(q_lens[j] * blocks_of[j]) for j in cached]
        for a, b in group_by_length(work):
            rows = cached[a:b]
            g = self._group(rows[0], rows[0] + 1, seq_lens, blocks_of, safe_tables, device, rows)
            g.q_max = int(q_lens[rows].max())
            g.query_lens = torch.from_numpy(q_lens[rows][:, None]).to(device)
            g.query_index, g.valid = self._query_rows(rows, query_start, q_lens, device, g.q_max)
            g.out_index = g.query_index[g.valid]
            meta.prefill_groups.append(g)
        self.last_order, self.last_sampled = order, sampled
        return (torch.tensor(token_ids, device=device), torch.tensor(positions, device=device), meta, logits_rows)

    def _group(self, start: int, end: int, seq_lens: np.ndarray, blocks_of: np.ndarray, tables: np.ndarray,
               device: torch.device, rows: list[int] | None = None) -> RowGroup:
        """A group of sequences `rows` (default: start … end-1) reading the longest one's blocks each.
        One block or less (always so for a slab) is read only as far as the longest row goes."""
        rows = list(range(start, end)) if rows is None else rows
        nb = int(blocks_of[rows].max())
        key_len = int(seq_lens[rows].max()) if nb == 1 else nb * self.kv.block_size
        ids = torch.from_numpy(np.ascontiguousarray(tables[rows, :nb]).reshape(-1)).to(device)
        return RowGroup(first_row=start, num_rows=len(rows), key_len=key_len, block_ids=ids,
                        seq_lens=torch.from_numpy(seq_lens[rows][:, None]).to(device))

    @staticmethod
    def _query_rows(rows: list[int], query_start: list[int], q_lens: np.ndarray, device: torch.device,
                    q_max: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_max = q_max or int(q_lens[rows].max())
        idx = np.zeros((len(rows), q_max), dtype=np.int64)
        valid = np.zeros((len(rows), q_max), dtype=bool)
        for k, j in enumerate(rows):
            n = int(q_lens[j])
            idx[k, :n] = np.arange(query_start[j], query_start[j] + n)
            idx[k, n:] = query_start[j]
            valid[k, :n] = True
        return torch.from_numpy(idx.reshape(-1)).to(device), torch.from_numpy(valid.reshape(-1)).to(device)

    # ---- one step ------------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run one step; per planned request, the token ids it sampled (and their logprobs)."""
        if batch.padded is not None:
            logits, rows = self.compute_padded_logits(batch)
            sampled_idx = list(range(len(batch.requests)))
        else:
            self.apply_kv_moves(batch)
            logits, rows = self.compute_logits(batch)
            sampled_idx = self.last_sampled
            if batch.spec_token_ids:
                return self._verify(batch, logits, rows, sampled_idx)
        tokens = sample(logits, rows)
        out: list[list[int]] = [[] for _ in batch.requests]
        for i, t in zip(sampled_idx, tokens):
            out[i] = [t]
        logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            logprobs = [None] * len(batch.requests)
            for i, lp in zip(sampled_idx, sampled_logprobs(logits, rows, tokens)):
                logprobs[i] = lp
        return ModelRunnerOutput(out, logprobs)

    def _verify(self, batch: ScheduledBatch, logits: torch.Tensor, rows: list[Request],
                sampled_idx: list[int]) -> ModelRunnerOutput:
        """A step with speculative rows: plain rows sample as usual, speculative rows go through the
        rejection sampler (0 … k guesses accepted, then a correction or the bonus token)."""
        out: list[list[int]] = [[] for _ in batch.requests]
        logprobs: list | None = None
        if any(r.params.logprobs is not None for r in rows):
            logprobs = [None] * len(batch.requests)
        plain = [(j, i) for j, i in enumerate(sampled_idx) if batch.requests[i].request_id not in batch.spec_token_ids]
        if plain:
            first = torch.tensor([self.last_spans[j][0] for j, _ in plain], dtype=torch.long, device=logits.device)
            plain_logits, plain_rows = logits.index_select(0, first), [rows[j] for j, _ in plain]
            tokens = sample(plain_logits, plain_rows)
            lps = sampled_logprobs(plain_logits, plain_rows, tokens) if logprobs is not None else [None] * len(plain)
            for (_, i), t, lp in zip(plain, tokens, lps):
                out[i] = [t]
                if logprobs is not None:
                    logprobs[i] = lp
        for j, i in enumerate(sampled_idx):
            req = batch.requests[i]
            guesses = batch.spec_token_ids.get(req.request_id)
            if guesses:
                start, width = self.last_spans[j]
                q = req.spec_draft_probs
                out[i] = rejection_sample(req, logits[start : start + width], guesses,
                                          None if q is None else q[: len(guesses)])
                if logprobs is not None and req.params.logprobs is not None:
                    # the target's logprobs at each emitted position (before temperature, as for plain rows)
                    m = len(out[i])
                    logprobs[i] = [e[0] for e in sampled_logprobs(logits[start : start + m], [req] * m, out[i])]
        return ModelRunnerOutput(out, logprobs)

    def apply_kv_moves(self, batch: ScheduledBatch) -> None:
        """The plan's KV moves, in the only safe order: copy victims out before their blocks are
        zeroed or rewritten, zero fresh blocks, then copy swapped-in requests back."""
        kv = self.kv
        for rid, blocks in batch.blocks_to_swap_out:
            kv.copy_out(rid, blocks)
        if kv.fresh_blocks:
            fresh = torch.tensor(kv.fresh_blocks, dtype=torch.long, device=kv.k_pool.device)
            for pool in (kv.k_pool, kv.v_pool):
                pool.view(pool.shape[0], -1, kv.block_size * pool.shape[2] * pool.shape[3]).index_fill_(1, fresh, 0)
            kv.fresh_blocks.clear()
        for rid, blocks in batch.blocks_to_swap_in:
            kv.copy_in(rid, blocks)

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
        last = torch.tensor([i * width + width - 1 for i in live_rows], dtype=torch.long, device=device)
        start = time.perf_counter()
        hidden = self.model.forward(ids.to(device).flatten(), positions.flatten(), attention, output_rows=last)
        attention.finish_step()
        logits = self.model.compute_logits(hidden)
        self.model_time_s += time.perf_counter() - start
        return logits, [step.rows[i] for i in live_rows]

    def step_duration_s(self) -> float:
        """Time to charge a simulated clock for the last step: 0, real time passes by itself."""
        return 0.0

    def compute_logits(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """Run the model; return logits [N, vocab] and the request each row belongs to (plan order)."""
        input_ids, positions, meta, logits_rows = self.prepare(batch)
        attention = make_attention(self.attention_backend, self.kv.k_pool, self.kv.v_pool, meta,
                                   self.model.config.sliding_windows)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=input_ids.device)
        start = time.perf_counter()
        hidden = self.model.forward(input_ids, positions, attention, output_rows=rows)
        logits = self.model.compute_logits(hidden)
        self.model_time_s += time.perf_counter() - start
        return logits, [batch.requests[i] for i in self.last_sampled]
