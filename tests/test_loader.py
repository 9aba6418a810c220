"""Loading an HF directory: safetensors only, and errors that say what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm.llm import BUNDLED_TARGET
from minillm.model.loader import load_model_dir


@pytest.fixture()
def model_copy(tmp_path):
    target = tmp_path / "model"
    shutil.copytree(BUNDLED_TARGET, target)
    return target


def test_unknown_model_type_names_the_supported_ones(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["model_type"] = "gpt2"
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; minillm runs llama, mistral, qwen2"):
        load_model_dir(model_copy)


def test_missing_files(model_copy, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model_dir(tmp_path / "nowhere")
    (model_copy / "model.safetensors").rename(model_copy / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pickled checkpoints are refused"):
        load_model_dir(model_copy)


def test_shape_mismatch_names_the_tensor(model_copy):
    state = load_file(str(model_copy / "model.safetensors"))
    state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(10, 256)
    save_file(state, str(model_copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.2.mlp.up_proj.weight' has shape \(10, 256\), the config "
                                         r"implies \(688, 256\)"):
        load_model_dir(model_copy)


def test_missing_tensor_is_named(model_copy):
    state = load_file(str(model_copy / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(model_copy / "model.safetensors"))
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_model_dir(model_copy)


def test_sharded_checkpoint_loads_identically(model_copy):
    state = load_file(str(model_copy / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(model_copy / shard))
    (model_copy / "model.safetensors").unlink()
    index = {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded, single = load_model_dir(model_copy), load_model_dir(BUNDLED_TARGET)
    assert torch.equal(sharded.layers[3].gate_up.weight, single.layers[3].gate_up.weight)
    assert torch.equal(sharded.lm_head.weight, single.lm_head.weight)
