"""A draft model as proposer (chapter 09): a small model of the same tokenizer guesses k tokens.

The draft keeps its own paged KV cache (its own `BlockManager`, the same block size) and, per
request, a shadow `Request` holding the tokens it has seen. Each step, for every request about to
decode, it first catches up on the tokens the target accepted since last time (one ragged
forward over all of them), then runs k−1 more one-token steps, sampling each guess the way the
target would sample (greedy stays greedy; otherwise the request's temperature/top-k/top-p, from a
generator of the draft's own so the request's stream is not consumed). Afterwards
`after_verify` trims the draft's KV back to what the target kept: draft K/V of rejected guesses
are dropped exactly like the target's.
"""

from __future__ import annotations

import torch

from minillm.executor.uniproc import UniProcExecutor
from minillm.kv.block_manager import BlockManager
from minillm.model.llama import LlamaModel
from minillm.request import Request, RequestStatus, SamplingParams, derive_seed
from minillm.scheduler.base import SchedulerPlan
from minillm.spec.rejection import target_probs
from minillm.worker.model_runner import ModelRunner


class DraftModelProposer:
    def __init__(self, model: LlamaModel, num_speculative_tokens: int, num_blocks: int, block_size: int,
                 max_model_len: int) -> None:
        c = model.config
        self.model = model
        self.k = num_speculative_tokens
        self.kv = BlockManager(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size, model.dtype,
                               str(model.device), max_model_len=max_model_len, watermark=0.0)
        # The draft's own worker, fed plans like the target's (in this process).
        self.executor = UniProcExecutor(ModelRunner(model, self.kv.cache_spec), self.kv)
        self.shadow: dict[str, Request] = {}

    def _shadow_of(self, req: Request) -> Request:
        shadow = self.shadow.get(req.request_id)
        if shadow is None:
            params = SamplingParams(max_tokens=1, temperature=req.params.temperature, top_p=req.params.top_p,
                                    top_k=req.params.top_k,
                                    seed=derive_seed(req.params.seed, "draft") if req.params.seed is not None
                                    else derive_seed(0, "draft:" + req.request_id))
            shadow = Request(req.request_id, [], params, 0.0, device=self.model.device)
            self.shadow[req.request_id] = shadow
        return shadow

    def propose(self, requests: list[Request], budgets: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per request at most `budgets[i]` guesses, and their draft distributions q [n, vocab]
        (None for greedy requests: the test compares with the target's argmax)."""
        active, counts, room = [], [], []
        for req, budget in zip(requests, budgets):
            k = min(self.k, budget)
            if k <= 0:
                continue
            shadow = self._shadow_of(req)
            shadow.all_token_ids = list(req.all_token_ids)  # the tokens the target has accepted so far
            n = shadow.num_tokens - shadow.num_computed_tokens
            if n < 1 or not self.kv.allocate(shadow, n, num_lookahead_tokens=k - 1):
                continue  # no room in the draft's cache: this request decodes without guesses
            active.append((req, shadow))
            counts.append(n)
            room.append(k)
        guesses: dict[str, list[int]] = {req.request_id: [] for req, _ in active}
        dists: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _ in active}
        rows = list(range(len(active)))
        step_counts = counts
        for _ in range(max(room, default=0)):  # guess 1 (after catching up), then one token per pass
            if not rows:
                break
            plan = SchedulerPlan([active[i][1] for i in rows], step_counts)
            logits, _ = self.executor.compute_logits(plan)
            for j, i in enumerate(rows):
                req, shadow = active[i]
                shadow.num_computed_tokens += step_counts[j]
                token, q = self._pick(req, shadow, logits[j])
                guesses[req.request_id].append(token)
                if q is not None:
                    dists[req.request_id].append(q)
                shadow.all_token_ids.append(token)  # fed on the next draft step (if any)
            rows = [i for i in rows if len(guesses[active[i][0].request_id]) < room[i]]
            step_counts = [1] * len(rows)
        self.kv.commit_step()
        out, probs = [], []
        for req in requests:
            g = guesses.get(req.request_id, [])
            out.append(g)
            d = dists.get(req.request_id)
            probs.append(torch.stack(d) if d else None)
        return out, probs

    def _pick(self, req: Request, shadow: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if req.params.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits[None], req)[0]
        return int(torch.multinomial(q, 1, generator=shadow.generator)), q

    def after_verify(self, req: Request) -> None:
        """The target kept `req.all_token_ids`: keep the draft's K/V only for the tokens both agree on."""
        shadow = self.shadow.get(req.request_id)
        if shadow is None:
            return
        kept = 0
        limit = min(shadow.num_computed_tokens, req.num_tokens)
        while kept < limit and shadow.all_token_ids[kept] == req.all_token_ids[kept]:
            kept += 1
        self.kv.trim(shadow, kept)
        shadow.num_computed_tokens = kept
        shadow.all_token_ids = shadow.all_token_ids[:kept]

    def free(self, req: Request) -> None:
        shadow = self.shadow.pop(req.request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
            shadow.status = RequestStatus.FINISHED_ABORTED  # its worker forgets it at the next plan
