"""Padding a batch, and counting what a padded batch wastes: the rectangle of static batching (chapter 02).

A static batch is a rectangle. Its prompts are left-padded to the longest one, so that every row's
last prompt token sits in the same column and every row's first generated token comes out of that
column; an attention mask tells the model which slots hold real tokens. Then all rows take decode
steps together until the longest output is done, rows that already finished included.

`pad_batch` builds the first step's rectangle, as an HF tokenizer with `padding_side="left"` does.
`static_batch_slots` counts the token slots a whole batch computes and how many of them were
useful, exactly as minillm's static engine records them (`StepRecord.num_padding_tokens`), and
`static_batch_steps` splits that count by step; so `padding_waste` predicts the engine's
`Summary.padding_waste`. Exercise ex02 checks a learner's
versions of these functions against this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def pad_batch(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id prompts into `input_ids` [B, S] (int64) and `attention_mask` [B, S] (1 = real token).

    S is the longest prompt; the pads go in front, so the last column holds every row's last token.
    """
    if len(prompts) == 0:
        raise ValueError("pad_batch needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


@dataclass(frozen=True)
class SlotCounts:
    """Token slots a batch-synchronous run computes, and how many of them held a real token."""

    computed_tokens: int
    useful_tokens: int

    @property
    def padding_tokens(self) -> int:
        return self.computed_tokens - self.useful_tokens

    @property
    def waste(self) -> float:
        """The share of computed slots spent on pads and finished rows."""
        return self.padding_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def __add__(self, other: SlotCounts) -> SlotCounts:
        return SlotCounts(self.computed_tokens + other.computed_tokens, self.useful_tokens + other.useful_tokens)


def static_batch_slots(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> SlotCounts:
    """One static batch run until its longest output is done.

    The prefill step computes B x S_max slots, of which sum(p) are prompt tokens. Then come
    O_max - 1 decode steps of B slots each: row i feeds back one generated token in o_i - 1 of
    them and is a finished row, computed for nothing, in the rest. (The last token a row samples
    is never fed back: hence the - 1.) So

        computed = B * (S_max + O_max - 1)     useful = sum(p_i + o_i - 1)

    and the padding, computed - useful = B * (S_max + O_max) - sum(p_i + o_i), is the number of
    empty cells of the B x (S_max + O_max) grid of prompt and output tokens.
    """
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(output_lens)} output lengths")
    if len(prompt_lens) == 0:
        raise ValueError("a batch needs at least one request")
    if min(prompt_lens) < 1 or min(output_lens) < 1:
        raise ValueError("every request has at least one prompt token and one output token")
    rows = len(prompt_lens)
    computed = rows * (max(prompt_lens) + max(output_lens) - 1)
    useful = sum(p + o - 1 for p, o in zip(prompt_lens, output_lens))
    return SlotCounts(computed, useful)


def static_batch_steps(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> list[SlotCounts]:
    """The same batch step by step, as the engine's `StepRecord`s count it.

    Step 1 (prefill): B x S_max slots, sum(p) of them prompt tokens. Step k = 2 .. O_max (decode):
    B slots, one useful for every row with o_i >= k (it feeds back its (k-1)-th token); the rest
    are rows that already finished.
    """
    static_batch_slots(prompt_lens, output_lens)  # validates the lengths
    rows = len(prompt_lens)
    steps = [SlotCounts(rows * max(prompt_lens), sum(prompt_lens))]
    steps += [SlotCounts(rows, sum(o >= k for o in output_lens)) for k in range(2, max(output_lens) + 1)]
    return steps


def static_run_slots(prompt_lens: Sequence[int], output_lens: Sequence[int], max_num_seqs: int) -> SlotCounts:
    """Requests that all wait from the start, run as static batches of `max_num_seqs` in arrival order."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    total = SlotCounts(0, 0)
    for start in range(0, len(prompt_lens), max_num_seqs):
        end = start + max_num_seqs
        total = total + static_batch_slots(prompt_lens[start:end], output_lens[start:end])
    return total


def padding_waste(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> float:
    """The share of one static batch's computed token slots that hold no real token (0 ≤ waste < 1)."""
    return static_batch_slots(prompt_lens, output_lens).waste
