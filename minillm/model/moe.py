"""The sparse mixture-of-experts MLP (Mixtral style), taught in chapter 12 (expert parallelism).

In an MoE layer the MLP is replaced by `num_experts` MLPs ("experts") and a router. For each token
of the flattened batch `[T, hidden]`:

    router logits  = x · W_router^T                    [T, E]
    probabilities  = softmax(logits)                   (in float32, as transformers does)
    top-k experts  = the k most probable; their probabilities renormalised to sum to 1 (Mixtral)
    output         = Σ_k  weight_k · expert_k(x)       expert(x) = down(silu(gate(x)) · up(x))

A token only runs k of the E experts, so the layer holds E MLPs' weights but spends k MLPs' FLOPs.
The work is done expert by expert: the (token, slot) pairs are sorted by expert so that each
expert's tokens form one contiguous block (`Dispatch`). That block layout is exactly what expert
parallelism sends with one all-to-all: rank r owns a contiguous range of experts, so the rows for
its experts are one slice of the sorted buffer. `tokens_per_expert` — the router's load histogram —
is returned for the step records: an expert that gets most tokens makes its rank the straggler.

`minillm.model.llama.LlamaModel.forward` runs it in place of the MLP of an MoE layer (through
`LlamaModel.moe_forward`, which expert parallelism replaces: minillm/distributed/moe.py) and returns
each step's histogram for the step records. A family names its experts' tensors once (`ExpertNames`);
`read_experts` reads them for the loader, `moe_weights_from_state` for one layer of a state dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class MoEWeights:
    """One layer's router and experts. Each expert's gate and up projections are fused, as in
    `LayerWeights.gate_up` (gate rows first), so one matmul computes both."""

    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2·intermediate, hidden]
    down: torch.Tensor  # [E, hidden, intermediate]
    top_k: int
    renormalize: bool = True  # Mixtral renormalises the top-k probabilities; Qwen2-MoE: norm_topk_prob

    def __post_init__(self) -> None:
        num_experts, hidden = self.router.shape
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and the number of experts ({num_experts})")
        if self.gate_up.shape[0] != num_experts or self.down.shape[0] != num_experts:
            raise ValueError(
                f"router has {num_experts} experts but gate_up has {self.gate_up.shape[0]} and down "
                f"{self.down.shape[0]}"
            )
        if self.gate_up.shape[2] != hidden or self.down.shape[1] != hidden or self.gate_up.shape[1] != 2 * self.down.shape[2]:
            raise ValueError(
                f"expert shapes gate_up {tuple(self.gate_up.shape)}, down {tuple(self.down.shape)} do not fit "
                f"hidden {hidden} (expected [E, 2·I, {hidden}] and [E, {hidden}, I])"
            )

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]


@dataclass
class Routing:
    """The router's decision for each token: which k experts, with which weights."""

    logits: torch.Tensor  # [T, E] in the model's dtype
    expert_ids: torch.Tensor  # [T, k] int64
    weights: torch.Tensor  # [T, k] float32 (softmax probabilities of the chosen experts)


@dataclass
class Dispatch:
    """The (token, slot) pairs sorted by expert: expert e's rows are [offsets[e], offsets[e+1])."""

    token_index: torch.Tensor  # [T·k] which token each sorted row comes from
    weights: torch.Tensor  # [T·k] its routing weight
    tokens_per_expert: torch.Tensor  # [E] int64: the load histogram
    offsets: torch.Tensor  # [E + 1] int64: exclusive prefix sum of tokens_per_expert


@dataclass
class MoEOutput:
    hidden: torch.Tensor  # [T, hidden]
    tokens_per_expert: torch.Tensor  # [E] int64, for the step records


def route(hidden: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool = True) -> Routing:
    """Router logits → softmax → top-k (→ renormalised). The softmax runs in float32 as transformers'
    Mixtral does (for float64 models too), so routing decisions match it exactly."""
    logits = F.linear(hidden, router)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits=logits, expert_ids=expert_ids, weights=weights)


def dispatch(routing: Routing, num_experts: int) -> Dispatch:
    """Group the T·k (token, slot) pairs by expert; a stable sort keeps token order within an expert."""
    flat_experts = routing.expert_ids.flatten()
    order = torch.argsort(flat_experts, stable=True)
    top_k = routing.expert_ids.shape[1]
    tokens_per_expert = torch.bincount(flat_experts, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=flat_experts.device)
    offsets[1:] = torch.cumsum(tokens_per_expert, dim=0)
    return Dispatch(
        token_index=order // top_k,
        weights=routing.weights.flatten()[order],
        tokens_per_expert=tokens_per_expert,
        offsets=offsets,
    )


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert: the Llama SwiGLU MLP, down(silu(gate(x)) · up(x))."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def sparse_moe(hidden: torch.Tensor, w: MoEWeights, experts: range | None = None) -> MoEOutput:
    """The MoE MLP on a flattened batch [T, hidden].

    `experts` restricts the work to a contiguous range of experts (an expert-parallel rank's own):
    the result is then that range's share of the sum, and the shares of all ranks add up to the
    full output. `tokens_per_expert` always counts every expert (the router runs on every rank).
    """
    experts = range(w.num_experts) if experts is None else experts
    if experts.step != 1 or not (0 <= experts.start <= experts.stop <= w.num_experts):
        raise ValueError(f"experts={experts} must be a contiguous range within range({w.num_experts})")
    routing = route(hidden, w.router, w.top_k, w.renormalize)
    d = dispatch(routing, w.num_experts)
    out = torch.zeros_like(hidden)
    offsets = d.offsets.tolist()
    for e in experts:
        start, end = offsets[e], offsets[e + 1]
        if start == end:
            continue  # no token chose this expert in this step
        rows = d.token_index[start:end]
        y = expert_mlp(hidden.index_select(0, rows), w.gate_up[e], w.down[e])
        out.index_add_(0, rows, y * d.weights[start:end, None].to(y.dtype))
    return MoEOutput(hidden=out, tokens_per_expert=d.tokens_per_expert)


