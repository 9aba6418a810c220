"""The engine core: one `step()` = schedule → execute → update → record, and its rollback (chapter 04).

Taught across chapters 02–07; the loop itself is shown in chapter 04, the engine run by a thread of its own in chapter
11. Requests can be added while the engine runs (`add_request` between steps); `LLM.generate` (in
`minillm.llm`) adds a whole trace and steps until everything has finished, on the caller's thread;
the server runs the same engine in a thread of its own (`minillm.engine.inbox`).

The engine owns no request state itself: `requests` is its one registry of unfinished requests;
the scheduler plans and applies results (`update_from_output`, the writer of a request's progress
and status), the executor computes, the output processor writes the text. If the executor raises,
the scheduler rolls the plan back and the exception propagates: every request is as it was
before the step (see `minillm.scheduler.base`). Aborts that arrive during a step are applied after it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from minillm.clock import WallClock
from minillm.config import EngineConfig
from minillm.engine.inbox import ADD_FAILED, EngineInbox, OutputSink
from minillm.engine.input import InputProcessor
from minillm.engine.output import OutputProcessor
from minillm.engine.parts import make_kv_manager, make_scheduler
from minillm.kv.base import KVUsage
from minillm.kv_transfer import make_scheduler_connector
from minillm.metrics import MetricsCollector, StepRecord
from minillm.model.config import ModelConfig
from minillm.request import Request, RequestStatus, SamplingParams
from minillm.scheduler.base import RequestUpdate, Scheduler, SchedulerPlan
from minillm.scheduler.continuous import ContinuousScheduler


class StepUpdates(list):
    """What `step()` returns: a list of `RequestUpdate`s (one per request that received tokens,
    finished ones included), and `model_ran`: whether the step ran the model at all (a prefill
    chunk runs but samples nothing; a step with nothing to run does not)."""

    model_ran: bool = False


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load now, for gauges (`minillm.server.metrics`): returned, never probed."""

    num_running: int
    num_waiting: int  # in the scheduler's queue (preempted ones included)
    num_not_arrived: int  # added with a future arrival time
    kv_usage: KVUsage


