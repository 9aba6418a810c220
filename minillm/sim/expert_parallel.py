"""Expert parallelism in the simulator: MoE shapes, all-to-all traffic and load per rank (chapter 12).

An MoE layer replaces the MLP by `num_experts` expert MLPs of which each token uses `top_k`. With
expert parallelism (EP) over `ep` devices each holds E/ep whole experts; every token travels to its
top-k experts' devices and back: two all-to-alls per MoE layer (dispatch, combine), priced by
`minillm.sim.network`. The layer then runs at the pace of its busiest rank: `load_imbalance` reads
that off a router histogram such as `minillm.model.moe.sparse_moe`'s `tokens_per_expert`.

`moe_layer_time` prices the experts of one step on the busiest device, sliced (TP) or whole (EP),
from such a histogram: a device reads the weights of every expert it holds that got at least one
row, and computes its rows. In a memory-bound decode that favours slicing at small batch (TP reads
1/n of the few experts chosen, EP a whole one on some device), and in a compute-bound prefill it
shows the imbalance (EP's busiest device computes more than 1/n of the rows).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from minillm.sim.hardware import Hardware
from minillm.sim.model_shapes import ModelShape, from_hf_config
from minillm.sim.network import Link, all_reduce_time_s, all_to_all_time_s
from minillm.sim.parallel import check_tp, layer_params_per_device


@dataclass(frozen=True)
class MoEShape:
    """An MoE decoder: the dense shape (attention, embeddings) and, in each layer, `num_experts`
    SwiGLU experts of `shape.intermediate_size`, of which each token uses `top_k`."""

    shape: ModelShape
    num_experts: int
    top_k: int

    @property
    def expert_params(self) -> int:
        return 3 * self.shape.hidden_size * self.shape.intermediate_size

    @property
    def num_params(self) -> int:
        s = self.shape
        router = self.num_experts * s.hidden_size
        experts = (self.num_experts - 1) * self.expert_params  # ModelShape counts one MLP already
        return s.num_params + s.num_layers * (experts + router)

    @property
    def active_params(self) -> int:
        """Parameters one token is multiplied through (k experts per layer)."""
        return self.num_params - self.shape.num_layers * (self.num_experts - self.top_k) * self.expert_params


def moe_shape_from_hf_config(model_dir: str | Path) -> MoEShape:
    """An `MoEShape` from a Mixtral-style config.json (num_local_experts, num_experts_per_tok)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "num_local_experts" not in config:
        raise ValueError(f"{model_dir}: config.json has no num_local_experts (not a Mixtral-style MoE model)")
    return MoEShape(from_hf_config(model_dir), config["num_local_experts"], config["num_experts_per_tok"])


