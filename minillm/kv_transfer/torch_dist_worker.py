"""`TorchDistConnector`'s worker side: one rank's K/V blocks, moved rank to rank (chapter 13).

Every worker of a prefill/decode pair builds this half: the one worker of a one-process engine,
or each of the tp × pp ranks of a parallel one. Worker rank r of the prefill instance and worker
rank r of the decode instance share a 2-rank group of their own (`data-{r}-of-{n}` on the pair's
store, `minillm.kv_transfer.transport`): rank r holds the same layers and KV heads on both sides,
so each pair moves exactly its share of every block and nobody gathers or splits anything.

    decode rank r (in a step, before the forward)           prefill rank r (its serving thread)
    the plan's kv_connector_metadata lists loads:
      [READ], then the producer's block ids       ───────►
                                                  ◄───────  block b K|V, block b' K|V, ...
      each into the request's own blocks                    (read from its pool: the blocks stay
    the output says which requests were loaded               pinned until the decode side says so)

The producer's blocks are read on its serving thread while its engine keeps stepping; nobody
writes them while they are pinned. A load is synchronous: the step that needs the blocks waits
for them (they are a few blocks over loopback; the slow part of a transfer, waiting for the prefill,
happened before the request was scheduled). A link that breaks during a load fails that step.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from minillm.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput
from minillm.kv_transfer.config import KVTransferConfig
from minillm.kv_transfer.transport import CONSUMER_RANK, PRODUCER_RANK, KVLink, connect_store, data_link_name

logger = logging.getLogger("minillm.kv_transfer")

OP_READ = 3


class TorchDistConnectorWorker(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.role = config.kv_role
        self.rank, self.world_size = rank, world_size
        self.delay_s = config.extra["link_delay_per_block_s"]
        self.k_pool = self.v_pool = None
        self.block_size = 0
        self.link: KVLink | None = None
        self.link_up = threading.Event()
        self.link_error: str | None = None

    def register_kv_caches(self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int) -> None:
        """This rank's pool ([L, slots, H_kv, D] each); then join the rank's pair, on a thread."""
        self.k_pool, self.v_pool, self.block_size = k_pool, v_pool, block_size
        threading.Thread(target=self._run, name=f"kv-data-{self.role}-{self.rank}", daemon=True).start()

    def _run(self) -> None:
        try:
            store = connect_store(self.config.kv_ip, self.config.kv_port, False,
                                  self.config.extra["connect_timeout_s"])
            rank = PRODUCER_RANK if self.config.is_producer else CONSUMER_RANK
            self.link = KVLink(store, data_link_name(self.rank, self.world_size), rank, str(self.k_pool.device),
                               rendezvous=(self.config.kv_ip, self.config.kv_port))
            self.link_up.set()
            if self.config.is_producer:
                self._serve_reads()
        except Exception as err:  # noqa: BLE001 - a dead peer ends this rank's link, not the rank
            self.link_error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            logger.warning("KV data link of rank %d (%s) is down: %s", self.rank, self.role, self.link_error)

    # ---- producer: serve the consumer rank's reads -----------------------------------------------
    def _serve_reads(self) -> None:
        link = self.link
        while True:
            op = link.recv_header()[0]  # waits for the next read; raises if the consumer died
            if op != OP_READ:
                raise RuntimeError(f"expected a read (op {OP_READ}) from the consumer rank, got op {op}")
            for block in self.save_kv_blocks(self, link.recv_ids()):
                if self.delay_s:
                    time.sleep(self.delay_s)
                link.send(block)

    # ---- consumer: load the plan's blocks before the forward -------------------------------------
    def start_load_kv(self, metadata: KVConnectorMetadata) -> KVConnectorOutput | None:
        if not metadata.loads:
            return None
        if not self.link_up.wait(self.config.extra["connect_timeout_s"]) or self.link_error is not None:
            raise RuntimeError(f"rank {self.rank}'s KV data link to the prefill instance is down "
                               f"({self.link_error or 'never came up'})")
        start, link, bs = time.perf_counter(), self.link, self.block_size
        shape = (2, self.k_pool.shape[0], bs, *self.k_pool.shape[2:])
        block = torch.empty(shape, dtype=self.k_pool.dtype, device=link.device)
        for load in metadata.loads:
            link.send_header(OP_READ)
            link.send_ids(load.remote_block_ids)
            for b in load.local_block_ids:  # block by block into the request's own blocks
                link.recv(block)
                self.k_pool[:, b * bs:(b + 1) * bs] = block[0]
                self.v_pool[:, b * bs:(b + 1) * bs] = block[1]
        return KVConnectorOutput([load.req_id for load in metadata.loads], time.perf_counter() - start)
