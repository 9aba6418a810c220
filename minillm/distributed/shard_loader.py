"""Each rank reads only its shard of the checkpoint (chapter 12).

`safe_open(...).get_slice(name)[rows]` reads just those rows (or `[:, cols]` those columns) from
the safetensors file, which is memory-mapped: a rank never holds a full copy of a weight it splits,
and a pipeline stage never reads the layers of other stages. What rank (stage s, TP rank r of tp)
takes from each layer of its stage:

    q_proj, k_proj, v_proj   rows of its query heads / the KV heads they read (column-parallel),
                             fused into one q|k|v matrix as `minillm.model.loader` does
    o_proj                   the columns of its query heads (row-parallel); bias whole
    gate_proj, up_proj       rows [r·I/tp, (r+1)·I/tp) of each, fused gate|up (column-parallel)
    down_proj                the same columns (row-parallel); bias whole
    norms                    whole (they are tiny, and every rank needs them)

A Mixtral layer's experts: with expert parallelism (`enable_expert_parallel=True`, EP size = TP size)
rank r holds experts [r·E/tp, (r+1)·E/tp) whole and the router, read by
`minillm.distributed.moe.read_expert_shards`; without it (vLLM's default for MoE under TP) every
expert is sliced like a dense MLP — rows of w1 and w3, columns of w2 — and one all-reduce follows the
layer. Attention is tensor-parallel either way.

The first stage takes its slice of the embedding's rows (the vocabulary split over the TP ranks,
the last rank's slice padded when it does not divide), the last stage the same rows of lm_head
(of the embedding when they are tied) and the final norm.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from minillm.distributed.layout import RankLayout
from minillm.model.config import ModelConfig
from minillm.model.llama import LayerWeights


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (one file, or the shards an index names)."""
    model_dir = Path(model_dir)
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    if index.is_file():
        return {name: model_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def vocab_shard(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int, int]:
    """(start, stop, padded rows per rank) of the vocabulary rows a TP rank holds."""
    per = -(-vocab_size // tp)
    start = min(tp_rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


class ShardReader:
    """Reads slices of named tensors, cast to the model's dtype and device."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: str, stack: ExitStack) -> None:
        self.files = checkpoint_files(model_dir)
        self.handles = {path: stack.enter_context(safe_open(str(path), framework="pt"))
                        for path in set(self.files.values())}
        self.dtype, self.device = dtype, device
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.files

    def take(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        piece = self.handles[self.files[name]].get_slice(name)
        if cols is not None:
            tensor = piece[:, cols]
        elif rows is not None:
            tensor = piece[rows]
        else:
            tensor = piece[:]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def maybe(self, name: str, rows: slice | None = None) -> torch.Tensor | None:
        return self.take(name, rows) if self.has(name) else None


def _sliced_experts(r: ShardReader, c: ModelConfig, layer: int, rows: slice):
    """A Mixtral layer's experts, each sliced tensor-parallel like a dense MLP: rows `rows` of every
    expert's gate (w1) and up (w3), the same columns of its down (w2); the router whole."""
    from minillm.model.moe import MoEWeights

    p = f"model.layers.{layer}.block_sparse_moe."
    gate_up = torch.stack([torch.cat((r.take(f"{p}experts.{e}.w1.weight", rows), r.take(f"{p}experts.{e}.w3.weight", rows)))
                           for e in range(c.num_experts)])
    down = torch.stack([r.take(f"{p}experts.{e}.w2.weight", cols=rows) for e in range(c.num_experts)])
    return MoEWeights(router=r.take(p + "gate.weight"), gate_up=gate_up.contiguous(), down=down.contiguous(),
                      top_k=c.num_experts_per_tok)


def load_rank_weights(model_dir: str | Path, config: ModelConfig, layout: RankLayout, dtype: torch.dtype,
                      device: str = "cpu", expert_parallel: bool = False) -> dict:
    """This rank's weights: {"layers": [LayerWeights], "embed", "lm_head", "final_norm", "vocab_start",
    "bytes_read"} (embed None off the first stage, lm_head and final_norm None off the last)."""
    c, d = config, config.head_dim
    q = layout.q_heads(c)
    kv = layout.kv_heads(c)
    q_rows, kv_rows = slice(q.start * d, q.stop * d), slice(kv.start * d, kv.stop * d)
    per = c.intermediate_size // layout.tp
    mlp_rows = slice(layout.tp_rank * per, (layout.tp_rank + 1) * per)

    def cat(*parts):
        return None if parts[0] is None else torch.cat(parts).contiguous()

    experts = None
    if c.is_moe and expert_parallel:  # whole experts of this rank (of every layer: this is PP 1), never sliced
        from minillm.distributed.moe import read_expert_shards

        experts = read_expert_shards(model_dir, c, layout.tp_rank, layout.tp, dtype, device)
    with ExitStack() as stack:
        r = ShardReader(model_dir, dtype, device, stack)
        layers = []
        for i in layout.layers(c.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            if c.is_moe:
                layers.append(LayerWeights(
                    input_norm=r.take(p + "input_layernorm.weight"),
                    qkv=cat(r.take(a + "q_proj.weight", q_rows), r.take(a + "k_proj.weight", kv_rows),
                            r.take(a + "v_proj.weight", kv_rows)),
                    qkv_bias=None, o=r.take(a + "o_proj.weight", cols=q_rows), o_bias=None,
                    post_attention_norm=r.take(p + "post_attention_layernorm.weight"),
                    gate_up=None, gate_up_bias=None, down=None, down_bias=None,
                    moe=experts[i] if experts is not None else _sliced_experts(r, c, i, mlp_rows)))
                continue
            layers.append(LayerWeights(
                input_norm=r.take(p + "input_layernorm.weight"),
                qkv=cat(r.take(a + "q_proj.weight", q_rows), r.take(a + "k_proj.weight", kv_rows),
                        r.take(a + "v_proj.weight", kv_rows)),
                qkv_bias=cat(r.maybe(a + "q_proj.bias", q_rows), r.maybe(a + "k_proj.bias", kv_rows),
                             r.maybe(a + "v_proj.bias", kv_rows)),
                o=r.take(a + "o_proj.weight", cols=q_rows),
                o_bias=r.maybe(a + "o_proj.bias"),
                post_attention_norm=r.take(p + "post_attention_layernorm.weight"),
                gate_up=cat(r.take(m + "gate_proj.weight", mlp_rows), r.take(m + "up_proj.weight", mlp_rows)),
                gate_up_bias=cat(r.maybe(m + "gate_proj.bias", mlp_rows), r.maybe(m + "up_proj.bias", mlp_rows)),
                down=r.take(m + "down_proj.weight", cols=mlp_rows),
                down_bias=r.maybe(m + "down_proj.bias")))
        start, stop, rows_per_rank = vocab_shard(c.vocab_size, layout.tp, layout.tp_rank)

        def vocab_rows(name: str) -> torch.Tensor:
            rows = r.take(name, slice(start, stop))
            if rows.shape[0] < rows_per_rank:  # the last rank's short slice, padded with zero rows
                rows = torch.cat((rows, rows.new_zeros(rows_per_rank - rows.shape[0], rows.shape[1])))
            return rows

        embed = vocab_rows("model.embed_tokens.weight") if layout.is_first_stage else None
        lm_head = final_norm = None
        if layout.is_last_stage:
            lm_head = vocab_rows("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight")
            final_norm = r.take("model.norm.weight")
        return {"layers": layers, "embed": embed, "lm_head": lm_head, "final_norm": final_norm,
                "vocab_start": start, "bytes_read": r.bytes_read}
