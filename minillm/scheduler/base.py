"""The plan a scheduler hands the engine each step, what comes back, and who writes what (chapter 04).

One step, one owner per piece of state:

1. `schedule()` *plans*: which requests run and how many new tokens each brings — 1 for a decode,
   the prompt (or a chunk of it) for a prefill, 1+k when speculating. It reserves their KV and
   decides preemptions. Decode rows come first, so attention can batch them.
2. The executor (the model runner, or the simulator's stand-in) turns the plan into a
   `ModelRunnerOutput`: for each planned request the token ids it sampled (0 … k+1 of them). It
   changes no request.
3. `update_from_output(plan, output)` is the ONLY place that advances `num_computed_tokens`,
   appends tokens, applies stop conditions and frees a finished request's KV. It returns one
   `RequestUpdate` per request that received tokens, which the engine hands out.

If the executor raises, `rollback(plan)` undoes what `schedule()` did (admissions, KV reserved for
the step, prefix-cache entries that would have held K/V never computed), so every request is
as it was before the step; only a request preempted by that plan stays preempted (waiting, its
tokens intact: it recomputes or swaps back in like any preempted request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from minillm.request import Request, RequestStatus


@dataclass
class SchedulerPlan:
    """One step's plan as the scheduler made it: live `Request` objects, for the engine core only.
    What crosses to a worker is this plan turned into data (`minillm.scheduler.output.SchedulerOutput`,
    vLLM's class of that name); vLLM's scheduler builds that data directly, minillm keeps the two
    apart so chapter 04 can show the plan before it becomes ids and diffs."""

    requests: list[Request]  # decode rows first, then rows with several new tokens
    num_new_tokens: list[int]
    num_padding_tokens: int = 0  # slots computed for nothing (static/dynamic batching only)
    preempted: list[Request] = field(default_factory=list)
    padded: Any = None  # a static.PaddedStep when the step computes a padded rectangle
    # Swap preemption: (request id, device blocks) whose K/V the executor copies out / in before the forward.
    blocks_to_swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[str, list[int]]] = field(default_factory=list)
    # Speculative decoding: request id -> the unverified guesses its row carries after its pending token.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # For rollback: requests admitted by this plan, with the status they had before.
    admitted: list[tuple[Request, RequestStatus]] = field(default_factory=list)
    # A KV connector's orders for the workers this step (minillm.kv_transfer.base.KVConnectorMetadata)
    kv_connector_metadata: Any = None
    # Planned by the continuous scheduler's steady-decode pass: every row decodes one token after a
    # sampled one (no prompt token, no guess), nothing is preempted, admitted or moved. While the
    # running requests stay the same, the scheduler hands out this very object again, step after
    # step — a captured CUDA graph's replay, on a CPU: the builder and the worker then update what
    # they made for it the step before instead of making it again (issue 29).
    steady: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def num_prefill_and_decode_tokens(self) -> tuple[int, int]:
        """Tokens that fill in a prompt (prefill) vs tokens that follow a sampled token (decode)."""
        prefill = decode = 0
        for req, n in zip(self.requests, self.num_new_tokens):
            in_prompt = len(req.prompt_token_ids) - req.num_computed_tokens  # (an attribute: once per row)
            if in_prompt <= 0:
                decode += n
            else:
                in_prompt = min(in_prompt, n)
                prefill += in_prompt
                decode += n - in_prompt
        return prefill, decode


@dataclass
class ModelRunnerOutput:
    """What the executor reports for a plan: per planned request (same order), the sampled ids."""

    sampled_token_ids: list[list[int]]  # [] for a prefill chunk that samples nothing
    # Per planned request, per sampled token: {token id: logprob} (the sampled one first), or None.
    logprobs: list[list[dict[int, float]] | None] | None = None
    # MoE models: rows each expert computed in this step, [layer][expert] (the step records' histogram).
    expert_load: list[list[int]] | None = None
    # A KV connector's worker side: what it loaded this step (minillm.kv_transfer.base.KVConnectorOutput)
    kv_connector_output: Any = None

    @classmethod
    def from_rows(cls, plan: SchedulerPlan, rows: list[Request], tokens: list[int]) -> ModelRunnerOutput:
        """One token for each request in `rows` (a stand-in executor's usual answer), none for the rest."""
        by_id = {r.request_id: t for r, t in zip(rows, tokens)}
        return cls([[by_id[r.request_id]] if r.request_id in by_id else [] for r in plan.requests])


@dataclass
class RequestUpdate:
    """What one step did for one request (vLLM's EngineCoreOutput)."""

    request: Request
    new_token_ids: list[int]
    finish_status: RequestStatus | None = None
    new_logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_status is not None


class Scheduler(Protocol):
    def add_request(self, request: Request) -> None: ...

    def schedule(self, now: float, more_arrivals: bool = True) -> SchedulerPlan | None:
        """The next step's plan, or None if nothing can run now. `more_arrivals=False` tells a
        batch-synchronous scheduler that waiting for a fuller batch is pointless."""
        ...

    def update_from_output(self, plan: SchedulerPlan, output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Apply a step's results: the single writer of request progress (see the module docstring)."""
        ...

    def rollback(self, plan: SchedulerPlan) -> None:
        """The step failed: undo what `schedule()` reserved and admitted for it."""
        ...

    def finish(self, request: Request) -> None:
        """`request` just finished (its status says how): release it and its KV."""
        ...

    def abort(self, request_id: str) -> Request | None: ...

    def has_request(self, request_id: str) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    def next_wakeup(self, now: float) -> float | None:
        """When an idle scheduler will fire next without new arrivals (timers), or None."""
        ...


class SchedulerBase:
    """What every scheduler shares: `update_from_output` (advance, append, stop, finish), and the
    defaults of a scheduler with a `waiting` queue and no timers.

    Subclasses provide `schedule`, `finish` and `rollback`; `self.config`, `self.kv` and
    `self.waiting` are theirs."""

    config: Any
    kv: Any
    waiting: Any
    connector: Any = None  # a KV connector's scheduler side (minillm.kv_transfer), if this engine has one

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def next_wakeup(self, now: float) -> float | None:
        """No timers: an idle scheduler wakes only for new arrivals."""
        return None

    def update_from_output(self, plan: SchedulerPlan, output: ModelRunnerOutput) -> list[RequestUpdate]:
        self.kv.commit_step()
        if output.kv_connector_output is not None:
            self.connector.update_connector_output(output.kv_connector_output)
        max_model_len = self.config.max_model_len
        logprobs = output.logprobs or [None] * len(plan.requests)
        updates: list[RequestUpdate] = []
        spec_ids = plan.spec_token_ids
        for req, n, tokens, lps in zip(plan.requests, plan.num_new_tokens, output.sampled_token_ids, logprobs):
            spec = spec_ids.get(req.request_id) if spec_ids else None
            if spec:
                # 1 + k tokens ran (the pending one, k guesses); len(tokens) - 1 guesses were accepted.
                # Their K/V and the pending token's are kept; the rejected guesses' are rolled back.
                req.num_computed_tokens += len(tokens)
                self.kv.trim(req, req.num_computed_tokens)
            else:
                req.num_computed_tokens += n
            if req.spec_token_ids or req.spec_draft_probs is not None:  # (no new list per row and step)
                req.spec_token_ids, req.spec_draft_probs = [], None
            if not tokens:
                continue  # a prefill chunk that has not reached the end of the prompt
            status = None
            taken = 0
            for token in tokens:
                req.append_token(token)
                taken += 1
                status = req.check_stop(token, max_model_len)
                if status is not None:
                    break  # tokens after a stop are dropped (several per step when speculating)
            new_lps = None
            if lps is not None and req.output_logprobs is not None:
                new_lps = lps[:taken]
                req.output_logprobs.extend(new_lps)
                req.cumulative_logprob += sum(d[t] for d, t in zip(new_lps, tokens[:taken]))
            if status is not None:
                req.status = status
                self.finish(req)
            updates.append(RequestUpdate(req, list(tokens[:taken]), status, new_lps))
        return updates