# Mixtral 8x7B, from mistralai/Mixtral-8x7B-v0.1's config.json (Jiang et al., 2024, "Mixtral of
# Experts"): 32 layers, hidden 4096, 32 query / 8 KV heads, 8 experts of 14336, top 2, vocab 32000.
MIXTRAL_8X7B = MoEShape(ModelShape("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000), num_experts=8, top_k=2)
# Mixtral 8x22B, from mistral-community/Mixtral-8x22B-v0.1's config.json (Mistral AI, April 2024:
# "141B parameters, 39B active"): 56 layers, hidden 6144, 48 query / 8 KV heads of 128, 8 experts
# of 16384, top 2, vocab 32000. The 70B-class MoE beside Llama-2-70B.
MIXTRAL_8X22B = MoEShape(ModelShape("mixtral-8x22b", 56, 6144, 48, 8, 128, 16384, 32000), num_experts=8, top_k=2)


def ep_expert_bytes_per_device(moe: MoEShape, ep: int, dtype_bytes: int = 2) -> float:
    """Expert weights each EP rank holds: num_experts / ep whole experts per layer."""
    if ep < 1 or moe.num_experts % ep:
        raise ValueError(f"{moe.num_experts} experts cannot be split evenly over expert parallel size {ep}")
    return moe.shape.num_layers * (moe.num_experts // ep) * moe.expert_params * dtype_bytes


def moe_weight_bytes_per_device(moe: MoEShape, num_devices: int, dtype_bytes: int = 2) -> float:
    """Weights on each of `num_devices` devices with vLLM's `enable_expert_parallel=True`: attention,
    embedding and lm_head tensor-parallel over the devices (KV heads replicated when fewer than
    devices), experts whole, num_experts / num_devices per device; norms and router on every device.
    (Without EP every expert is sliced 1/num_devices instead: the same bytes, other messages.)"""
    s = moe.shape
    check_tp(s, num_devices)
    dense_layer = layer_params_per_device(dataclasses.replace(s, intermediate_size=0), num_devices)
    router = moe.num_experts * s.hidden_size
    vocab = math.ceil(s.vocab_size / num_devices) * s.hidden_size * (1 if s.tied_embeddings else 2)
    params = s.num_layers * (dense_layer + router) + vocab + s.hidden_size
    return params * dtype_bytes + ep_expert_bytes_per_device(moe, num_devices, dtype_bytes)


def ep_all_to_all_per_layer_s(moe: MoEShape, tokens_per_device: int, ep: int, link: Link, dtype_bytes: int = 2) -> float:
    """Dispatch + combine of one MoE layer: two all-to-alls of each device's tokens x top_k hidden
    vectors (with even routing, (ep-1)/ep of them leave the device)."""
    send_bytes = tokens_per_device * moe.top_k * moe.shape.hidden_size * dtype_bytes
    return 2 * all_to_all_time_s(send_bytes, ep, link)


def ep_step_comm_s(moe: MoEShape, tokens_per_device: int, ep: int, link: Link, dtype_bytes: int = 2) -> float:
    """All-to-all time of one step, every layer being an MoE layer."""
    return moe.shape.num_layers * ep_all_to_all_per_layer_s(moe, tokens_per_device, ep, link, dtype_bytes)


def rank_loads(tokens_per_expert: Sequence[int], ep: int) -> list[int]:
    """Routed tokens each EP rank computes, experts placed contiguously (rank r: experts r·E/ep ...)."""
    num_experts = len(tokens_per_expert)
    if ep < 1 or num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split evenly over expert parallel size {ep}")
    per_rank = num_experts // ep
    return [sum(tokens_per_expert[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]


def load_imbalance(tokens_per_expert: Sequence[int], ep: int) -> float:
    """Busiest rank's load over the mean: the MoE layer runs at the pace of its busiest rank."""
    loads = rank_loads(tokens_per_expert, ep)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def even_routing(moe: MoEShape, num_tokens: int) -> list[float]:
    """Rows per expert when `num_tokens` tokens spread evenly (each expert num_tokens·k/E rows)."""
    return [num_tokens * moe.top_k / moe.num_experts] * moe.num_experts


@dataclass(frozen=True)
class MoELayerCost:
    """The experts of one MoE layer in one step, on the busiest of `num_devices` devices (attention
    tensor-parallel: every device has every token, picks the rows of its experts, and one
    all-reduce of [tokens, hidden] sums the devices' outputs, as after a dense MLP)."""

    num_devices: int
    expert_parallel: bool
    rows: float  # routed rows the busiest device computes (a slice of each for TP)
    weight_bytes: float  # expert weights it reads: its experts that got at least one row
    compute_s: float
    memory_s: float
    comm_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s


def moe_layer_time(hw: Hardware, moe: MoEShape, num_devices: int, link: Link,
                   tokens_per_expert: Sequence[float], *, expert_parallel: bool) -> MoELayerCost:
    """One MoE layer's experts over `num_devices` devices: each expert sliced 1/n on every device
    (`expert_parallel=False`, vLLM's default) or whole, E/n per device (`enable_expert_parallel`)."""
    if len(tokens_per_expert) != moe.num_experts:
        raise ValueError(f"tokens_per_expert has {len(tokens_per_expert)} entries, the model {moe.num_experts} experts")
    num_tokens = sum(tokens_per_expert) / moe.top_k
    b, n, params = hw.dtype_bytes, num_devices, moe.expert_params
    if expert_parallel:
        per_rank = moe.num_experts // n
        ep_expert_bytes_per_device(moe, n, b)  # refuses a count that does not divide
        ranks = [tokens_per_expert[r * per_rank:(r + 1) * per_rank] for r in range(n)]
        costs = [(sum(rows), sum(1 for x in rows if x > 0) * params * b) for rows in ranks]
    else:
        hit = sum(1 for x in tokens_per_expert if x > 0)
        costs = [(sum(tokens_per_expert) / n, hit * params * b / n)]

    def time(rows: float, weight_bytes: float) -> float:
        return max(2 * rows * params / (hw.peak_flops * hw.mfu), weight_bytes / (hw.mem_bandwidth_bytes_per_s * hw.mbu))

    rows, weight_bytes = max(costs, key=lambda c: time(*c))
    comm_s = all_reduce_time_s(num_tokens * moe.shape.hidden_size * b, n, link)
    return MoELayerCost(num_devices=n, expert_parallel=expert_parallel, rows=rows, weight_bytes=weight_bytes,
                        compute_s=2 * rows * params / (hw.peak_flops * hw.mfu),
                        memory_s=weight_bytes / (hw.mem_bandwidth_bytes_per_s * hw.mbu), comm_s=comm_s)

