"""One place that assembles an engine from a config: `build_engine` (chapter 04).

`LLM` (the real model), the simulator (a cost model instead of a model) and the graders (a
stand-in executor and a learner's scheduler) all build their engine here; only the parts they
pass differ. The KV layout and the scheduler follow the config unless given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minillm.config import EngineConfig
from minillm.kv.block_manager import BlockManager
from minillm.kv.padded import PaddedKVManager
from minillm.kv.slab import SlabKVManager
from minillm.model.config import ModelConfig
from minillm.scheduler.base import Scheduler
from minillm.scheduler.continuous import ContinuousScheduler
from minillm.scheduler.dynamic import DynamicScheduler
from minillm.scheduler.static import StaticScheduler


def make_kv_manager(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", allocate_pool: bool = True):
    """The KV manager the config names: one rectangle per batch for static/dynamic, else slabs or pages.
    (`allocate_pool=False`: the worker allocates no memory for it — the simulator's 7B pools.)"""
    c = model_config
    if config.batching in ("static", "dynamic"):
        return PaddedKVManager(c.num_layers, c.num_kv_heads, c.head_dim, config.max_num_seqs,
                               config.max_model_len, dtype, device, allocate_pool)
    if config.kv_layout == "slab":
        return SlabKVManager(c.num_layers, c.num_kv_heads, c.head_dim, num_slabs=config.max_num_seqs,
                             slab_len=config.max_model_len, dtype=dtype, device=device, allocate_pool=allocate_pool)
    return BlockManager(c.num_layers, c.num_kv_heads, c.head_dim, config.num_kv_blocks, config.block_size, dtype,
                        device, enable_prefix_caching=config.enable_prefix_caching, allocate_pool=allocate_pool,
                        watermark=config.kv_watermark, prefix_cache=config.prefix_cache,
                        max_model_len=config.max_model_len, swap_space_gib=config.swap_space)


def make_scheduler(config: EngineConfig, kv) -> Scheduler:
    schedulers = {"static": StaticScheduler, "dynamic": DynamicScheduler, "continuous": ContinuousScheduler}
    return schedulers[config.batching](config, kv)


def build_engine(config: EngineConfig, model_config: ModelConfig, *, model: Any = None, tokenizer: Any = None,
                 scheduler_factory: Callable[[EngineConfig, Any], Scheduler] | None = None, kv: Any = None,
                 executor: Any = None, clock: Any = None, proposer: Any = None):
    """An `LLMEngine` for `config`: with `model`, the real model runs in an in-process worker; without
    it, pass `executor` (the simulator's, a stand-in). `scheduler_factory(resolved_config, kv)`
    plugs in another scheduler (an exercise's); `kv` another KV manager."""
    from minillm.engine.core import LLMEngine

    resolved = config.resolve(model_config.max_position_embeddings)
    if kv is None:
        if model is not None:
            kv = make_kv_manager(resolved, model_config, model.dtype, str(model.device))
        else:
            kv = make_kv_manager(resolved, model_config, allocate_pool=False)
    scheduler = (scheduler_factory or make_scheduler)(resolved, kv)
    return LLMEngine(model_config, config, model=model, tokenizer=tokenizer, kv=kv, scheduler=scheduler,
                     executor=executor, clock=clock, proposer=proposer)
