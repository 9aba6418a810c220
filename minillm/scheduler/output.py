"""The plan as data: what crosses from the engine core to a worker each step (chapter 04).

A scheduler plans with live `Request` objects (`SchedulerPlan`, `minillm.scheduler.base`); a
worker — in this process today, in another process or on another rank tomorrow — must never see
them. `SchedulerOutputBuilder` turns each `SchedulerPlan` into a `SchedulerOutput` holding request
ids and plain values only, as vLLM V1's `SchedulerOutput` does:

- a request the worker has not seen arrives once as `NewRequestData` (prompt ids, sampling
  parameters, its seed, stop token ids, block ids);
- after that, each step carries only diffs: how many tokens are scheduled and the tokens
  themselves, where its computed tokens end, blocks kept and blocks appended (a block table only
  grows at its end, or is cut back: speculative rejection, preemption, a failed step);
- finished ids (the worker forgets them), KV moves (swap out, zero, swap in), and the per-row facts
  every consumer needs — is it a decode row, does it sample — computed here, once;
- a KV connector's orders (`kv_connector_metadata`: which remote blocks to load into which local
  ones), written by its scheduler side, read by its worker side on every rank.

A worker that sees only the stream of plans can rebuild everything it needs: `minillm.worker`.
The builder keeps what it has told the worker (tokens are not needed: each step sends the tokens
it computes), so a diff is a comparison of two short lists. If a step fails, `invalidate` forgets
what that plan told, and the next plan sends those requests whole again.

A steady decode step — the scheduler's `SchedulerPlan.steady`, the same object handed out again
while the same requests each decode one token — is not built again: the builder updates the
`SchedulerOutput` it made for it (where each row starts, its token, a block it grew into) and hands
the worker that same object, which keeps the rows it found for it. It is the engine's analogue of
replaying a captured CUDA graph: a batch-1 decode step makes ~87 Python calls instead of ~112 (issue 29).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minillm.request import Request, RequestStatus, SamplingParams
from minillm.scheduler.base import SchedulerPlan


@dataclass
class NewRequestData:
    """A request's constant facts, sent the first time a worker sees it (again after a failed step)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # a dataclass of plain values
    seed: int  # the seed of its random stream (params.seed, or one derived from the engine seed and id)
    stop_token_ids: list[int]  # what min_tokens masks: stop token ids plus EOS unless ignore_eos


@dataclass
class BlockUpdate:
    """A block-table row's change: keep its first `num_kept` blocks, then append `new_block_ids`."""

    req_id: str
    num_kept: int
    new_block_ids: list[int]


@dataclass
class PaddedStepData:
    """A static/dynamic step: the whole padded rectangle (`minillm.scheduler.static.PaddedStep`)."""

    row_req_ids: list[str]  # every row of the batch, finished ones too
    row_token_ids: list[list[int]]  # per row, its real new tokens ([] for a finished row)
    width: int  # query tokens per row: the padded prompt length, then 1
    is_prefill: bool
    max_len: int  # slots per row of the batch's cache (set when the batch starts)


@dataclass
class SchedulerOutput:
    """One step's plan as data (vLLM's `SchedulerOutput`): what the scheduler's own plan
    (`SchedulerPlan`, live requests) becomes for the workers. Rows are in plan order (decode rows first)."""

    new_requests: list[NewRequestData]
    req_ids: list[str]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]  # per row, the tokens already in the cache (where its new ones start)
    new_token_ids: list[list[int]]  # per row, the known tokens it computes this step (guesses not included)
    is_decode: list[bool]  # one new token after a computed context
    samples: list[bool]  # reaches the end of its known tokens: the step samples its next token(s)
    block_updates: list[BlockUpdate] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: request id -> guesses after its pending token, and their draft
    # distributions [k, vocab] (None: one-hot, as n-gram lookup's).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_draft_probs: dict[str, Any] = field(default_factory=dict)
    # KV moves, done in this order before the forward.
    blocks_to_swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    blocks_to_zero: list[int] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[str, list[int]]] = field(default_factory=list)
    padded: PaddedStepData | None = None
    num_padding_tokens: int = 0
    # A KV connector's orders for every worker's connector side (minillm.kv_transfer.base.KVConnectorMetadata):
    # the scheduler side writes them, each rank reads them and moves its own share of the blocks.
    kv_connector_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


def new_request_data(req: Request) -> NewRequestData:
    return NewRequestData(req.request_id, list(req.prompt_token_ids), req.params, req.seed,
                          sorted(req.stop_token_ids))


