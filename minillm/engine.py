"""The engine loop: one `step()` = schedule → KV → prepare → forward → sample → update → record.

Taught across chapters 02–07; the loop itself is shown in chapter 04. Requests can be added while
the engine runs (`add_request` between steps), which is what the server does; `LLM.generate`
(in `minillm.llm`) simply adds a whole trace and steps until everything has finished.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import torch

from minillm.clock import WallClock
from minillm.config import EngineConfig
from minillm.kv.block_manager import BlockManager
from minillm.kv.padded import PaddedKVManager
from minillm.kv.slab import SlabKVManager
from minillm.metrics import MetricsCollector, StepRecord
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaModel
from minillm.request import Request, RequestStatus, SamplingParams
from minillm.runner import ModelRunner
from minillm.scheduler.base import ScheduledBatch, Scheduler
from minillm.scheduler.continuous import ContinuousScheduler
from minillm.scheduler.dynamic import DynamicScheduler
from minillm.scheduler.static import StaticScheduler


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
                        watermark=config.kv_watermark, prefix_cache=config.prefix_cache)


def make_scheduler(config: EngineConfig, kv) -> Scheduler:
    schedulers = {"static": StaticScheduler, "dynamic": DynamicScheduler, "continuous": ContinuousScheduler}
    return schedulers[config.batching](config, kv)


class LLMEngine:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, *, model: LlamaModel | None = None,
                 tokenizer: Any = None, kv=None, scheduler: Scheduler | None = None, executor=None,
                 clock=None) -> None:
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
        self.executor = executor if executor is not None else ModelRunner(model, self.kv)
        self.clock = clock or WallClock()
        self.metrics = MetricsCollector()
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}  # every unfinished request, arrived or not
        self._pending: list[tuple[float, int, Request]] = []  # not yet arrived, a heap by arrival time
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self.num_steps = 0
        # Online (a server) more requests may always come; `LLM.generate` clears this while it
        # replays a fixed set, so a static batcher need not wait for a batch that will never fill.
        self.expect_more_requests = True

    # ---- requests in -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> Request:
        """Queue one prompt (text, token ids, or {"prompt_token_ids": [...]}) and return its Request."""
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        max_len = self.config.max_model_len
        if len(token_ids) + params.max_tokens > max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens and max_tokens={params.max_tokens}: together "
                             f"{len(token_ids) + params.max_tokens}, more than max_model_len={max_len}")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        now = self.clock.now()
        arrival = now if arrival_time is None else arrival_time
        default_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self._seeds))
        req = Request(request_id, token_ids, params, arrival, self.eos_token_ids, priority, text, default_seed)
        self.requests[request_id] = req
        if arrival <= now:
            self._arrive(req)
        else:
            heapq.heappush(self._pending, (arrival, next(self._ids), req))
        return req

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"a dict prompt needs 'prompt_token_ids', got keys {sorted(prompt)}")
            prompt = prompt["prompt_token_ids"]
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
        req = self.scheduler.abort(request_id)
        if req is None:
            pending = [p for p in self._pending if p[2].request_id == request_id]
            if not pending:
                return
            self._pending.remove(pending[0])
            heapq.heapify(self._pending)
            req = pending[0][2]
            req.status = RequestStatus.FINISHED_ABORTED
        self.requests.pop(request_id, None)

    # ---- the loop ------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[Request]:
        """Run one iteration. Returns the requests that received a token (finished ones included);
        `num_steps` tells whether a step ran at all (a prefill chunk runs but samples nothing)."""
        now = self.clock.now()
        while self._pending and self._pending[0][0] <= now:
            self._arrive(heapq.heappop(self._pending)[2])
        batch = self.scheduler.schedule(now, bool(self._pending) or self.expect_more_requests)
        if batch is None:
            return []
        num_cached = 0
        for req in batch.requests:
            record = self.metrics.requests[req.request_id]
            if record.first_scheduled_time is None:
                self.metrics.on_scheduled(req.request_id, now)
                if req.num_computed_tokens:  # a prefix-cache hit: these prompt tokens are not recomputed
                    self.metrics.on_cached(req.request_id, req.num_computed_tokens)
                    num_cached += req.num_computed_tokens
        prefill_tokens, decode_tokens = batch.num_prefill_and_decode_tokens()
        rows, tokens = self.executor.execute(batch)
        self.clock.advance(self.executor.step_duration_s())
        done_time = self.clock.now()
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        for req, token in zip(rows, tokens):
            self._append(req, token, done_time)
        self._record(batch, prefill_tokens, decode_tokens, num_cached, now, done_time)
        return rows

    def wait_for_work(self) -> None:
        """Nothing could run: sleep (or jump the simulated clock) to the next arrival or timer."""
        now = self.clock.now()
        times = [t for t in (self._pending[0][0] if self._pending else None,
                             self.scheduler.next_wakeup(now)) if t is not None]
        if times:
            self.clock.wait_until(min(times))

    def _append(self, req: Request, token: int, t: float) -> None:
        req.append_token(token)
        self.metrics.on_token(req.request_id, t)
        status = None
        if token in req.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif req.params.stop and self._hit_stop_string(req):
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status, t)

    def _hit_stop_string(self, req: Request) -> bool:
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        hits = [(text.find(s), s) for s in req.params.stop if s in text]
        if not hits:
            return False
        cut, stop = min(hits)
        req.output_text = text[: cut + len(stop)] if req.params.include_stop_str_in_output else text[:cut]
        return True

    def _finish(self, req: Request, status: RequestStatus, t: float) -> None:
        if req.output_text is None:  # not already cut at a stop string
            req.output_text = (self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
                               if self.tokenizer is not None else "")
        req.status = status
        self.scheduler.finish(req)
        self.metrics.on_finish(req.request_id, t)
        del self.requests[req.request_id]

    def _record(self, batch: ScheduledBatch, prefill: int, decode: int, num_cached: int, start: float,
                end: float) -> None:
        usage = self.kv.usage()
        for req in batch.preempted:
            self.metrics.on_preempted(req.request_id)
        self.metrics.record_step(StepRecord(
            step=self.num_steps, start_time=start, duration_s=end - start,
            num_prefill_tokens=prefill, num_decode_tokens=decode, num_padding_tokens=batch.num_padding_tokens,
            num_seqs=len(batch.requests), num_waiting=self.scheduler.num_waiting,
            kv_used_tokens=usage.used_tokens, kv_reserved_tokens=usage.reserved_tokens,
            kv_total_tokens=usage.total_tokens, num_preemptions=len(batch.preempted), num_cached_tokens=num_cached))
        self.num_steps += 1
