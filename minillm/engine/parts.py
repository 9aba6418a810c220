"""The parts the config names: its KV manager and its scheduler (chapters 02–07)."""

from __future__ import annotations

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
                               config.max_model_len, dtype, device, allocate_pool, config.kv_cache_dtype)
    if config.kv_layout == "slab":
        return SlabKVManager(c.num_layers, c.num_kv_heads, c.head_dim, num_slabs=config.max_num_seqs,
                             slab_len=config.max_model_len, dtype=dtype, device=device, allocate_pool=allocate_pool,
                             kv_cache_dtype=config.kv_cache_dtype)
    return BlockManager(c.num_layers, c.num_kv_heads, c.head_dim, config.num_kv_blocks, config.block_size, dtype,
                        device, enable_prefix_caching=config.enable_prefix_caching, allocate_pool=allocate_pool,
                        watermark=config.kv_watermark, prefix_cache=config.prefix_cache,
                        max_model_len=config.max_model_len, swap_space_gib=config.swap_space,
                        kv_cache_dtype=config.kv_cache_dtype, kv_offloading_size=config.kv_offloading_size)


def make_scheduler(config: EngineConfig, kv) -> Scheduler:
    schedulers = {"static": StaticScheduler, "dynamic": DynamicScheduler, "continuous": ContinuousScheduler}
    return schedulers[config.batching](config, kv)
