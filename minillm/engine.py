"""The engine loop: one `step()` = schedule → execute (prepare, forward, sample) → update → record.

Taught across chapters 02–07; the loop itself is shown in chapter 04, the threaded core in chapter
11. Requests can be added while the engine runs (`add_request` between steps); `LLM.generate` (in
`minillm.llm`) adds a whole trace and steps until everything has finished, on the caller's thread.

The server runs the same engine in a thread of its own (`run_forever`): that thread is the only
one that touches engine state. Other threads never call `add_request` or `abort_request`; they
`submit_add` / `submit_abort` commands into a thread-safe inbox, which `step()` drains first, and
receive `RequestOutput`s through the callback (`sink`) they gave. With nothing to do, the loop
blocks on the inbox (no spinning). Why a thread and not a process, as vLLM V1 does (its EngineCore
is a separate process talking ZMQ): the bundled model is tiny, torch releases the GIL inside its
ops, and a thread needs no serialization of requests and outputs — what is left to teach is the
ownership rule, which a thread shows just as well. The price: the HTTP side and the engine share
one interpreter, so tokenizing or JSON work in the server takes time from the engine loop.

The engine owns no request state itself: the scheduler plans and applies results
(`update_from_output`), the executor computes. If the executor raises, the scheduler rolls the
plan back and the exception propagates: every request is as it was before the step (see
`minillm.scheduler.base`). Aborts that arrive during a step are applied after it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from minillm.clock import WallClock
from minillm.config import EngineConfig
from minillm.detokenizer import IncrementalDetokenizer
from minillm.executor.uniproc import UniProcExecutor
from minillm.kv.block_manager import BlockManager
from minillm.kv.padded import PaddedKVManager
from minillm.kv.slab import SlabKVManager
from minillm.metrics import MetricsCollector, StepRecord
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaModel
from minillm.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    SamplingParams,
    derive_seed,
)
from minillm.scheduler.base import RequestUpdate, ScheduledBatch, Scheduler
from minillm.scheduler.continuous import ContinuousScheduler
from minillm.scheduler.dynamic import DynamicScheduler
from minillm.scheduler.static import StaticScheduler
from minillm.worker.model_runner import ModelRunner

logger = logging.getLogger("minillm.engine")

OutputSink = Callable[[RequestOutput], None]
STEP_FAILED = "engine step failed"  # how RequestOutput.error begins when a step failed (else: a refused prompt)
ADD_FAILED = "engine failed to add the request"  # an unexpected error (not a ValueError) while adding
SERVER_FAULTS = (STEP_FAILED, ADD_FAILED)  # errors that are the server's fault (HTTP 500), not the client's


def make_kv_manager(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", allocate_pool: bool = True):
    """The KV manager the config names: one rectangle per batch for static/dynamic, else slabs."""
    c = model_config
    if config.batching in ("static", "dynamic"):
        return PaddedKVManager(c.num_layers, c.num_kv_heads, c.head_dim, config.max_num_seqs,
                               config.max_model_len, dtype, device, allocate_pool)
    if config.kv_layout == "slab":
        return SlabKVManager(c.num_layers, c.num_kv_heads, c.head_dim, num_slabs=config.max_num_seqs,
                             slab_len=config.max_model_len, dtype=dtype, device=device, allocate_pool=allocate_pool)
    return BlockManager(c.num_layers, c.num_kv_heads, c.head_dim, config.num_kv_blocks, config.block_size, dtype,
                        device, enable_prefix_caching=config.enable_prefix_caching, allocate_pool=allocate_pool,
                        watermark=config.kv_watermark, prefix_cache=config.prefix_cache,
                        max_model_len=config.max_model_len, swap_space_gib=config.swap_space)


def make_scheduler(config: EngineConfig, kv) -> Scheduler:
    schedulers = {"static": StaticScheduler, "dynamic": DynamicScheduler, "continuous": ContinuousScheduler}
    return schedulers[config.batching](config, kv)


class LLMEngine:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, *, model: LlamaModel | None = None,
                 tokenizer: Any = None, kv=None, scheduler: Scheduler | None = None, executor=None,
                 clock=None, proposer=None) -> None:
        """Every part can be injected (an exercise's scheduler, the simulator's executor and clock);
        by default the real model runs with the KV layout and scheduler the config names."""
        self.model_config = model_config
        self.model = model
        self.tokenizer = tokenizer
        self.config = config.resolve(model_config.max_position_embeddings)
        if model is None and (kv is None or executor is None):
            raise ValueError("without a model, pass both kv= and executor= (the simulator does)")
        self.kv = kv if kv is not None else make_kv_manager(self.config, model_config, model.dtype,
                                                            str(model.device))
        self.scheduler = scheduler if scheduler is not None else make_scheduler(self.config, self.kv)
        # The executor turns a plan into next tokens: the real model, or the simulator's stand-in.
        if executor is None:
            executor = UniProcExecutor(ModelRunner(model, self.kv.cache_spec, self.config.attention_backend), self.kv)
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
        # Commands from other threads: ("add", prompt, params, request_id, sink, priority),
        # ("abort", request_id) or ("call", fn); see submit_add / submit_abort / call_soon.
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.command_observers: list[Callable[[], None]] = []  # called after commands were applied
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
        # While `run_forever` runs, the thread running it owns all engine state: add_request,
        # abort_request and step refuse any other caller (who should use the inbox instead).
        self.owner_thread: threading.Thread | None = None

    def _check_owner(self, what: str) -> None:
        owner = self.owner_thread
        if owner is not None and threading.current_thread() is not owner:
            raise RuntimeError(f"{what}() called from thread {threading.current_thread().name!r}, but thread "
                               f"{owner.name!r} runs this engine (a server?): from other threads use "
                               "submit_add / submit_abort / call_soon")

    # ---- requests in -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, sink: OutputSink | None = None) -> Request:
        """Queue one prompt (text, token ids, {"prompt_token_ids": [...]} or {"prompt": "..."}) and
        return its Request. `sink(output)` receives its `RequestOutput`s as `params.output_kind` says."""
        self._check_owner("add_request")
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"the engine runs one sequence per request; n={params.n} is fanned out by the caller "
                             "(LLM.generate, the server) into n requests with SamplingParams.for_child(i)")
        if self.config.speculative_config is not None and (params.has_penalties or params.min_tokens):
            raise ValueError("presence_penalty, frequency_penalty, repetition_penalty and min_tokens are not "
                             "supported with speculative_config (the rejection sampler does not apply them)")
        text, token_ids = self._tokenize(prompt)
        max_len = self.config.max_model_len
        total = len(token_ids) + params.max_tokens
        if total > max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens and max_tokens={params.max_tokens}: together "
                             f"{total}, more than max_model_len={max_len}")
        # (No request can outgrow the KV pool either: EngineConfig.resolve refuses a pool that holds
        # less than one max_model_len request.)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer to see text, and this engine has none: "
                             "use stop_token_ids instead")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if request_id is None:
            request_id = self._new_request_id()
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        now = self.clock.now()
        arrival = now if arrival_time is None else arrival_time
        streams = sink is not None and params.output_kind is not RequestOutputKind.FINAL_ONLY
        detokenizer = None
        if self.tokenizer is not None and (params.stop or streams):
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        req = Request(request_id, token_ids, params, arrival, self.eos_token_ids, priority, text,
                      derive_seed(self.config.seed, request_id), device=self.device, detokenizer=detokenizer)
        req.sink = sink
        self.requests[request_id] = req
        if arrival <= now:
            self._arrive(req)
        else:
            heapq.heappush(self._pending, (arrival, next(self._order), req))
            self._pending_ids.add(request_id)
        return req

    def _new_request_id(self) -> str:
        """A fresh id that no unfinished request — user-named or not — holds."""
        while True:
            candidate = str(next(self._ids))
            if candidate not in self.requests:
                return candidate

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt needs 'prompt_token_ids' (a list of ints) or 'prompt' (a string), "
                                 f"got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token id")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids instead of text")
            return prompt, list(self.tokenizer(prompt).input_ids)
        token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt_token_ids is empty; give at least one token id")
        return None, token_ids

    def _arrive(self, req: Request) -> None:
        self.metrics.on_arrival(req.request_id, req.arrival_time, req.num_prompt_tokens)
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
        req.status = RequestStatus.FINISHED_ABORTED
        del self.requests[request_id]
        if self.proposer is not None:
            self.proposer.free(req)
        if req.sink is not None:
            self._emit(req, [], None, record)

    # ---- other threads: the inbox --------------------------------------------------------------
    def submit_add(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                   sink: OutputSink, priority: int = 0) -> None:
        """Thread-safe: queue an add for the engine thread. A prompt it refuses reaches `sink` as
        a finished output with `error` set (finish_reason "abort")."""
        self.inbox.put(("add", prompt, params, request_id, sink, priority))

    def submit_abort(self, request_id: str) -> None:
        """Thread-safe: abort `request_id` at the start of the next step (no-op if it is gone)."""
        self.inbox.put(("abort", request_id))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Thread-safe: run `fn()` on the engine thread between steps (a consistent snapshot)."""
        self.inbox.put(("call", fn))

    def _drain_inbox(self, block: bool = False, timeout: float | None = None) -> None:
        """Apply queued commands; with `block`, wait (up to `timeout`) for the first one."""
        try:
            command = self.inbox.get(True, timeout) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
        for fn in self.command_observers:
            fn()

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "abort":
            self.abort_request(command[1])
        elif kind == "add":
            _, prompt, params, request_id, sink, priority = command
            try:
                self.add_request(prompt, params, request_id=request_id, sink=sink, priority=priority)
            except ValueError as err:  # a prompt or params the engine refuses: the caller's fault
                self._refuse(request_id, sink, str(err))
            except Exception as err:  # noqa: BLE001 - a bug while adding must not stop the engine thread
                logger.exception("adding request %s failed", request_id)
                self._refuse(request_id, sink, f"{ADD_FAILED}: {type(err).__name__}: {err}")
        elif kind == "call":
            try:
                command[1]()
            except Exception:  # noqa: BLE001 - nor may a failing call_soon function
                logger.exception("a function queued with call_soon failed")
        else:
            logger.error("unknown engine command %r ignored", kind)

    def _refuse(self, request_id: str, sink: OutputSink, error: str) -> None:
        """Answer a failed add with one finished output carrying `error`; undo a half-done add."""
        req = self.requests.get(request_id)
        if req is not None and req.sink is sink:  # it got in before the failure: take it out again
            req.error = error
            try:
                self.abort_request(request_id)  # frees whatever it holds and answers its sink
                return
            except Exception:  # noqa: BLE001 - then at least forget it, so the loop does not wait on it
                logger.exception("aborting the half-added request %s failed", request_id)
                self.requests.pop(request_id, None)
                self._pending_ids.discard(request_id)
        try:
            sink(RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "abort")], True, error=error))
        except Exception:  # noqa: BLE001
            logger.exception("output sink of request %s failed", request_id)

    def run_forever(self, stop: threading.Event) -> None:
        """The engine thread's loop: step while there is work, block on the inbox while there is none.

        A step that raises (a bug, out of memory) is rolled back by the scheduler; every request
        is then aborted (its sink sees finish_reason "abort" with the error), so one bad step
        cannot repeat forever, and the loop goes on serving new requests."""
        if self.owner_thread is not None:
            raise RuntimeError(f"thread {self.owner_thread.name!r} already runs this engine")
        self.owner_thread = threading.current_thread()
        try:
            self._serve(stop)
        finally:
            self.owner_thread = None

    def _serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.requests:
                self._wait_for_commands(0.5)
                continue
            steps_before = self.num_steps
            try:
                self.step()
            except Exception as err:  # noqa: BLE001 - the loop must survive any one step
                logger.exception("engine step failed; aborting the requests it held")
                self._abort_all(f"{STEP_FAILED}: {type(err).__name__}: {err}")
                continue
            if self.num_steps == steps_before:  # nothing could run: sleep until a timer or a command
                now = self.clock.now()
                times = [t for t in (self._pending[0][0] if self._pending else None,
                                     self.scheduler.next_wakeup(now)) if t is not None]
                timeout = max(0.0, min(times) - now) if times else 0.5
                self._wait_for_commands(timeout)

    def _wait_for_commands(self, timeout: float) -> None:
        """Block on the inbox up to `timeout` s (the 0.5 s cap lets `stop` be seen), then apply what came."""
        try:
            self._drain_inbox(block=True, timeout=timeout)
        except Exception:  # noqa: BLE001 - e.g. a failing command observer; the loop goes on
            logger.exception("applying engine commands failed")

    def _abort_all(self, error: str) -> None:
        for request_id, req in list(self.requests.items()):
            req.error = error
            self.abort_request(request_id)

    # ---- the loop ------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestUpdate]:
        """Run one iteration. Returns what it did for each request that received tokens (finished
        ones included); `num_steps` tells whether a step ran at all (a prefill chunk runs but
        samples nothing)."""
        self._check_owner("step")
        step_start = time.perf_counter()
        self._drain_inbox()
        now = self.clock.now()
        while self._pending and self._pending[0][0] <= now:
            req = heapq.heappop(self._pending)[2]
            self._pending_ids.discard(req.request_id)
            self._arrive(req)
        plan = self.scheduler.schedule(now, bool(self._pending) or self.expect_more_requests)
        if plan is None:
            return []
        prefill_tokens, decode_tokens = plan.num_prefill_and_decode_tokens()
        chunks = tuple(n for r, n in zip(plan.requests, plan.num_new_tokens)
                       if r.num_computed_tokens < r.num_tokens - 1 or not r.num_output_tokens)
        queried_before, hit_before = self._prefix_counters()
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
        queried_after, hit_after = self._prefix_counters()
        self._record(plan, prefill_tokens, decode_tokens, num_cached, now, done_time,
                     queried_after - queried_before, hit_after - hit_before, chunks)
        self.time_in_steps_s += time.perf_counter() - step_start
        return updates

    def _propose(self, requests: list[Request]) -> None:
        """Guesses for each request's next step (it emits at most guesses + 1 tokens, within its limits)."""
        for req in requests:
            self.proposer.after_verify(req)
        limit = self.config.max_model_len
        budgets = [min(r.params.max_tokens - r.num_output_tokens, limit - r.num_tokens) - 1 for r in requests]
        guesses, dists = self.proposer.propose(requests, budgets)
        for req, g, q in zip(requests, guesses, dists):
            req.spec_token_ids, req.spec_draft_probs = list(g), q

    def _prefix_counters(self) -> tuple[int, int]:
        return self.kv.num_query_tokens, self.kv.num_hit_tokens

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

    def _on_update(self, update: RequestUpdate, t: float) -> None:
        req = update.request
        self.metrics.on_token(req.request_id, t, len(update.new_token_ids))
        record = None
        if update.finished:
            if req.output_text is None:  # not already cut at a stop string
                # The EOS or stop token that ended it is in output_token_ids but not in the text,
                # unless include_stop_str_in_output (vLLM's rule, for stop strings and stop tokens alike).
                ids = req.output_token_ids
                if req.stopped_on_token and not req.params.include_stop_str_in_output:
                    ids = ids[:-1]
                req.output_text = (self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
                                   if self.tokenizer is not None else "")
            record = self.metrics.requests.get(req.request_id)
            self.metrics.on_finish(req.request_id, t, req.status.value)
            del self.requests[req.request_id]
            if self.proposer is not None:
                self.proposer.free(req)
        if req.sink is not None:
            self._emit(req, update.new_token_ids, update.new_logprobs, record)

    def _emit(self, req: Request, new_ids: list[int], new_logprobs: list | None, record: Any) -> None:
        """Hand `req.sink` what this step added (DELTA), everything so far (CUMULATIVE), or, once
        finished, everything (FINAL_ONLY). Text a stop string may still claim is held back."""
        kind = req.params.output_kind
        finished = req.status.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return
        if finished:
            text = req.output_text if req.output_text is not None else (
                req.detokenizer.text if req.detokenizer is not None else "")
        elif req.detokenizer is not None:
            text = req.detokenizer.emittable(req.params.stop, req.params.include_stop_str_in_output)
        else:
            text = ""
        if kind is RequestOutputKind.DELTA:
            # What was streamed is a prefix of the final text (the windowed decode of a full decode).
            completion = CompletionOutput(0, text[len(req.sent_text):], list(new_ids), req.finish_reason,
                                          req.cumulative_logprob, new_logprobs, req.stop_reason)
            req.sent_text = text
        else:
            completion = CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason,
                                          req.cumulative_logprob,
                                          None if req.output_logprobs is None else list(req.output_logprobs),
                                          req.stop_reason)
        out = RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion], finished,
                            record if finished else None, error=req.error)
        try:
            req.sink(out)
        except Exception:  # noqa: BLE001 - a consumer's failure must not stop the engine
            logger.exception("output sink of request %s failed", req.request_id)

    def _record(self, batch: ScheduledBatch, prefill: int, decode: int, num_cached: int, start: float,
                end: float, num_queried: int, num_hit: int, chunks: tuple[int, ...] = ()) -> None:
        usage = self.kv.usage()
        for req in batch.preempted:
            self.metrics.on_preempted(req.request_id)
        self.metrics.record_step(StepRecord(
            step=self.num_steps, start_time=start, duration_s=end - start,
            num_prefill_tokens=prefill, num_decode_tokens=decode, num_padding_tokens=batch.num_padding_tokens,
            num_seqs=len(batch.requests), num_waiting=self.scheduler.num_waiting,
            kv_used_tokens=usage.used_tokens, kv_reserved_tokens=usage.reserved_tokens,
            kv_total_tokens=usage.total_tokens, num_preemptions=len(batch.preempted), num_cached_tokens=num_cached,
            num_prefix_queried_tokens=num_queried, num_prefix_hit_tokens=num_hit,
            kv_swapped_tokens=usage.swapped_tokens,
            num_swapped_blocks=sum(len(b) for _, b in batch.blocks_to_swap_out) + sum(
                len(b) for _, b in batch.blocks_to_swap_in), prefill_chunk_sizes=chunks))
        self.num_steps += 1
