"""Speculative against plain decoding on the wall clock, measured as ratios within one run (chapter 09).

A wall-clock time taken on a shared machine says as much about the neighbours as about the code,
so no time is compared across runs: each repetition serves the same prompts with every system, one
right after the other (the order rotates, so no system always runs first), and only the ratio
within a repetition — plain decoding's time ÷ the system's — is kept. The median of the
repetitions' ratios is the estimate, their spread (min–max) says how far to trust it, and
`verdict` turns them into words only when every repetition agrees. The deterministic counts ride
along: target forward passes, guesses proposed and accepted (the same on every run, greedy).

Used by chapter 09's wall-clock section and `bench/spec_batch1.py`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from minillm.llm import LLM
from minillm.request import SamplingParams


@dataclass
class SystemRuns:
    """One system's repetitions: times, and what the first repetition emitted and counted."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # this process's CPU time (what the neighbours take is not in it)
    tokens: list[list[int]] = field(default_factory=list)
    target_passes: int = 0  # engine steps: target forward passes
    num_drafts: int = 0  # speculative rows verified
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a speculative row emitted on average: 1 + accepted guesses."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def interleaved_runs(llms: dict[str, LLM], prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                     repeats: int = 3) -> dict[str, SystemRuns]:
    """Serve `prompts` (token ids) with every engine in `llms`, `repeats` times, interleaved."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    names = list(llms)
    runs = {name: SystemRuns() for name in names}
    batch = [{"prompt_token_ids": p} for p in prompts]
    for llm in llms.values():  # warm-up: first-call costs stay out of every repetition
        llm.generate(batch[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            llm, run = llms[name], runs[name]
            llm.engine.metrics = type(llm.engine.metrics)()
            wall, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(batch, params, use_tqdm=False)
            run.wall_s.append(time.perf_counter() - wall)
            run.cpu_s.append(time.process_time() - cpu)
            if rep == 0:
                run.tokens = [o.outputs[0].token_ids for o in outs]
                stats = llm.engine.metrics.spec_decode
                run.target_passes = len(llm.engine.metrics.steps)
                run.num_drafts, run.num_draft_tokens = stats.num_drafts, stats.num_draft_tokens
                run.num_accepted_tokens = stats.num_accepted_tokens
    return runs


@dataclass(frozen=True)
class Speedup:
    """Per-repetition ratios baseline time ÷ system time (above 1: the system is faster)."""

    ratios: tuple[float, ...]

    @classmethod
    def of(cls, baseline: SystemRuns, system: SystemRuns, clock: str = "wall") -> Speedup:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
        base, mine = (baseline.wall_s, system.wall_s) if clock == "wall" else (baseline.cpu_s, system.cpu_s)
        return cls(tuple(b / s for b, s in zip(base, mine)))

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def __str__(self) -> str:
        return f"{self.median:.2f}× (median of {len(self.ratios)}; {min(self.ratios):.2f}–{max(self.ratios):.2f}×)"

    @property
    def verdict(self) -> str:
        """'pays' when every repetition was faster, 'does not pay' when every one was slower, else
        'is within the noise'."""
        if min(self.ratios) > 1:
            return "pays"
        if max(self.ratios) < 1:
            return "does not pay"
        return "is within the noise"