def expert_ranges(num_experts: int, ep_size: int) -> list[range]:
    """Experts per expert-parallel rank, contiguous (vLLM's default placement): rank r owns range r."""
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(
            f"{num_experts} experts cannot be split evenly over {ep_size} expert-parallel ranks; "
            f"use a size that divides {num_experts}"
        )
    per_rank = num_experts // ep_size
    return [range(r * per_rank, (r + 1) * per_rank) for r in range(ep_size)]


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoint keeps one layer's router and experts, under `model.layers.{i}.`;
    `{e}` stands for the expert's number. A family spells them once, in its model file."""

    router: str  # [E, hidden]
    gate: str  # [intermediate, hidden], one per expert
    up: str
    down: str  # [hidden, intermediate]


# Mixtral's, kept here rather than in minillm/model/mixtral.py: moe_weights_from_state (chapter 12) reads them
# by default, and mixtral.py imports this module (the other way round would be an import circle).
MIXTRAL_EXPERT_NAMES = ExpertNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                                   "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")
# transformers 5 keeps every family's experts fused in memory, under these names:
# gate_up_proj [E, 2·I, H] (gate rows first) and down_proj [E, H, I].
FUSED_ROUTER, FUSED_GATE_UP, FUSED_DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def unfuse_experts(state: Mapping[str, torch.Tensor], names: ExpertNames) -> dict[str, torch.Tensor]:
    """`state` with transformers' fused in-memory experts under the checkpoint's per-expert `names`
    (views, no copy); a state already spelled that way (read from disk) comes back as it is."""
    out = dict(state)
    for key in [k for k in state if k.endswith(FUSED_GATE_UP)]:
        layer = key[: -len(FUSED_GATE_UP)]  # "model.layers.{i}."
        gate_up, down, router = out.pop(key), out.pop(layer + FUSED_DOWN), out.pop(layer + FUSED_ROUTER)
        out[layer + names.router] = router
        inter = down.shape[2]
        for e in range(gate_up.shape[0]):
            out[layer + names.gate.format(e=e)] = gate_up[e, :inter]
            out[layer + names.up.format(e=e)] = gate_up[e, inter:]
            out[layer + names.down.format(e=e)] = down[e]
    return out


def read_experts(read, layer: int, names: ExpertNames, experts: range) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer `layer`'s router and the experts `experts` ([E', 2·I, H] gate|up, gate rows first; [E', H, I]
    down), each tensor got from `read(name, axes)` (the loader's: it checks the shape and cuts the axes
    a rank splits; `axes` names them)."""
    p = f"model.layers.{layer}."
    router = read(p + names.router, ("experts", "hidden"))
    gate_up = torch.stack([torch.cat((read(p + names.gate.format(e=e), ("expert_mlp", "hidden")),
                                      read(p + names.up.format(e=e), ("expert_mlp", "hidden")))) for e in experts])
    down = torch.stack([read(p + names.down.format(e=e), ("hidden", "expert_mlp")) for e in experts])
    return router, gate_up.contiguous(), down.contiguous()


def moe_weights_from_state(state: Mapping[str, torch.Tensor], layer: int, num_experts: int, top_k: int,
                           dtype: torch.dtype | None = None, renormalize: bool = True,
                           device: str | torch.device | None = None,
                           names: ExpertNames = MIXTRAL_EXPERT_NAMES) -> MoEWeights:
    """Layer `layer`'s MoE weights from a state dict (Mixtral's names by default), read from disk
    (`block_sparse_moe.experts.{e}.w1|w2|w3`: w1 = gate, w3 = up, w2 = down) or from a transformers
    model in memory (fused: `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)."""
    state, p = unfuse_experts(state, names), f"model.layers.{layer}."
    if p + names.router not in state:
        raise KeyError(f"no MoE weights for layer {layer}: expected {p}{names.router} (safetensors) or "
                       f"{p}{FUSED_ROUTER} + {p}{FUSED_GATE_UP} (transformers in memory)")
    first = state[p + names.router]
    if first.shape[0] != num_experts:
        raise ValueError(f"layer {layer}: router has {first.shape[0]} experts, the config says {num_experts}")
    dtype, device = dtype or first.dtype, device or first.device

    def read(name: str, axes: tuple[str, ...]) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"checkpoint lacks the expert tensor {name!r}")
        return state[name].to(device=device, dtype=dtype)

    router, gate_up, down = read_experts(read, layer, names, range(num_experts))
    return MoEWeights(router=router, gate_up=gate_up, down=down, top_k=top_k, renormalize=renormalize)
