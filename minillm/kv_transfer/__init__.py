"""KV transfer between a prefill and a decode instance (chapter 13): vLLM's connector split, torch.distributed.

    config.py       --kv-transfer-config (vLLM's KVTransferConfig names)
    base.py         the connector API: scheduler side, worker side (KVConnectorBase_V1's names)
    transport.py    the pair's 2-rank process group (gloo on CPU, NCCL on CUDA): header, then tensors
    torch_dist.py   TorchDistConnector: the decode side pulls a finished prefill's blocks, block by block
    metrics.py      minillm:kv_transfer_* Prometheus series
"""

from __future__ import annotations

from minillm.kv_transfer.base import KVConnectorBase, kv_transfer_params
from minillm.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config

__all__ = ["KVConnectorBase", "KVTransferConfig", "attach_kv_connector", "kv_transfer_params",
           "parse_kv_transfer_config"]


def attach_kv_connector(llm, config: KVTransferConfig):
    """Give `llm`'s engine a connector (its hooks: engine arrival, scheduler admission and finish,
    worker load), register its metrics, and start joining the pair. Returns the connector."""
    from minillm.kv_transfer.metrics import KVTransferCollector
    from minillm.kv_transfer.torch_dist import TorchDistConnector
    from minillm.scheduler.continuous import ContinuousScheduler

    engine = llm.engine
    if not isinstance(engine.scheduler, ContinuousScheduler) or not hasattr(engine.kv, "block_tables"):
        raise ValueError("--kv-transfer-config needs continuous batching over the paged KV cache "
                         "(--batching continuous --kv-layout paged, the defaults)")
    if engine.config.speculative_config is not None:
        raise ValueError("--kv-transfer-config cannot be combined with --speculative-config")
    worker = getattr(engine.executor, "worker", None)
    if worker is None or getattr(worker, "k_pool", None) is None:
        raise ValueError("--kv-transfer-config needs the in-process worker with a KV pool (UniProcExecutor)")
    connector = TorchDistConnector(config, engine)
    engine.kv_connector = connector
    engine.scheduler.connector = connector
    worker.kv_connector = connector
    engine.metrics.add_observer(connector.on_step)
    llm.prometheus.registry.register(KVTransferCollector(connector))
    connector.start()
    return connector
