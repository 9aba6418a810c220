"""Continuous (iteration-level) batching, Orca-style (chapter 04), with preemption (chapter 06).

Every step the batch is rebuilt: requests that finished last step are already gone, running
requests each get their next token(s), and waiting requests join while the token budget
(`max_num_batched_tokens`), the sequence limit (`max_num_seqs`) and the KV pool allow. Nobody
waits for the slowest member of a batch.

When the KV pool cannot hold a running request's next token, a victim is preempted — the most
recently admitted one under `scheduling_policy="fcfs"`, the lowest-priority running one under
`"priority"` (taken back out of this step's plan if it was already in it, as vLLM V1 does) —
and goes back into the waiting queue by its (priority, arrival) key. With
`preemption_mode="recompute"` its K/V are dropped and recomputed when it returns; with `"swap"`
they are copied to host memory and copied back (the executor does the copies, from the plan).

With prefix caching, `scheduling_policy="lpm"` (SGLang's longest prefix match, chapter 07) admits
first the waiting request with the most tokens already cached (ties: earliest arrival), so requests
that share a prefix run while it is still cached instead of being evicted by requests in between.
"""

from __future__ import annotations

from minillm.config import EngineConfig
from minillm.kv.base import KVManager
from minillm.kv.offload import host_block_id
from minillm.request import Request, RequestStatus
from minillm.scheduler.base import SchedulerBase, SchedulerPlan
from minillm.scheduler.chunk_policy import make_chunk_policy
from minillm.scheduler.waiting_queue import WaitingQueue

# Beyond this many waiting requests LPM falls back to queue order, as SGLang does: ranking costs a
# prefix-cache walk per waiting request per step.
LPM_MAX_WAITING = 128


