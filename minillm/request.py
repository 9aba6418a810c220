"""Requests, their sampling parameters, and what `LLM.generate` returns (chapters 00 and 03).

A `Request` is one prompt's whole life in the engine: it waits, runs (its KV grows one token per
step), may be preempted, and finishes with a reason. `num_computed_tokens` counts the tokens
whose K/V are already in the cache; the scheduler hands a request `num_tokens -
num_computed_tokens` new tokens at most, which is 1 in decode, the prompt in prefill, a chunk in
chunked prefill, and 1+k when speculating.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch


class RequestOutputKind(enum.Enum):
    """What each output of a running request carries (vLLM's `RequestOutputKind`)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what this step added (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline `generate`, non-streamed HTTP)


# The most top logprobs one token may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to pick the next tokens. Names and meanings follow vLLM's `SamplingParams`.

    Penalties (chapter 11), applied to the logits before temperature, in vLLM's order:
    `repetition_penalty` (HF/CTRL's: every token seen in prompt or output has a positive logit
    divided by it, a negative one multiplied), then OpenAI's `frequency_penalty` (minus the penalty
    times how often the token occurs in the output so far) and `presence_penalty` (minus the
    penalty once if it occurs in the output at all). `min_p` drops tokens whose probability is
    below min_p × the most likely one's; `min_tokens` forbids EOS and stop tokens (and ignores
    stop strings) until that many tokens came out.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: also the N most likely (vLLM's)
    prompt_logprobs: int | None = None  # not supported: the last layer computes logits for sampled rows only
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict | None = None  # vLLM's: for extensions (kv_transfer_params, minillm.kv_transfer)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (no limit) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1 means none), got {self.repetition_penalty!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported: minillm computes logits only for the rows it "
                             "samples (see minillm.worker.model_runner); leave it None")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop cannot contain an empty string (it would match everywhere), got stop={self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_child(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n > 1 request: one sequence each, and a seed of its own
        (seed + index when the request gave one, as vLLM does; else derived from the child's id)."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context length reached
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """One prompt moving through the engine.

    Who writes what: the engine creates it; the scheduler moves it between queues and is the only
    writer of `num_computed_tokens`, `status` and the output tokens (`update_from_output`); the
    runner and the KV manager only read it.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, eos_token_ids: tuple[int, ...] = (), priority: int = 0,
                 prompt: str | None = None, default_seed: int = 0, device: torch.device | str = "cpu",
                 detokenizer: Any = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)  # prompt + output, grown as tokens arrive
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_preemptions = 0
        self.output_text: str | None = None  # set on finish, by the engine's output processor only
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's)
        self.stopped_on_token = False  # ended by EOS or a stop token id: that token's text is not output (vLLM's)
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.output_logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.stop_token_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        # Speculative decoding (chapter 09): the proposer's guesses for the next step, not yet
        # verified (never in all_token_ids), and their draft distribution q [k, vocab] (None: one-hot).
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: Any = None
        # Stop strings are matched on the text as it grows (minillm.detokenizer), new text only.
        self.detokenizer = detokenizer
        # Where its outputs go (the server's per-request channel; None offline), what text a
        # DELTA stream has been sent, and why the engine gave up on it (a failed step), if it did.
        self.sink: Any = None
        self.sent_text = ""
        self.error: str | None = None
        # The seed of its random stream: the worker that samples it keeps a generator seeded so.
        self.seed = params.seed if params.seed is not None else default_seed
        self.generator: torch.Generator | None = None
        if not params.greedy:
            # On the device that samples: a CPU generator cannot drive torch.multinomial on CUDA.
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """After appending `token_id`: the finished status it causes, or None (vLLM's `check_stop`).

        A stop string is looked for only in the text this token added (plus the tail a string
        could straddle), so the cost per token does not grow with the output."""
        params, num_output = self.params, len(self.output_token_ids)  # (per token: no property calls)
        early = num_output < params.min_tokens  # no stop before min_tokens (vLLM's)
        if token_id in self.stop_token_ids and not early:
            # EOS is reported as stop_reason None; a user's stop token id by its id (vLLM's convention).
            if token_id in (self.params.stop_token_ids or ()):
                self.stop_reason = token_id
            self.stopped_on_token = True
            return RequestStatus.FINISHED_STOPPED
        if self.detokenizer is not None:
            stop = self.params.stop if not early else ()
            cut = self.detokenizer.append(token_id, stop, self.params.include_stop_str_in_output)
            if cut is not None:  # the detokenizer's text ends at the stop string now
                self.stop_reason = self.detokenizer.matched_stop
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or len(self.all_token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")


def derive_seed(engine_seed: int, request_id: str) -> int:
    """The random seed of a request that gave none: a function of (engine seed, request id) only,
    so it does not depend on how many requests came before (stable across processes, unlike hash())."""
    digest = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None  # filled when SamplingParams(logprobs=...) asks for logprobs
    logprobs: list[dict[int, float]] | None = None  # per output token: {token id: logprob}
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS/length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result, shaped like vLLM's `RequestOutput`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = field(default=None, repr=False)
    error: str | None = None  # why the engine refused or gave up on it (then finish_reason is "abort")
