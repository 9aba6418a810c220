"""The KV link: a 2-rank torch.distributed process group between a prefill and a decode instance (chapter 13).

Rank 0 is the producer (the prefill instance), rank 1 the consumer (the decode instance). They
agree on nothing but an address: the producer hosts a `TCPStore` on `kv_ip:kv_port`, the consumer
connects to it, and the store's rendezvous builds the group — gloo on CPU; with the KV pool on
CUDA the same calls build NCCL (which needs the two ranks on different GPUs). The group is private
(`ProcessGroupGloo(store, rank, 2)`, not `init_process_group`), so it does not take the process's
default group that tensor or pipeline parallelism would use.

Everything that crosses is a tensor sent with `send`/`recv` (point to point, tagged): a fixed
header of int64 first (what follows: the request's id, its block count, dtype and shape), then
the payload. No home-made socket protocol: framing, addressing and errors are torch.distributed's.
A peer that dies makes the next send or recv raise (the connection is gone), which is how each
side learns it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

PRODUCER_RANK, CONSUMER_RANK = 0, 1
# The dtypes a block may have, as a number in the header.
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
HEADER_LEN = 12


class KVLink:
    """One end of the pair: `send`/`recv` of tensors to the other rank, over a private group."""

    def __init__(self, rank: int, host: str, port: int, device: str = "cpu", timeout_s: float = 600.0,
                 op_timeout_s: float = 86400.0) -> None:
        """Blocks until the other end has joined (or `timeout_s` passed: RuntimeError from the store).
        `op_timeout_s` bounds one send or recv; the producer waits that long for the next pull."""
        if rank not in (PRODUCER_RANK, CONSUMER_RANK):
            raise ValueError(f"kv rank must be {PRODUCER_RANK} (producer) or {CONSUMER_RANK} (consumer), got {rank}")
        self.rank, self.peer = rank, 1 - rank
        self.device = torch.device(device)
        self.store = dist.TCPStore(host, port, 2, rank == PRODUCER_RANK,
                                   timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=True)
        op_timeout = datetime.timedelta(seconds=op_timeout_s)
        if self.device.type == "cuda":
            self.backend = "nccl"
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = op_timeout
            self.group = dist.ProcessGroupNCCL(self.store, rank, 2, opts)
        else:
            self.backend = "gloo"
            self.group = dist.ProcessGroupGloo(self.store, rank, 2, op_timeout)

    def send(self, tensor: torch.Tensor, tag: int = 0) -> None:
        self.group.send([tensor.contiguous()], self.peer, tag).wait()

    def recv(self, tensor: torch.Tensor, tag: int = 0) -> torch.Tensor:
        """Receive into `tensor` (contiguous, the sender's shape and dtype)."""
        self.group.recv([tensor], self.peer, tag).wait()
        return tensor

    # ---- small typed messages ------------------------------------------------------------------
    def send_header(self, *values: int) -> None:
        if len(values) > HEADER_LEN:
            raise ValueError(f"a header holds at most {HEADER_LEN} numbers, got {len(values)}")
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self.send(header)

    def recv_header(self) -> list[int]:
        return self.recv(torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)).tolist()

    def send_text(self, text: str) -> None:
        data = text.encode()
        self.send_header(len(data))
        if data:
            self.send(torch.tensor(list(data), dtype=torch.uint8, device=self.device))

    def recv_text(self) -> str:
        n = self.recv_header()[0]
        if not n:
            return ""
        return bytes(self.recv(torch.empty(n, dtype=torch.uint8, device=self.device)).tolist()).decode()

    def close(self) -> None:
        self.group = None
        self.store = None
