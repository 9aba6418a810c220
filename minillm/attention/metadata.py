"""What attention knows about a step: the flat layout every backend starts from (chapters 04, 05, 10).

The worker computes one layout per step (`StepLayout`, numpy, from `minillm.worker.step_layout`)
and hands it to the step's attention backend, whose `build_metadata` turns it into what that
backend reads — vLLM's `AttentionMetadataBuilder` idea: the runner knows no backend's needs.
Every backend's metadata starts as `AttentionMetadata`, the varlen form attention kernels take
(FlashAttention's varlen API, vLLM's paged attention, `minillm.kernels` in chapter 10):

- `slot_mapping[T]`: where each new token's K/V are written;
- `query_start_loc[B+1]`: sequence b's new tokens are rows `query_start_loc[b] … [b+1]-1`;
- `seq_lens[B]`: sequence b's length including its new tokens (its queries are the last ones);
- `block_tables[B, max_blocks]` int32: its blocks in order, -1 after the last.

Decode rows (one query after a cached context) come first. A backend adds what it needs on top:
the torch backend its row groups (`RowGroup`, `minillm.attention.flat_pool`), and every backend
says how many keys its decode attention reads (`keys_read`), which the worker counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StepLayout:
    """One step's flat layout as the worker computed it (numpy), plus the model facts attention needs."""

    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    query_lens: np.ndarray  # [B] new tokens per sequence
    block_tables: np.ndarray  # [B, W] int32, -1 padded
    num_decode: int
    block_size: int
    null_block: int  # a block that holds nothing: padded reads point here
    device: torch.device
    sliding_windows: tuple[int | None, ...] = ()  # per layer (None: full attention)

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    def flat_metadata(self) -> AttentionMetadata:
        """The varlen metadata every backend starts from, as tensors on the model's device."""
        device = self.device
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(self.slot_mapping).to(device),
            query_start_loc=torch.from_numpy(self.query_start_loc).to(device),
            seq_lens=torch.from_numpy(self.seq_lens).to(device),
            block_tables=torch.from_numpy(self.block_tables).to(device),
            num_decode=self.num_decode, block_size=self.block_size, num_tokens=self.num_tokens,
            keys_read=int(self.seq_lens[: self.num_decode].sum()))


@dataclass
class RowGroup:
    """Rows that one SDPA call serves (the torch backend). Decode: `rows` are consecutive query rows.
    Multi-token: `query_index` [b * q_max] gathers (padded) query rows, `out_index` scatters back."""

    first_row: int  # index into the step's sequences (the B dimension)
    num_rows: int
    key_len: int  # keys per row read (num_blocks * block_size, or less for one partial block)
    block_ids: torch.Tensor  # [num_rows * num_blocks] pool blocks, padding → the null block
    seq_lens: torch.Tensor  # [num_rows, 1]
    q_max: int = 1
    query_index: torch.Tensor | None = None  # multi-token groups: [num_rows * q_max] rows of q
    query_lens: torch.Tensor | None = None  # [num_rows, 1]
    out_index: torch.Tensor | None = None  # rows of the output the valid queries go to
    valid: torch.Tensor | None = None  # [num_rows * q_max] which gathered queries are real
    fresh_causal: bool = False  # one whole prompt, nothing cached: its keys are this step's own
    token_slice: slice | None = None  # its rows of the flattened batch, when fresh_causal
    _masks: dict = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    """The step's layout in the varlen form kernels use, plus what a backend added (row groups)."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    num_decode: int  # sequences 0 … num_decode-1 are decode rows (token row == sequence index)
    block_size: int
    decode_groups: list[RowGroup] = field(default_factory=list)
    prefill_groups: list[RowGroup] = field(default_factory=list)
    num_tokens: int = 0
    keys_read: int = 0  # keys decode attention reads this step (a kernel reading each key once: the keys that exist)
