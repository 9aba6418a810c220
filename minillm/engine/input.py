"""Input processing: a prompt and its parameters, checked and tokenized into a `Request` (chapter 11).

Every refusal is a `ValueError` naming what was wrong and what is accepted (the server turns it
into HTTP 400). Parameters are checked where they are built (`SamplingParams.__post_init__`);
what needs the engine — its tokenizer, vocabulary, context length, speculative decoding — is
checked here.
"""

from __future__ import annotations

from typing import Any

from minillm.config import EngineConfig
from minillm.detokenizer import IncrementalDetokenizer
from minillm.model.config import ModelConfig
from minillm.request import Request, RequestOutputKind, SamplingParams, derive_seed


class InputProcessor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Any, device: Any) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.device = device
        self.eos_token_ids = tuple(model_config.eos_token_ids)

    def make_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                     arrival_time: float, priority: int, streams: bool) -> Request:
        """A checked Request; `streams`: its outputs go out while it runs (text is detokenized as it grows)."""
        if params.n != 1:
            raise ValueError(f"the engine runs one sequence per request; n={params.n} is fanned out by the caller "
                             "(LLM.generate, the server) into n requests with SamplingParams.for_child(i)")
        if self.config.speculative_config is not None and (params.has_penalties or params.min_tokens):
            raise ValueError("presence_penalty, frequency_penalty, repetition_penalty and min_tokens are not "
                             "supported with speculative_config (the rejection sampler does not apply them)")
        text, token_ids = self.tokenize(prompt)
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
        detokenizer = None
        if self.tokenizer is not None and (params.stop or (streams and params.output_kind is not
                                                           RequestOutputKind.FINAL_ONLY)):
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        return Request(request_id, token_ids, params, arrival_time, self.eos_token_ids, priority, text,
                       derive_seed(self.config.seed, request_id), device=self.device, detokenizer=detokenizer)

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
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
