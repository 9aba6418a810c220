"""The worker's persistent input batch, rebuilt from nothing but the stream of plans (chapter 04).

vLLM V1's `gpu_input_batch.py` and `block_table.py` in small: every request the worker knows has
a stable row, kept until the plan says it finished (a preempted request keeps its row, its tokens
and its random stream). A row holds the request's token ids by position, its block table
(`minillm.kv.block_table.BlockTableBuffer`, padded with -1) and its sampling parameters as
numbers in arrays, so a step gathers the rows it runs with a few vectorized reads instead of
asking Python objects. Each plan changes the rows only by its diffs (`SchedulerOutput`):
requests new to the worker, tokens this step computes, blocks kept and appended, finished ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minillm.kv.block_table import BlockTableBuffer
from minillm.request import SamplingParams
from minillm.scheduler.output import NewRequestData, SchedulerOutput


@dataclass
class CachedRequestState:
    """What a worker keeps of one request: its constant facts and its random stream."""

    req_id: str
    row: int
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None  # None for greedy requests
    stop_token_ids: list[int]


class InputBatch:
    def __init__(self, max_blocks_per_seq: int, device: torch.device | str = "cpu", initial_rows: int = 16,
                 initial_len: int = 256) -> None:
        self.device = torch.device(device)
        self.block_table = BlockTableBuffer(max_blocks_per_seq, initial_rows)
        self.requests: dict[str, CachedRequestState] = {}
        self.token_ids = np.zeros((initial_rows, initial_len), dtype=np.int64)  # by position
        self.num_tokens = np.zeros(initial_rows, dtype=np.int64)  # known tokens of each row
        # Sampling parameters, one entry per row (vLLM keeps them as tensors the same way).
        self.temperature = np.ones(initial_rows, dtype=np.float64)
        self.greedy = np.ones(initial_rows, dtype=bool)
        self.top_k = np.zeros(initial_rows, dtype=np.int64)  # <= 0: no limit
        self.top_p = np.ones(initial_rows, dtype=np.float64)
        self.min_p = np.zeros(initial_rows, dtype=np.float64)
        self.repetition_penalty = np.ones(initial_rows, dtype=np.float64)
        self.frequency_penalty = np.zeros(initial_rows, dtype=np.float64)
        self.presence_penalty = np.zeros(initial_rows, dtype=np.float64)
        self.has_penalties = np.zeros(initial_rows, dtype=bool)
        self.min_tokens = np.zeros(initial_rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(initial_rows, dtype=np.int64)
        self.wants_logprobs = np.zeros(initial_rows, dtype=bool)
        # How many known requests need each non-greedy path: zero lets a step skip it without a look.
        self.num_random = self.num_penalized = self.num_min_tokens = self.num_logprobs = 0

    _ROW_ARRAYS = ("num_tokens", "temperature", "greedy", "top_k", "top_p", "min_p", "repetition_penalty",
                   "frequency_penalty", "presence_penalty", "has_penalties", "min_tokens", "num_prompt_tokens",
                   "wants_logprobs")

    # ---- applying a plan -------------------------------------------------------------------------
    def update(self, plan: SchedulerOutput) -> None:
        """Apply the plan's diffs: forget finished requests, add new ones, change block tables,
        write the tokens this step computes."""
        for rid in plan.finished_req_ids:
            self.remove(rid)
        for data in plan.new_requests:
            self.add(data)
        table = self.block_table
        for update in plan.block_updates:
            table.row(update.req_id)
            table.truncate(update.req_id, update.num_kept)
            if update.new_block_ids:
                table.append(update.req_id, update.new_block_ids)
        requests, spec = self.requests, plan.spec_token_ids
        token_ids, num_tokens, width = self.token_ids, self.num_tokens, self.token_ids.shape[1]
        for rid, start, tokens in zip(plan.req_ids, plan.num_computed_tokens, plan.new_token_ids):
            row = requests[rid].row
            if spec and spec.get(rid):  # guesses go where they belong if accepted (the next plan's counts say)
                self._write(row, start + len(tokens), spec[rid])
                token_ids, width = self.token_ids, self.token_ids.shape[1]
            if len(tokens) == 1 and start < width:  # a decode row: one scalar write
                token_ids[row, start] = tokens[0]
                num_tokens[row] = start + 1
            else:
                self._write(row, start, tokens)
                token_ids, width = self.token_ids, self.token_ids.shape[1]

    def _write(self, row: int, start: int, tokens: list[int]) -> None:
        end = start + len(tokens)
        if end > self.token_ids.shape[1]:
            grown = np.zeros((self.token_ids.shape[0], max(end, 2 * self.token_ids.shape[1])), dtype=np.int64)
            grown[:, : self.token_ids.shape[1]] = self.token_ids
            self.token_ids = grown
        self.token_ids[row, start:end] = tokens
        self.num_tokens[row] = end

    def add(self, data: NewRequestData) -> None:
        """A request new to this worker — or sent whole again after a failed step: then its row and
        random stream are kept, so what it samples does not depend on the failure."""
        old = self.requests.get(data.req_id)
        if old is not None:
            self._count(old, -1)
        row = self.block_table.row(data.req_id)
        if row >= len(self.num_tokens):
            self._grow(self.block_table.table.shape[0])
        p = data.sampling_params
        generator = old.generator if old is not None else None
        if generator is None and not p.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(data.seed)
        self.requests[data.req_id] = CachedRequestState(data.req_id, row, len(data.prompt_token_ids), p,
                                                        generator, list(data.stop_token_ids))
        self._count(self.requests[data.req_id], +1)
        if old is None:
            self._write(row, 0, data.prompt_token_ids)
        self.temperature[row] = p.temperature
        self.greedy[row] = p.greedy
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.has_penalties[row] = p.has_penalties
        self.min_tokens[row] = p.min_tokens if data.stop_token_ids else 0
        self.num_prompt_tokens[row] = len(data.prompt_token_ids)
        self.wants_logprobs[row] = p.logprobs is not None

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._count(state, -1)
            self.block_table.drop(req_id)

    def _count(self, state: CachedRequestState, sign: int) -> None:
        p = state.params
        self.num_random += sign * (not p.greedy)
        self.num_penalized += sign * p.has_penalties
        self.num_min_tokens += sign * bool(p.min_tokens and state.stop_token_ids)
        self.num_logprobs += sign * (p.logprobs is not None)

    def _grow(self, rows: int) -> None:
        for name in self._ROW_ARRAYS:
            old = getattr(self, name)
            new = np.zeros(rows, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        tokens = np.zeros((rows, self.token_ids.shape[1]), dtype=np.int64)
        tokens[: self.token_ids.shape[0]] = self.token_ids
        self.token_ids = tokens

    # ---- reading rows ----------------------------------------------------------------------------
    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        requests = self.requests
        return np.fromiter((requests[rid].row for rid in req_ids), np.int64, len(req_ids))

    def output_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()