class SchedulerOutputBuilder:
    """Driver side: turns a scheduler's `SchedulerPlan` into the `SchedulerOutput` a worker reads.

    `kv` is the scheduler's KV manager; the builder reads its block tables (`block_ids_of`) and
    takes the blocks it handed out since the last plan (`take_fresh_blocks`), which the worker zeroes."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.sent_blocks: dict[str, list[int]] = {}  # what the worker holds, per request it knows
        self.known: dict[str, Request] = {}  # requests the worker holds state for
        self.orphans: dict[str, Request] = {}  # told by a failed plan: the worker may hold them
        # The last plan built and what it became: a steady plan handed out again (SchedulerPlan.steady)
        # is updated in place (`_replay`), not built again.
        self._last: tuple[SchedulerPlan, SchedulerOutput] | None = None

    def build(self, batch: SchedulerPlan) -> SchedulerOutput:
        last = self._last
        if last is not None and last[0] is batch and batch.steady:
            return self._replay(batch, last[1])
        plan = self._build(batch)
        self._last = (batch, plan)
        return plan

    def _replay(self, batch: SchedulerPlan, plan: SchedulerOutput) -> SchedulerOutput:
        """The steady plan of the step before, again: the same requests, one decode token each, nothing
        new, finished or moved since (a request finishing or leaving changes the scheduler's plan). Only
        where each row starts, its token and its blocks change. (The worker has applied the previous
        step's diffs before this is called: a step runs to its end before the next is planned.)"""
        starts, tokens = plan.num_computed_tokens, plan.new_token_ids
        for i, req in enumerate(batch.requests):
            starts[i] = req.num_computed_tokens
            tokens[i] = req.all_token_ids[-1:]
        if plan.block_updates or plan.new_requests or plan.finished_req_ids:  # (told once, by the first build)
            plan.block_updates, plan.new_requests, plan.finished_req_ids = [], [], []
        plan.blocks_to_zero = self.kv.take_fresh_blocks()
        if plan.blocks_to_zero:  # a row crossed into a new block: its table grew (the only change it can have)
            self._diff_blocks(batch.requests, plan)
        return plan

    def _build(self, batch: SchedulerPlan) -> SchedulerOutput:
        running = RequestStatus.RUNNING  # (most known requests run: no property call for them, every step)
        finished = [rid for rid, r in self.known.items() if r.status is not running and r.status.finished]
        for rid in finished:
            del self.known[rid]
            self.sent_blocks.pop(rid, None)
        if self.orphans:
            gone = [rid for rid, r in self.orphans.items() if r.status.finished]
            for rid in gone:
                del self.orphans[rid]
            finished += gone
        spec = batch.spec_token_ids
        reqs = batch.requests
        plan = SchedulerOutput(
            new_requests=[], req_ids=[r.request_id for r in reqs], num_scheduled_tokens=list(batch.num_new_tokens),
            num_computed_tokens=[r.num_computed_tokens for r in reqs], new_token_ids=[], is_decode=[], samples=[],
            finished_req_ids=finished, spec_token_ids=dict(spec),
            blocks_to_swap_out=list(batch.blocks_to_swap_out), blocks_to_swap_in=list(batch.blocks_to_swap_in),
            num_padding_tokens=batch.num_padding_tokens, kv_connector_metadata=batch.kv_connector_metadata)
        known, new_token_ids, is_decode, samples = self.known, plan.new_token_ids, plan.is_decode, plan.samples
        for req, n in zip(reqs, batch.num_new_tokens):
            if req.request_id not in known:
                self._introduce(req, plan)
            start = req.num_computed_tokens
            tokens = req.all_token_ids
            guesses = spec.get(req.request_id, ()) if spec else ()
            new_token_ids.append(tokens[start : start + n - len(guesses)])
            is_decode.append(n == 1 and start > 0)
            samples.append(start + n == len(tokens) + len(guesses))
            if guesses:
                plan.spec_draft_probs[req.request_id] = (
                    None if req.spec_draft_probs is None else req.spec_draft_probs[: len(guesses)])
        if batch.padded is not None:
            step = batch.padded
            for req in step.rows:
                self._introduce(req, plan)
            plan.padded = PaddedStepData(
                [r.request_id for r in step.rows],
                [[] if r.status.finished else
                 r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + step.num_new] for r in step.rows],
                step.num_new, step.is_prefill, self.kv.max_len)
        else:
            self._diff_blocks(reqs, plan)
            plan.blocks_to_zero = self.kv.take_fresh_blocks()
        return plan

    def _introduce(self, req: Request, plan: SchedulerOutput) -> None:
        if req.request_id not in self.known and not req.status.finished:  # a finished padded row needs nothing
            self.orphans.pop(req.request_id, None)
            self.known[req.request_id] = req
            plan.new_requests.append(new_request_data(req))

    def _diff_blocks(self, reqs: list[Request], plan: SchedulerOutput) -> None:
        """Block-table changes of the planned requests since the worker last heard of them. A
        request swapped in is planned too, so every row the worker reads this step is current."""
        block_ids_of, sent_blocks = self.kv.block_ids_of, self.sent_blocks
        for req in reqs:
            rid = req.request_id
            table = block_ids_of(rid)
            sent = sent_blocks.get(rid)
            if sent == table:
                continue
            kept = 0
            if sent is not None:
                limit = min(len(sent), len(table))
                while kept < limit and sent[kept] == table[kept]:
                    kept += 1
            plan.block_updates.append(BlockUpdate(rid, kept, table[kept:]))
            self.sent_blocks[rid] = list(table)

    def invalidate(self, plan: SchedulerOutput) -> None:
        """The step failed, maybe before the worker received it: forget what it told, so the next
        plan sends those requests whole (the worker keeps a request's random stream across this)."""
        self._last = None  # the next plan is built whole, whatever it is
        ids = plan.req_ids + (plan.padded.row_req_ids if plan.padded is not None else [])
        for rid in ids:
            req = self.known.pop(rid, None)
            if req is not None:
                self.orphans[rid] = req
            self.sent_blocks.pop(rid, None)
