"""The KV-bytes figures follow kv_cache_dtype (chapter 14): the simulator's capacity at a memory
budget, /metrics, the KV heatmap's title, the PD connector's block bytes. Tiny model and a 4-request
simulated trace: a few seconds."""

from __future__ import annotations

import json

import matplotlib
import pytest
from conftest import make_tiny_hf_model

from minillm import LLM, SamplingParams
from minillm.sim.model_shapes import LLAMA_7B
from minillm.sim.simulate import kv_capacity_tokens, simulate
from minillm.traces.synthetic import make_trace

matplotlib.use("Agg")


def test_a_models_bytes_per_token_by_dtype():
    from minillm.llm import BUNDLED_TARGET
    from minillm.model.config import ModelConfig

    config = ModelConfig.from_hf_dict(json.loads((BUNDLED_TARGET / "config.json").read_text()))  # L 4, H_kv 4, D 32
    assert [config.kv_bytes_per_token(4, d) for d in ("auto", "int8", "fp8_e4m3")] == [4096, 1152, 1024]
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        config.kv_bytes_per_token(4, "int4")


def test_the_simulators_capacity_at_a_memory_budget_follows_the_dtype():
    trace = make_trace(4, seed=0, vocab_size=32000, prompt_len=("uniform", 50, 100), output_len=("uniform", 5, 10))
    results = {d: simulate(trace, hardware="A100-80GB", model="llama-7b", engine_config={"kv_cache_dtype": d})
               for d in ("auto", "int8", "fp8_e4m3")}
    tokens = {d: r.kv_capacity_tokens for d, r in results.items()}
    # llama-7b in bf16 keeps 2·32·32·128·2 B per token; int8 rows are 128 codes + a 4-byte scale, fp8 rows 128 B
    free = 80e9 * 0.9 - LLAMA_7B.weight_bytes(2)
    assert tokens == {"auto": int(free // (2 * 32 * 32 * 256)), "int8": int(free // (2 * 32 * 32 * 132)),
                      "fp8_e4m3": int(free // (2 * 32 * 32 * 128))}
    assert tokens["fp8_e4m3"] == pytest.approx(2 * tokens["auto"], abs=2)
    blocks = {d: r.engine.kv.allocator.num_blocks for d, r in results.items()}  # the pool gets every block that fits
    assert blocks["int8"] == tokens["int8"] // 16 and blocks["auto"] == tokens["auto"] // 16
    assert all(r.summary.completed == 4 for r in results.values())
    assert kv_capacity_tokens(results["auto"].engine.executor.hw, LLAMA_7B) == tokens["auto"]


@pytest.fixture(scope="module")
def quantized_llm():
    llm = LLM(make_tiny_hf_model("llama-gqa"), dtype="float64", device="cpu", max_model_len=64, max_num_seqs=2,
              block_size=4, num_kv_blocks=20, kv_cache_dtype="int8", enable_prefix_caching=True,
              disable_log_stats=False)
    llm.generate([{"prompt_token_ids": list(range(3, 20))}], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)
    return llm


def test_metrics_report_the_pools_bytes_and_dtype(quantized_llm):
    metrics = {m.name: m for m in quantized_llm.get_metrics()}
    # 2 layers, 2 KV heads, head_dim 16: rows of 16 codes + 4 scale bytes, for K and V
    assert metrics["minillm:kv_cache_bytes_per_token"].value == 2 * 2 * 2 * 20
    info = metrics["vllm:cache_config_info"]
    assert info.labels["cache_dtype"] == "int8" and info.labels["block_size"] == "4"
    assert info.labels["num_gpu_blocks"] == "21"  # 20 blocks + the null block the pool also holds
    exact = LLM(make_tiny_hf_model("llama-gqa"), dtype="float64", device="cpu", max_model_len=64, max_num_seqs=2,
                disable_log_stats=False)
    exact_metrics = {m.name: m for m in exact.get_metrics()}
    assert exact_metrics["minillm:kv_cache_bytes_per_token"].value == 2 * 2 * 2 * 16 * 8  # float64
    assert exact_metrics["vllm:cache_config_info"].labels["cache_dtype"] == "auto"


def test_the_heatmap_counts_the_tokens_bytes(quantized_llm):
    from minillm.viz import plot_kv_blocks

    kv = quantized_llm.engine.kv
    title = plot_kv_blocks(kv).get_title()
    used = kv.usage().used_tokens  # the finished prompt's full blocks stay cached, not used
    assert f"{used * 160 / 1024:,.1f} KiB of K/V at 160 B per token (kv_cache_dtype='int8')" in title


def test_the_pd_connector_moves_the_quantized_blocks_bytes(quantized_llm):
    from minillm.kv_transfer import parse_kv_transfer_config
    from minillm.kv_transfer.torch_dist_scheduler import TorchDistConnectorScheduler

    config = parse_kv_transfer_config({"kv_connector": "TorchDistConnector", "kv_role": "kv_producer"})
    spec = quantized_llm.engine.kv.cache_spec
    connector = TorchDistConnectorScheduler(config, spec, 1, lambda r: 0, lambda: None)
    assert connector.block_shape == (2, 2, 4, 2, 20) and connector.kind == "int8"
    assert connector.block_bytes == 4 * 160  # 4 tokens of 160 B, against 4 · 1024 B in float64


def test_blocks_in_a_memory_budget_follow_the_dtype():
    from minillm.kv.quant import num_blocks_in_budget
    from minillm.llm import BUNDLED_TARGET
    from minillm.model.config import ModelConfig

    config = ModelConfig.from_hf_dict(json.loads((BUNDLED_TARGET / "config.json").read_text()))
    budget = 2**20  # 1 MiB of K/V, blocks of 16 tokens: 64 KiB per float32 block, 18 KiB per int8 one
    blocks = {d: num_blocks_in_budget(budget, config, 16, d) for d in ("auto", "int8", "fp8_e4m3")}
    assert blocks == {"auto": 16, "int8": 56, "fp8_e4m3": 64}
    llm_kv = LLM(max_model_len=64, max_num_seqs=2, block_size=16, num_kv_blocks=blocks["int8"],
                 kv_cache_dtype="int8").engine.kv
    assert llm_kv.cache_spec.block_bytes * blocks["int8"] <= budget < llm_kv.cache_spec.block_bytes * (blocks["int8"] + 1)