class ContinuousScheduler(SchedulerBase):
    # The last steady-decode plan, handed out again while it fits (a class default: a learner's subclass
    # that writes its own __init__ inherits it too).
    _steady_plan: SchedulerPlan | None = None

    def __init__(self, config: EngineConfig, kv: KVManager, connector=None) -> None:
        """`connector`: a KV connector's scheduler side (minillm.kv_transfer): remote tokens, pinned blocks."""
        self.connector = connector
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(by_priority=config.scheduling_policy == "priority")
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.chunking = make_chunk_policy(config)  # the step's token budget: fixed, or SplitFuse's

    def add_request(self, request: Request) -> None:
        self.waiting.push(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_request(self, request_id: str) -> bool:
        return self.waiting.get(request_id) is not None or any(r.request_id == request_id for r in self.running)

    def schedule(self, now: float, more_arrivals: bool = True) -> SchedulerPlan | None:
        steady = self._schedule_steady_decode()  # (the common case, planned in one pass: see there)
        if steady is not None:
            return steady
        budget = self.chunking.step_budget(self.running, self.waiting) if self.config.enable_chunked_prefill \
            else self.config.max_num_batched_tokens
        planned: dict[str, tuple[Request, int]] = {}  # request id -> (request, new tokens), in planning order
        plan = SchedulerPlan([], [])

        # 1. Running requests first: each wants the rest of its known tokens (1 when decoding).
        #    With chunked prefill, decodes go before partly prefilled requests (stall-free, Sarathi-Serve).
        for req in self._running_order():
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            if n == 0:
                if budget == 0:
                    break
                continue  # nothing to compute (never happens today; a request with 0 tokens is never planned)
            if n > budget:
                break
            spec = req.spec_token_ids if n == 1 else []
            if spec:  # a decode row carries the proposer's guesses: 1 + k tokens, k of them unverified
                spec = spec[: budget - 1]
            while not self.kv.allocate(req, n, num_lookahead_tokens=len(spec)):
                if spec:  # guesses are optional: drop them before anyone is preempted for them
                    spec = []
                    continue
                victim = self._pick_victim()
                budget += planned.pop(victim.request_id, (None, 0))[1]  # taken back out of this step's plan
                self._preempt(victim, plan)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # req itself was the victim
            if spec:
                plan.spec_token_ids[req.request_id] = spec
            planned[req.request_id] = (req, n + len(spec))
            budget -= n + len(spec)

        # 2. Then admit waiting requests in queue order while there is room (LPM ranks them first).
        if self.waiting and not plan.preempted:
            for req in self._admission_order():
                if len(self.running) >= self.config.max_num_seqs or budget == 0:
                    break
                n = self._try_admit(req, budget, plan)
                if n is None:
                    break
                self.waiting.remove(req)
                plan.admitted.append((req, req.status))
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                planned[req.request_id] = (req, n)
                budget -= n

        if not planned:
            self.kv.discard_offload_copies()
            return None
        self._plan_offload_copies(plan)
        # Decode rows (one token after a computed context) first: the attention backend batches them.
        # (a speculative row of 1+k tokens is not a decode row)
        rows = sorted(planned.values(), key=lambda row: not (row[1] == 1 and row[0].num_computed_tokens))
        plan.requests = [r for r, _ in rows]
        plan.num_new_tokens = [n for _, n in rows]
        if self.connector is not None:  # what the workers load this step travels in the plan
            plan.kv_connector_metadata = self.connector.build_connector_meta(plan)
        return plan

    def _schedule_steady_decode(self) -> SchedulerPlan | None:
        """The plan of a steady decode step, or None: then `schedule` plans the general way.

        Steady: nothing waits, and every running request decodes one token without guesses, all
        within the step's token budget. The general loop would plan exactly this — every running
        request in running order (all decode rows, so the decode-first sort keeps it), one new token
        each, its KV grown by one slot — but pays per row for what such a step never needs: chunking,
        guesses, preemption, admission, the sort. vLLM V1's scheduler meets the same steady state
        with its persistent batch: rows that only advance by one token are sent as small diffs.
        If a row's KV does not fit, the general loop plans the step (it preempts); a slot reserved
        here is reserved once, not twice, when it asks again (`allocate` of the same tokens).

        The plan is marked `steady` (each row after a sampled token: no prompt token in the step) and,
        while the running requests stay the same and no offloaded block moves, the same object is
        returned again: nothing in it changes from one such step to the next."""
        running = self.running
        if (self.waiting or not running or self.connector is not None
                or len(running) > self.config.max_num_batched_tokens):
            return None
        for req in running:
            if req.spec_token_ids or not req.output_token_ids or \
                    len(req.all_token_ids) - req.num_computed_tokens != 1:
                return None  # (a row after its last prompt token has sampled one: it has an output)
        allocate = self.kv.allocate
        for req in running:
            if not allocate(req, 1):
                return None
        copies_out, copies_in = self.kv.take_offload_copies()
        plan = self._steady_plan
        if copies_out or copies_in or plan is None or plan.requests != running:
            plan = SchedulerPlan(list(running), [1] * len(running), steady=True)
            self._add_offload_copies(plan, copies_out, copies_in)
            self._steady_plan = None if copies_out or copies_in else plan
        return plan

    def _plan_offload_copies(self, plan: SchedulerPlan) -> None:
        """The prefix cache's offload tier (chapter 14) moves blocks through the swap fields, each host
        block under its own pseudo request id: spills out before the step's blocks are rewritten,
        host hits back in before the forward — the executor copies them like swapped requests."""
        self._add_offload_copies(plan, *self.kv.take_offload_copies())

    @staticmethod
    def _add_offload_copies(plan: SchedulerPlan, copies_out: list, copies_in: list) -> None:
        if copies_out:
            plan.blocks_to_swap_out.extend((host_block_id(slot), [block]) for block, slot in copies_out)
        if copies_in:
            plan.blocks_to_swap_in.extend((host_block_id(slot), [block]) for slot, block in copies_in)

    def _chunk(self, num_tokens: int, budget: int) -> int:
        """How many of a request's missing tokens it computes this step: all of them, or with chunked
        prefill as many as the budget (and `long_prefill_token_threshold`) allow."""
        if not self.config.enable_chunked_prefill:
            return num_tokens
        cap = self.config.long_prefill_token_threshold
        return min(num_tokens, budget, cap) if cap else min(num_tokens, budget)

    def _running_order(self) -> list[Request]:
        """Admission order; with chunked prefill, decoding requests first, then partly prefilled ones."""
        if not self.config.enable_chunked_prefill:
            return list(self.running)
        decoding, prefilling = [], []
        for r in self.running:
            (decoding if r.num_tokens - r.num_computed_tokens == 1 and r.num_computed_tokens else prefilling).append(r)
        return decoding + prefilling

    def _admission_order(self):
        """Queue order; under LPM the longest cached prefix first, then earliest arrival."""
        if self.config.scheduling_policy == "lpm" and len(self.waiting) <= LPM_MAX_WAITING:
            return self._sort_by_cached_prefix()
        return self._queue_head()

    def _queue_head(self):
        while self.waiting:  # the head changes as requests are admitted
            head = self.waiting.peek()
            yield head
            if head in self.waiting:
                return  # not admitted: admission stops at the first request that does not fit

    def _sort_by_cached_prefix(self) -> list[Request]:
        """LPM: longest cached prefix first, then queue order (stable for equal arrival times)."""
        return sorted(self.waiting, key=lambda r: -self.kv.cached_prefix_tokens(r))

    def _try_admit(self, req: Request, budget: int, plan: SchedulerPlan) -> int | None:
        """Reserve KV for a waiting request (swapped back in, or with any cached prefix attached);
        the number of tokens it computes this step, or None (and nothing changed) if it does not fit.
        With nothing running, the KV headroom (watermark) protects nobody and is not kept."""
        keep_headroom = bool(self.running)
        n = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
        if self.kv.is_swapped(req):
            if n > budget:
                return None
            blocks = self.kv.swap_in(req, n, keep_headroom)
            if blocks is None:
                return None
            plan.blocks_to_swap_in.append((req.request_id, blocks))
            return n
        cached = self.kv.get_computed_blocks(req)  # a cached prefix is not recomputed
        # ... nor are tokens whose K/V a KV connector supplies (a decode instance's remote prefill)
        external = self.connector.get_num_new_matched_tokens(req, cached.num_tokens)[0] if self.connector else 0
        n = self._chunk(req.num_tokens - cached.num_tokens - external, budget)
        req.num_computed_tokens = cached.num_tokens + external  # (can_admit counts blocks from here on)
        if n > budget or not self.kv.can_admit(req, n, keep_headroom, cached) or \
                not self.kv.allocate(req, n, cached=cached):
            req.num_computed_tokens = 0
            return None
        if external:
            self.connector.update_state_after_alloc(req, self.kv.block_ids_of(req.request_id), external)
        return n

    def _pick_victim(self) -> Request:
        """FCFS and LPM: the most recently admitted. Priority: the lowest priority (largest value) of
        all running requests — planned this step or not —, latest arrival first, then latest admitted."""
        if self.config.scheduling_policy == "priority":
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, plan: SchedulerPlan) -> None:
        self.running.remove(req)
        plan.spec_token_ids.pop(req.request_id, None)
        req.spec_token_ids, req.spec_draft_probs = [], None  # guesses for a context it no longer holds
        blocks = self.kv.swap_out(req) if self.config.preemption_mode == "swap" else None
        if blocks is not None:
            plan.blocks_to_swap_out.append((req.request_id, blocks))  # keeps num_computed_tokens
        else:
            self.kv.free(req)  # recompute (or the swap space is full)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(req)
        self.waiting.push(req)

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        if self.connector is None or not self.connector.request_finished(
                request, self.kv.block_ids_of(request.request_id))[0]:
            self.kv.free(request)  # (a KV producer may keep the blocks pinned until its consumer has them)
        self.waiting.forget(request)

    def rollback(self, plan: SchedulerPlan) -> None:
        """Undo `plan` (see `scheduler.base`): prefix-cache entries first, then the reservations."""
        lost = set(self.kv.rollback_step())
        for req, status in plan.admitted:
            self.running.remove(req)
            self.kv.free(req)
            if not self.kv.is_swapped(req):
                req.num_computed_tokens = 0
            req.status = status
            self.waiting.push(req)
        admitted = {r.request_id for r, _ in plan.admitted}
        for req in plan.requests:
            if req.request_id not in admitted:
                self.kv.trim(req, req.num_computed_tokens)
        for req in plan.preempted:
            if req.request_id in lost:
                req.num_computed_tokens = 0  # its swap-out copy never ran: it recomputes

    def abort(self, request_id: str) -> Request | None:
        req = self.waiting.get(request_id)
        if req is not None:
            self.waiting.remove(req)
        else:
            req = next((r for r in self.running if r.request_id == request_id), None)
            if req is None:
                return None
            self.running.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        if self.connector is not None:  # (an aborted request pins nothing; a pending load is dropped)
            self.connector.request_finished(req, self.kv.block_ids_of(req.request_id))
        self.kv.free(req)
        self.kv.drop_swapped(req)
        self.waiting.forget(req)
        return req
