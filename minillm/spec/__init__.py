"""Speculative decoding (chapter 09): a cheap proposer guesses k tokens, the target checks them all
in one forward pass, and a rejection sampler keeps exactly the target's distribution.

- `config.SpeculativeConfig` — vLLM's `speculative_config` dict, checked.
- `ngram.NgramProposer` — prompt lookup: copy what followed the last occurrence of the current suffix.
- `draft.DraftModelProposer` — a small model of the same tokenizer, with its own KV cache.
- `rejection.rejection_sample` — Leviathan et al. 2023: accept, or resample from max(0, p − q).
"""

from minillm.spec.config import SpeculativeConfig
from minillm.spec.rejection import rejection_sample

__all__ = ["SpeculativeConfig", "rejection_sample"]
