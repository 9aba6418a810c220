"""Compile and warm up at start-up, not inside the first `generate` (chapter 10).

numba compiles a kernel the first time it sees a new combination of argument types, and oneDNN
builds a matmul primitive the first time it sees a new row count. Left alone, both happen inside
the first request that needs them: on a fresh machine the first `generate` of the bundled model
took 5.4 s where the second took a few ms (issue 25). vLLM pays this before it serves
(`compile_or_warm_up_model`: dummy runs, then CUDA-graph capture) and says so in its log; so does
minillm.

`warm_up(runner)` feeds the worker a short private script of plans, exactly as the scheduler would:
one prefill step that admits a batch of dummy requests (one of them with a prompt longer than a
block, so the multi-block paths run), then decode steps at every batch size from the largest down
to 1 (one dummy finishes after each step). Every kernel the step runs — the flat layout pass, the
decode attention kernel, the fused CPU ops, the matmuls at each decode row count — is compiled or
primed for the dtypes this engine uses. Then the dummies are forgotten, the blocks they wrote are
zeroed, and the runner's counters are put back, so nothing a chapter measures or prints sees them.

The dummies use blocks no request has yet (nothing is allocated before the engine starts) and skip
the null block. A runner without a paged pool (static and dynamic batching's padded rectangle)
runs torch only and has nothing to compile: it is left alone.

`tools/fill_numba_cache.py` builds the bundled model once per CPU dtype, which fills numba's on-disk
cache (`make install` runs it), so no chapter pays the compile.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from minillm.request import SamplingParams
from minillm.scheduler.output import BlockUpdate, NewRequestData, SchedulerOutput

logger = logging.getLogger("minillm.warm_up")

_GREEDY = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)
_COUNTERS = ("keys_read", "keys_exist", "model_time_s")
_WARMED: set[tuple] = set()  # what this process has warmed: numba's and oneDNN's caches are per process


@dataclass
class WarmUpReport:
    """What a warm-up ran: decode batch sizes 1 … `max_batch`, and how long it took."""

    max_batch: int
    num_steps: int
    seconds: float
    skipped: str = ""  # why nothing ran, if nothing did
    # numba in this process so far: kernel versions loaded from its on-disk cache, and compiled (a cache miss)
    numba_cache_hits: int = 0
    numba_compiled: int = 0

    def __str__(self) -> str:
        if self.skipped:
            return f"warm-up skipped: {self.skipped}"
        return (f"warm-up: compiled the step's kernels and ran decode at batch sizes 1-{self.max_batch} "
                f"({self.num_steps} steps) in {self.seconds:.2f} s; numba: {self.numba_cache_hits} kernel "
                f"versions loaded from its cache, {self.numba_compiled} compiled")


def numba_cache_counts() -> tuple[int, int]:
    """(kernel versions numba loaded from its on-disk cache, versions it compiled) in this process so far,
    over minillm's and kernels/' jitted functions. A warm machine compiles nothing (`make install` filled the
    cache: tools/fill_numba_cache.py); a compile here means the cache was missing or stale."""
    if "numba" not in sys.modules:
        return 0, 0
    from numba.core.dispatcher import Dispatcher

    seen: dict[int, Dispatcher] = {}
    for name, module in list(sys.modules.items()):
        if name.startswith(("minillm", "kernels")) and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, Dispatcher):
                    seen[id(value)] = value
    hits = sum(sum(d.stats.cache_hits.values()) for d in seen.values())
    misses = sum(sum(d.stats.cache_misses.values()) for d in seen.values())
    return hits, misses


def _blocks_needed(batch: int, long_prompt: int, block_size: int) -> tuple[int, int]:
    """(blocks in all, blocks of the longest row) for `batch` dummies: the first with a long prompt,
    the rest with one token each, and each decoding up to `batch` tokens more."""
    longest = -(-(long_prompt + batch) // block_size)
    return longest + (batch - 1) * -(-(1 + batch) // block_size), longest


def warm_up(runner, max_num_seqs: int) -> WarmUpReport:
    """Run a private script of dummy plans through `runner` (a `ModelRunner`) and undo its traces.

    The dummies use blocks of the pool nobody holds yet (call it before the first request); a small
    pool or a short block table warms a smaller batch."""
    if runner.k_pool is None:
        return WarmUpReport(0, 0, 0.0, "no paged KV pool (padded batching runs torch only)")
    spec, block_size = runner.cache_spec, runner.block_size
    free = [b for b in range(spec.num_slots // block_size) if b != runner.null_block]
    long_prompt = block_size + 1 if spec.max_blocks_per_seq > 2 else 2  # two blocks: the multi-block paths
    batch = max_num_seqs
    while batch > 0:
        total, longest = _blocks_needed(batch, long_prompt, block_size)
        if total <= len(free) and longest <= spec.max_blocks_per_seq:
            break
        batch -= 1
    if batch < 1:
        return WarmUpReport(0, 0, 0.0, f"a pool of {len(free)} blocks is too small")
    key = (repr(runner.model.config), str(runner.model.dtype), str(runner.model.device), runner.attention_backend,
           block_size, batch, spec.kv_cache_dtype)
    if key in _WARMED:  # this process compiled and primed the same shapes already
        return WarmUpReport(batch, 0, 0.0, "this process warmed the same model and shapes already")
    start = time.perf_counter()
    saved = {name: getattr(runner, name) for name in _COUNTERS}
    blocks = iter(free)
    vocab = runner.model.config.vocab_size
    ids = [f"__warm_up_{i}" for i in range(batch)]
    tables, prompts = {}, {}
    for i, rid in enumerate(ids):
        n = long_prompt if i == 0 else 1
        prompts[rid] = [(7 * i + j) % vocab for j in range(n)]
        tables[rid] = [next(blocks) for _ in range(-(-(n + batch) // block_size))]
    used = [b for t in tables.values() for b in t]
    plan = SchedulerOutput(
        new_requests=[NewRequestData(rid, prompts[rid], _GREEDY, 0, []) for rid in ids],
        req_ids=list(ids), num_scheduled_tokens=[len(prompts[r]) for r in ids], num_computed_tokens=[0] * batch,
        new_token_ids=[list(prompts[r]) for r in ids], is_decode=[False] * batch, samples=[True] * batch,
        block_updates=[BlockUpdate(rid, 0, tables[rid]) for rid in ids], blocks_to_zero=list(used))
    steps = 0
    try:
        runner.execute_model(plan)  # (a rank that does not sample returns None: the dummies' tokens are made up)
        steps += 1
        computed = {rid: len(prompts[rid]) for rid in ids}
        live = list(ids)
        while live:  # decode at batch sizes batch, batch - 1, ..., 1
            plan = SchedulerOutput(
                new_requests=[], req_ids=list(live), num_scheduled_tokens=[1] * len(live),
                num_computed_tokens=[computed[r] for r in live],
                new_token_ids=[[(computed[r] * 13 + 5) % vocab] for r in live],
                is_decode=[True] * len(live), samples=[True] * len(live))
            runner.execute_model(plan)
            steps += 1
            for rid in live:
                computed[rid] += 1
            live.pop()
    finally:  # forget the dummies, zero what they wrote, put the counters back
        runner.update_state(SchedulerOutput(
            new_requests=[], req_ids=[], num_scheduled_tokens=[], num_computed_tokens=[], new_token_ids=[],
            is_decode=[], samples=[], finished_req_ids=ids[::-1], blocks_to_zero=list(used)))
        # (in reverse, so the input batch hands out rows from 0 again, as a fresh one does)
        for name, value in saved.items():
            setattr(runner, name, value)
    _WARMED.add(key)
    report = WarmUpReport(batch, steps, time.perf_counter() - start, "", *numba_cache_counts())
    logger.info("%s", report)
    return report
