"""Where a model's weights come from: the tensors of a checkpoint, by HF name (chapter 00).

Two sources with one interface, so that one loader (minillm/model/loader.py) reads both:

- `SafetensorsCheckpoint`: an HF model directory's `model.safetensors` (or the shards its index
  names). A tensor is read through `get_slice`, so `read(name, (rows, cols))` reads only that piece
  of the memory-mapped file: a tensor-parallel rank never holds a whole weight it splits, a pipeline
  stage never reads another stage's layers, an expert-parallel rank never another rank's experts.
- `StateDictCheckpoint`: the state dict of a transformers model in memory (no copy).

safetensors only: a `.bin` checkpoint is a pickle, and unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

Index = tuple[slice, ...]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: `model.safetensors`, or every shard its index names (checked present)."""
    model_dir = Path(model_dir)
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        files = [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards named in the index are missing: {missing}")
        return files
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = f" (found {pickles}: pickled checkpoints are refused, convert them to safetensors)" if pickles else ""
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json{hint}")


class SafetensorsCheckpoint:
    """The tensors of an HF model directory, read piece by piece. Use it in a `with` block (the
    files stay open, memory-mapped, until it ends)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._stack = ExitStack()
        self._handles = [self._stack.enter_context(safe_open(str(f), framework="pt"))
                         for f in safetensors_files(model_dir)]
        self._where = {name: h for h in self._handles for name in h.keys()}  # noqa: SIM118 - no __iter__
        self.bytes_read = 0

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, index: Index) -> torch.Tensor:
        tensor = self._where[name].get_slice(name)[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


class StateDictCheckpoint:
    """The tensors of a state dict (a transformers model in memory), sliced as views."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state
        self.bytes_read = 0

    def __enter__(self) -> StateDictCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def names(self) -> set[str]:
        return set(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def read(self, name: str, index: Index) -> torch.Tensor:
        tensor = self.state[name][index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def read_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint, whole."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[name] = f.get_tensor(name)
    return tensors
