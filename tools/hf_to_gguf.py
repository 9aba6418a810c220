"""A bundled model (HF Llama directory) as a GGUF file that llama.cpp loads: F32 weights, the
byte-level BPE vocabulary with its merges, the chat template. The peer of bench/llamacpp.py (issue 29).

    python tools/hf_to_gguf.py models/minillm-target /tmp/minillm-target.gguf

Built on the `gguf` package (llama.cpp's own writer and tensor-name map). One thing is not a
renaming: HF's Llama rotates the two halves of each head (`rotate_half`), llama.cpp's `llama`
architecture rotates adjacent pairs, so the rows of q_proj and k_proj are reordered within each head
(half h, index j) -> (index j, half h); attention scores are unchanged (tests/test_hf_to_gguf.py checks it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ROTARY_PROJECTIONS = ("q_proj", "k_proj")  # the projections whose output RoPE rotates


def interleave_rotary_halves(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of one projection reordered from HF's half-split rotary layout to llama.cpp's pairs."""
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    per_head = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _check_supported(config: dict, tokenizer: dict) -> None:
    if config.get("model_type") != "llama":
        raise ValueError(f"hf_to_gguf converts Llama checkpoints (model_type 'llama'); got {config.get('model_type')!r}")
    model, pre = tokenizer.get("model", {}), tokenizer.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ValueError("hf_to_gguf converts byte-level BPE tokenizers (GPT-2's pre-tokenizer, llama.cpp's 'gpt-2'); "
                         f"got model {model.get('type')!r} with pre-tokenizer {pre.get('type')!r}")


def vocabulary(tokenizer: dict) -> tuple[list[str], list[int], list[str]]:
    """Tokens in id order, their llama.cpp token types, and the merges as 'left right' strings."""
    by_id = {i: tok for tok, i in tokenizer["model"]["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in by_id}
    for added in tokenizer.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("token ids are not 0..n-1 without gaps: llama.cpp's vocabulary is a list")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    return [by_id[i] for i in range(len(by_id))], [int(types[i]) for i in range(len(by_id))], merges


def _prepends_bos(tokenizer: dict, bos_token: str | None) -> bool:
    single = (tokenizer.get("post_processor") or {}).get("single") or []
    return bool(single) and single[0].get("SpecialToken", {}).get("id") == bos_token


def convert(model_dir: str | Path, out_path: str | Path) -> Path:
    """Write `out_path` (GGUF, all tensors F32) from the HF directory `model_dir`; returns the path."""
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = _read_json(model_dir / "config.json")
    tokenizer = _read_json(model_dir / "tokenizer.json")
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    _check_supported(config, tokenizer)
    num_layers, num_heads = config["num_hidden_layers"], config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads", num_heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))

    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(model_dir.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    tokens, token_types, merges = vocabulary(tokenizer)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre("gpt-2")  # GPT-2's split regex, what HF's ByteLevel(use_regex=True) applies
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        if isinstance(config.get(key), int):
            add(config[key])
    writer.add_add_bos_token(_prepends_bos(tokenizer, tokenizer_config.get("bos_token")))
    writer.add_add_eos_token(False)
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)
    for hf_name, array in sorted(load_file(model_dir / "model.safetensors").items()):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{model_dir}: tensor {hf_name!r} has no llama.cpp name (gguf's map for 'llama')")
        array = np.ascontiguousarray(array, dtype=np.float32)
        if hf_name.endswith(tuple(f"{p}.weight" for p in ROTARY_PROJECTIONS)):
            heads = num_heads if ".q_proj." in hf_name else num_kv_heads
            array = interleave_rotary_halves(array, heads)
        writer.add_tensor(name, array)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="an HF Llama directory (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("out", help="the .gguf file to write")
    args = parser.parse_args()
    print(convert(args.model_dir, args.out))


if __name__ == "__main__":
    main()
