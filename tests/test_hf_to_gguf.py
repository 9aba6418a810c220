"""tools/hf_to_gguf.py, the converter that gives bench/llamacpp.py its llama.cpp peer (issue 29).

Read back with the `gguf` package's reader, no llama.cpp needed: tensor names and shapes, every
weight, the vocabulary, merges and special ids, and the one change that is not a renaming (q/k rows
reordered for llama.cpp's RoPE), checked by what it must preserve: attention scores.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("hf_to_gguf", ROOT / "tools" / "hf_to_gguf.py")
hf_to_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_to_gguf)

PER_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
HF_PER_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _hf_to_gguf_names(num_layers: int, tied: bool) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    for i in range(num_layers):
        for hf, gg in zip(HF_PER_LAYER, PER_LAYER):
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    return names


@pytest.fixture(scope="module", params=["minillm-target", "minillm-draft"])
def converted(request, tmp_path_factory):
    model_dir = ROOT / "models" / request.param
    out = hf_to_gguf.convert(model_dir, tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf")
    return model_dir, gguf.GGUFReader(out)


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    assert field is not None, f"{key} missing"
    return field.contents()


def test_every_tensor_is_there_under_its_llama_cpp_name_with_its_shape_and_values(converted):
    model_dir, reader = converted
    config = json.loads((model_dir / "config.json").read_text())
    hf = load_file(model_dir / "model.safetensors")
    expected = _hf_to_gguf_names(config["num_hidden_layers"], config["tie_word_embeddings"])
    assert set(hf) == set(expected)  # the bundled files hold exactly these
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(expected.values())
    for hf_name, name in expected.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert list(t.shape) == list(reversed(hf[hf_name].shape)), name  # GGML lists the fastest dimension first
        if not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            np.testing.assert_array_equal(t.data.reshape(hf[hf_name].shape), hf[hf_name], err_msg=name)


def test_hyperparameters_are_the_configs(converted):
    model_dir, reader = converted
    config = json.loads((model_dir / "config.json").read_text())
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "general.file_type") == gguf.LlamaFileType.ALL_F32
    for key, value in (("block_count", config["num_hidden_layers"]), ("embedding_length", config["hidden_size"]),
                       ("feed_forward_length", config["intermediate_size"]),
                       ("attention.head_count", config["num_attention_heads"]),
                       ("attention.head_count_kv", config["num_key_value_heads"]),
                       ("rope.dimension_count", config["head_dim"]),
                       ("context_length", config["max_position_embeddings"])):
        assert _field(reader, f"llama.{key}") == value, key
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(config["rms_norm_eps"])


def test_vocabulary_round_trips(converted):
    model_dir, reader = converted
    hf_tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == hf_tok.get_vocab_size() == 4096
    assert tokens == [hf_tok.id_to_token(i) for i in range(len(tokens))]
    merges = json.loads((model_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert _field(reader, "tokenizer.ggml.merges") == [" ".join(m) if isinstance(m, list) else m for m in merges]
    types = _field(reader, "tokenizer.ggml.token_type")
    specials = {t.content for t in hf_tok.get_added_tokens_decoder().values() if t.special}
    assert [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL] == [hf_tok.token_to_id(s) for s in
                                                                               sorted(specials, key=hf_tok.token_to_id)]
    assert set(types) == {gguf.TokenType.NORMAL, gguf.TokenType.CONTROL}
    # llama.cpp's names: byte-level BPE, split by GPT-2's regex
    assert (_field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    assert _field(reader, "tokenizer.ggml.bos_token_id") == hf_tok.token_to_id("<s>") == 0
    assert _field(reader, "tokenizer.ggml.eos_token_id") == hf_tok.token_to_id("</s>") == 1
    assert _field(reader, "tokenizer.ggml.add_bos_token") is True  # the post-processor prepends <s>
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert _field(reader, "tokenizer.chat_template") == template
    # text -> HF ids -> the GGUF's token strings -> bytes -> the same text
    text = "And God said, Let there be light: and there was light. Ünïcode — too"
    ids = hf_tok.encode(text, add_special_tokens=False).ids
    assert decoders.ByteLevel().decode([tokens[i] for i in ids]) == text


def _rope_half_split(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """HF Llama's RoPE on one head: dims j and j + d/2 rotate together."""
    half = x.shape[-1] // 2
    angle = pos * theta ** (-np.arange(half) / half)
    a, b = x[:half], x[half:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)])


def _rope_adjacent_pairs(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """llama.cpp's RoPE for 'llama' (GGML's normal mode): dims 2j and 2j + 1 rotate together."""
    half = x.shape[-1] // 2
    angle = pos * theta ** (-np.arange(half) / half)
    a, b = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2], out[1::2] = a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)
    return out


def test_reordered_q_and_k_give_the_same_attention_scores(converted):
    model_dir, reader = converted
    config = json.loads((model_dir / "config.json").read_text())
    hf = load_file(model_dir / "model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    d, theta = config["head_dim"], config["rope_parameters"]["rope_theta"]
    rng = np.random.default_rng(0)
    x_q, x_k = rng.standard_normal((2, config["hidden_size"]))
    for layer in range(config["num_hidden_layers"]):
        wq_hf, wk_hf = (hf[f"model.layers.{layer}.self_attn.{p}.weight"].astype(np.float64) for p in ("q_proj", "k_proj"))
        wq, wk = (tensors[f"blk.{layer}.attn_{p}.weight"].data.reshape(w.shape).astype(np.float64)
                  for p, w in (("q", wq_hf), ("k", wk_hf)))
        assert not np.array_equal(wq, wq_hf)  # reordered, not copied
        for head in range(config["num_key_value_heads"]):
            rows = slice(head * d, (head + 1) * d)
            for pos_q, pos_k in ((5, 2), (300, 17)):
                hf_score = _rope_half_split(wq_hf[rows] @ x_q, pos_q, theta) @ _rope_half_split(wk_hf[rows] @ x_k, pos_k, theta)
                gguf_score = _rope_adjacent_pairs(wq[rows] @ x_q, pos_q, theta) @ _rope_adjacent_pairs(wk[rows] @ x_k, pos_k, theta)
                assert gguf_score == pytest.approx(hf_score, rel=1e-9, abs=1e-9)


def test_what_it_cannot_convert_gets_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="converts Llama checkpoints .*got 'mixtral'"):
        hf_to_gguf.convert(ROOT / "models" / "minillm-moe", tmp_path / "moe.gguf")
