"""KV transfer between a prefill and a decode instance (chapter 13): vLLM's connector split, torch.distributed.

    config.py                --kv-transfer-config (vLLM's KVTransferConfig names); `LLM(kv_transfer_config=...)`
    base.py                  the connector API, scheduler side and worker side (KVConnectorBase_V1's names),
                             and what crosses between them: KVConnectorMetadata (in the plan),
                             KVConnectorOutput (in the worker's output)
    transport.py             the pair's store and 2-rank process groups (gloo on CPU, NCCL on CUDA)
    torch_dist_scheduler.py  TorchDistConnector, scheduler side: the engines agree what crosses and when
    torch_dist_worker.py     TorchDistConnector, worker side: rank r's blocks to rank r, before the forward
    metrics.py               minillm:kv_transfer_* Prometheus series
"""

from __future__ import annotations

from collections.abc import Callable

from minillm.kv_transfer.base import KVConnectorBase, kv_transfer_params
from minillm.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config

__all__ = ["KVConnectorBase", "KVTransferConfig", "kv_transfer_params", "make_scheduler_connector",
           "make_worker_connector", "parse_kv_transfer_config"]


def make_scheduler_connector(config: KVTransferConfig, cache_spec, world_size: int,
                             cached_prefix_tokens: Callable, notify: Callable[[], None]) -> KVConnectorBase:
    """The connector's scheduler side, for the engine process (vLLM's KVConnectorFactory, role SCHEDULER)."""
    from minillm.kv_transfer.torch_dist_scheduler import TorchDistConnectorScheduler

    return TorchDistConnectorScheduler(config, cache_spec, world_size, cached_prefix_tokens, notify)


def make_worker_connector(config: KVTransferConfig, rank: int = 0, world_size: int = 1) -> KVConnectorBase:
    """The connector's worker side, for worker `rank` of `world_size` (role WORKER)."""
    from minillm.kv_transfer.torch_dist_worker import TorchDistConnectorWorker

    return TorchDistConnectorWorker(config, rank, world_size)
