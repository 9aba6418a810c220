"""Request bodies of the OpenAI API, with vLLM's extra sampling parameters (chapter 11).

Pydantic checks types and ranges; every failure becomes a 400 naming the field (see
`minillm.server.errors`). Fields the OpenAI API has and minillm does not implement (`logit_bias`,
`suffix`, `echo`, `best_of` > n, `tools`) are refused with a message rather than silently
ignored; unknown fields are ignored, as vLLM does.

Defaults follow vLLM: completions default to `max_tokens=16` (OpenAI's default), chat to "as many
as fit in max_model_len".
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator

from minillm.request import MAX_LOGPROBS, RequestOutputKind, SamplingParams

Int = StrictInt  # "16" or true are type errors, not 16 or 1
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # 1 and 0.5, not "0.5" or true
INT64 = 2**63  # torch seeds a generator with a signed 64-bit integer


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage in every chunk too


class SamplingFields(BaseModel):
    """What completions and chat share: OpenAI's sampling fields and vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the one model this server serves (vLLM's behaviour)
    n: Annotated[Int, Field(ge=1, le=128)] = 1
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[Int, Field(ge=-INT64, lt=INT64)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0.0)] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[Int, Field(ge=0)] = 0
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: Int | None = None
    kv_transfer_params: dict | None = None  # vLLM's: a prefill/decode pair's transfer (minillm.kv_transfer)

    # Cross-field checks are field validators (on the later field), so the 400 names the field (`param`).
    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("stream") is False:
            raise ValueError("stream_options can only be set when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported by minillm")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, value):
        if value is not None:
            raise ValueError("prompt_logprobs is not supported by minillm (logits are computed for sampled rows only)")
        return value

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            extra_args=None if self.kv_transfer_params is None else {"kv_transfer_params": self.kv_transfer_params})


class CompletionRequest(SamplingFields):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Annotated[Int, Field(ge=1)] | None = 16
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: Annotated[Int, Field(ge=1)] | None = None

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        if value:
            raise ValueError(f"{info.field_name} is not supported by minillm")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info: ValidationInfo):
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"best_of must equal n (minillm returns every sample), got best_of={value}, n={n}")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt is empty: give a string, a list of token ids, or a list of those")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string, one list of ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True  # vLLM's extra
    tools: list | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info: ValidationInfo):
        if value and info.data.get("logprobs") is False:
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value):
        if value:
            raise ValueError("tools are not supported by minillm")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