class LLMEngine(EngineInbox):
    warm_up_report = None  # what start-up compiled and warmed (minillm.worker.warm_up); set by build_engine

    def __init__(self, model_config: ModelConfig, config: EngineConfig, *, model: Any = None,
                 tokenizer: Any = None, kv=None, scheduler: Scheduler | None = None, executor=None,
                 clock=None, proposer=None) -> None:
        """Every part can be injected (an exercise's scheduler, the simulator's executor and clock);
        the KV layout and scheduler default to what the config names. `executor` runs the plans: the
        real model's worker (`build_engine` makes one for a model) or a stand-in (the simulator's)."""
        self.model_config = model_config
        self.model = model
        self.tokenizer = tokenizer
        self.config = config.resolve(model_config.max_position_embeddings)
        if executor is None:
            raise ValueError("pass executor= (build_engine builds the worker for a model; the simulator passes "
                             "its own)")
        if model is None and kv is None:
            raise ValueError("without a model, pass kv= (the simulator does)")
        self.kv = kv if kv is not None else make_kv_manager(self.config, model_config, model.dtype,
                                                            str(model.device))
        self.scheduler = scheduler if scheduler is not None else make_scheduler(self.config, self.kv)
        self._init_inbox()
        # A prefill/decode pair's KV connector (chapter 13): its scheduler side here, its worker side in
        # every worker (the executor's); they talk only through the plan and the worker's output.
        transfer = self.config.kv_transfer_config
        self.kv_connector = None
        if transfer is not None:
            if not isinstance(self.scheduler, ContinuousScheduler):
                raise ValueError("kv_transfer_config needs the continuous scheduler (batching='continuous')")
            self.kv_connector = make_scheduler_connector(
                transfer, self.kv.cache_spec, self.config.tensor_parallel_size * self.config.pipeline_parallel_size,
                self.kv.cached_prefix_tokens, partial(self.call_soon, self._apply_connector_events))
            self.scheduler.connector = self.kv_connector
        self.executor = executor
        self.device = model.device if model is not None else "cpu"
        # Speculative decoding: who guesses the next tokens (chapter 09). A draft model is loaded by LLM.
        spec = self.config.speculative_config
        if proposer is None and spec is not None:
            if spec.method != "ngram":
                raise ValueError("speculative_config method 'draft_model' needs a loaded draft: use LLM(...), "
                                 "or pass proposer=DraftModelProposer(...)")
            from minillm.spec.ngram import NgramProposer

            proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
        self.proposer = proposer
        self.clock = clock or WallClock()
        self.metrics = MetricsCollector()
        self.inputs = InputProcessor(self.config, model_config, tokenizer, self.device)
        self.outputs = OutputProcessor(tokenizer)
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}  # every unfinished request, arrived or not
        self._pending: list[tuple[float, int, Request]] = []  # not yet arrived, a heap by arrival time
        self._pending_ids: set[str] = set()
        self._ids = itertools.count()
        self._order = itertools.count()
        self._in_step = False
        self._deferred_aborts: list[str] = []
        self.num_steps = 0
        self.time_in_steps_s = 0.0  # wall time in the steps that ran (bench/ladder.py reports it)
        # Online (a server) more requests may always come; `LLM.generate` clears this while it
        # replays a fixed set, so a static batcher need not wait for a batch that will never fill.
        self.expect_more_requests = True
        if self.kv_connector is not None:
            self.metrics.add_observer(self.kv_connector.on_step)
            self.kv_connector.start()


    # ---- requests in -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, sink: OutputSink | None = None) -> Request:
        """Queue one prompt (text, token ids, {"prompt_token_ids": [...]} or {"prompt": "..."}) and
        return its Request. `sink(output)` receives its `RequestOutput`s as `params.output_kind` says."""
        self._check_owner("add_request")
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        now = self.clock.now()
        arrival = now if arrival_time is None else arrival_time
        req = self.inputs.make_request(prompt, params or SamplingParams(), request_id or self._new_request_id(),
                                       arrival, priority, streams=sink is not None)
        req.sink = sink
        self.requests[req.request_id] = req
        if arrival <= now:
            self._arrive(req)
        else:
            heapq.heappush(self._pending, (arrival, next(self._order), req))
            self._pending_ids.add(req.request_id)
        return req

    def _new_request_id(self) -> str:
        """A fresh id that no unfinished request — user-named or not — holds."""
        while True:
            candidate = str(next(self._ids))
            if candidate not in self.requests:
                return candidate

    def _arrive(self, req: Request) -> None:
        self.metrics.on_arrival(req.request_id, req.arrival_time, req.num_prompt_tokens)
        if self.kv_connector is not None and self.kv_connector.on_arrival(req):
            return  # held by the KV connector until its remote K/V are here (minillm.kv_transfer)
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is (pending arrival, waiting, running, swapped out): its KV is
        freed and its metrics closed with finish reason "abort". During a step, after the step."""
        self._check_owner("abort_request")
        if self._in_step:
            self._deferred_aborts.append(request_id)
            return
        req = self.requests.get(request_id)
        if req is None:
            return
        if request_id in self._pending_ids:
            self._pending = [p for p in self._pending if p[2].request_id != request_id]
            heapq.heapify(self._pending)
            self._pending_ids.discard(request_id)
            record = None
        else:
            self.scheduler.abort(request_id)
            record = self.metrics.requests.get(request_id)
            self.metrics.on_finish(request_id, self.clock.now(), "abort")
        if not req.status.finished:  # it never reached the scheduler (which sets the status of those it holds)
            req.status = RequestStatus.FINISHED_ABORTED
        del self.requests[request_id]
        if self.proposer is not None:
            self.proposer.free(req)
        if req.sink is not None:
            self.outputs.emit(req, [], None, record)


    # ---- the loop ------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> StepUpdates:
        """Run one iteration. Returns what it did for each request that received tokens (finished
        ones included), and whether the model ran (`.model_ran`)."""
        if self.owner_thread is not None:
            self._check_owner("step")
        step_start = time.perf_counter()
        if not self.inbox.empty():  # (an empty inbox costs one check a step, not an exception caught)
            self._drain_inbox()
        now = self.clock.now()
        while self._pending and self._pending[0][0] <= now:
            req = heapq.heappop(self._pending)[2]
            self._pending_ids.discard(req.request_id)
            self._arrive(req)
        plan = self.scheduler.schedule(now, bool(self._pending) or self.expect_more_requests)
        if plan is None:
            return StepUpdates()
        # The step record's token counts, in one pass over the rows (attributes, not properties: per row):
        # prompt tokens filled in, tokens after a sampled one, and the new tokens of each row (re)filling a prompt.
        prefill_tokens = decode_tokens = 0
        chunks: list[int] = []
        if plan.steady:  # every row one token after a sampled one (minillm.scheduler.base): no pass needed
            decode_tokens = len(plan.requests)
        else:
            for r, n in zip(plan.requests, plan.num_new_tokens):
                in_prompt = len(r.prompt_token_ids) - r.num_computed_tokens
                if in_prompt <= 0:
                    decode_tokens += n
                else:
                    in_prompt = min(in_prompt, n)
                    prefill_tokens += in_prompt
                    decode_tokens += n - in_prompt
                if r.num_computed_tokens < len(r.all_token_ids) - 1 or not r.output_token_ids:
                    chunks.append(n)
        self._in_step = True
        try:
            try:
                output = self.executor.execute(plan)
            except BaseException:
                self.scheduler.rollback(plan)
                for req in plan.preempted:  # those preemptions stand: count them
                    self.metrics.on_preempted(req.request_id)
                raise
            self.clock.advance(self.executor.step_duration_s())
            done_time = self.clock.now()
            num_cached = 0
            for req, _ in plan.admitted:
                record = self.metrics.requests[req.request_id]
                if record.first_scheduled_time is None:
                    self.metrics.on_scheduled(req.request_id, now)
                    if req.num_computed_tokens:  # a prefix-cache hit: these prompt tokens are not recomputed
                        self.metrics.on_cached(req.request_id, req.num_computed_tokens)
                        num_cached += req.num_computed_tokens
            updates = self.scheduler.update_from_output(plan, output)
            if plan.spec_token_ids:  # (a loop over the rows only when some row speculated)
                for req, tokens in zip(plan.requests, output.sampled_token_ids):
                    guesses = plan.spec_token_ids.get(req.request_id)
                    if guesses:
                        self.metrics.spec_decode.record(len(guesses), len(tokens) - 1)
            for update in updates:
                self._on_update(update, done_time)
            if self.proposer is not None:
                for req in plan.preempted:  # its guesses were dropped; let the draft's KV go too
                    self.proposer.free(req)
                self._propose([u.request for u in updates if not u.finished])
        finally:
            self._in_step = False
            aborts, self._deferred_aborts = self._deferred_aborts, []
            for request_id in aborts:
                self.abort_request(request_id)
        self._record(plan, prefill_tokens, decode_tokens, num_cached, now, done_time, tuple(chunks), output.expert_load)
        self.time_in_steps_s += time.perf_counter() - step_start
        result = StepUpdates(updates)
        result.model_ran = True
        return result

    def _propose(self, requests: list[Request]) -> None:
        """Guesses for each request's next step (it emits at most guesses + 1 tokens, within its limits)."""
        for req in requests:
            self.proposer.after_verify(req)
        limit = self.config.max_model_len
        budgets = [min(r.params.max_tokens - r.num_output_tokens, limit - r.num_tokens) - 1 for r in requests]
        guesses, dists = self.proposer.propose(requests, budgets)
        for req, g, q in zip(requests, guesses, dists):
            req.spec_token_ids, req.spec_draft_probs = list(g), q

    def check_health(self) -> None:
        """Raise (`EngineDeadError`) if the executor can run no more steps: a worker process died or
        hung (vLLM's `check_health`). In-process executors and stand-ins have nothing to check."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's worker processes, if it has any, and the KV connector's threads."""
        if self.kv_connector is not None:
            self.kv_connector.stop()
        self.executor.shutdown()

    def load_snapshot(self) -> EngineLoad:
        return EngineLoad(self.scheduler.num_running, self.scheduler.num_waiting, len(self._pending), self.kv.usage())

    def run_until_done(self, on_step: Callable[[StepUpdates], None] | None = None,
                       max_iterations: int | None = None) -> bool:
        """Step until no request is unfinished; when a step runs nothing, wait (sleep, or jump a
        simulated clock) for the next arrival or timer. `on_step(updates)` sees every step that ran.
        False if it cannot finish: nothing runs and waiting cannot help (nothing to wait for, or the
        clock cannot move), or `max_iterations` steps were tried. The one step-until-done loop
        (`LLM.generate`, the simulator and the graders use it)."""
        iterations = 0
        while self.has_unfinished():
            if max_iterations is not None and iterations >= max_iterations:
                return False
            iterations += 1
            updates = self.step()
            if updates.model_ran:
                if on_step is not None:
                    on_step(updates)
                continue
            now = self.clock.now()
            if not self.wait_for_work() or self.clock.now() == now or math.isinf(self.clock.now()):
                return False
        return True

    def wait_for_work(self) -> bool:
        """Nothing could run: sleep (or jump the simulated clock) to the next arrival or timer.
        False if there is nothing to wait for (no arrival to come, no timer): waiting cannot help."""
        now = self.clock.now()
        times = [t for t in (self._pending[0][0] if self._pending else None,
                             self.scheduler.next_wakeup(now)) if t is not None]
        if not times:
            return False
        self.clock.wait_until(min(times))
        return True

    def _apply_connector_events(self) -> None:
        """What the KV connector's threads learned, applied on the engine thread (queued by its `notify`)."""
        events = self.kv_connector.take_events()
        for req in events.release:  # a finished prefill's pinned blocks: pulled, expired, or the link broke
            self.kv.free(req)
        for req, message in events.failed:
            if self.requests.get(req.request_id) is req:
                req.error = f"{ADD_FAILED}: {message}"  # the server answers 500: not the client's fault
                self.abort_request(req.request_id)
        for req, first_token in events.ready:  # held requests whose prompt's K/V can now be loaded
            if self.requests.get(req.request_id) is not req:
                self.kv_connector.request_finished(req, [])  # aborted meanwhile: the producer may free its blocks
                continue
            req.append_token(first_token)  # the prefill's sampled token: the client gets it now
            status = req.check_stop(first_token, self.config.max_model_len)
            if status is not None:
                req.status = status
                self.kv_connector.request_finished(req, [])
            else:
                self.scheduler.add_request(req)
            self._on_update(RequestUpdate(req, [first_token], status), self.clock.now())

    def _on_update(self, update: RequestUpdate, t: float) -> None:
        req = update.request
        self.metrics.on_token(req.request_id, t, len(update.new_token_ids))
        record = None
        if update.finished:
            self.outputs.finish_text(req)
            record = self.metrics.requests.get(req.request_id)
            self.metrics.on_finish(req.request_id, t, req.status.value)
            del self.requests[req.request_id]
            if self.proposer is not None:
                self.proposer.free(req)
        if req.sink is not None:
            self.outputs.emit(req, update.new_token_ids, update.new_logprobs, record)

    def _record(self, batch: SchedulerPlan, prefill: int, decode: int, num_cached: int, start: float,
                end: float, chunks: tuple[int, ...] = (), expert_load: list[list[int]] | None = None) -> None:
        usage = self.kv.usage()
        prefix = self.kv.make_prefix_cache_stats()  # this step's lookups, returned (not diffed)
        for req in batch.preempted:
            self.metrics.on_preempted(req.request_id)
        self.metrics.record_step(StepRecord(
            step=self.num_steps, start_time=start, duration_s=end - start,
            num_prefill_tokens=prefill, num_decode_tokens=decode, num_padding_tokens=batch.num_padding_tokens,
            num_seqs=len(batch.requests), num_waiting=self.scheduler.num_waiting,
            kv_used_tokens=usage.used_tokens, kv_reserved_tokens=usage.reserved_tokens,
            kv_total_tokens=usage.total_tokens, num_preemptions=len(batch.preempted), num_cached_tokens=num_cached,
            num_prefix_queried_tokens=prefix.queries, num_prefix_hit_tokens=prefix.hits,
            kv_swapped_tokens=usage.swapped_tokens,
            num_swapped_blocks=sum(len(b) for _, b in batch.blocks_to_swap_out) + sum(
                len(b) for _, b in batch.blocks_to_swap_in) if batch.blocks_to_swap_out or batch.blocks_to_swap_in else 0,
            prefill_chunk_sizes=chunks, expert_load=expert_load))
        self.num_steps += 1
