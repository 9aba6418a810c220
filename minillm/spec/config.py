"""`speculative_config`, as vLLM takes it (chapter 09).

    LLM(..., speculative_config={"method": "draft_model", "model": "models/minillm-draft", "num_speculative_tokens": 4})
    LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 1})
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("draft_model", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: an HF directory (default: the bundled draft)
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up ...
    prompt_lookup_min: int = 1  # ... down to this length

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r}; choose one of {METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no model")

    @classmethod
    def from_dict(cls, config: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        missing = [k for k in ("method", "num_speculative_tokens") if k not in config]
        if missing:
            raise ValueError(f"speculative_config needs {missing}")
        return cls(**config)
