"""The KV links: 2-rank torch.distributed process groups between a prefill and a decode instance (chapter 13).

Rank 0 of every pair is the producer (the prefill instance), rank 1 the consumer (the decode
instance). They agree on nothing but an address: the producer's engine process hosts a
`TCPStore` on `kv_ip:kv_port`; everyone else connects to it as a client. One store carries
several private groups, each under its own prefix (`PrefixStore`):

    "control"          the two engine processes: which transfer, its block ids, the first token, done
    "data-{r}-of-{n}"  worker rank r of the prefill instance and worker rank r of the decode
                       instance (n ranks each): the blocks of rank r's KV heads and layers

Each group is gloo on CPU; with the KV pool on CUDA the same calls build NCCL (which needs the
two ranks on different GPUs). A gloo end listens on, and advertises to its peer, the address of
this host that reaches `kv_ip` (`minillm.distributed.host_address`): left to itself, gloo would
take the address the host's name resolves to, often a loopback one, which a peer on another
host cannot dial. The groups are private (`ProcessGroupGloo(store, rank, 2)`, not
`init_process_group`), so they do not take the process's default group that tensor or pipeline
parallelism use.

Everything that crosses is a tensor sent with `send`/`recv` (point to point, tagged): a fixed
header of int64 first, then the payload. No home-made socket protocol: framing, addressing and
errors are torch.distributed's. A peer that dies makes the next send or recv raise (the connection
is gone), which is how each side learns it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from minillm.distributed.host_address import gloo_group_towards

PRODUCER_RANK, CONSUMER_RANK = 0, 1
# The dtypes a block may have, as a number in the header.
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# What a block holds, as that number: one of DTYPES, or a quantized kv_cache_dtype (its bytes, scales included:
# a PD pair with a quantized pool moves those bytes, not the model's dtype; minillm.kv.quant, chapter 14)
BLOCK_KINDS = (*DTYPES, "int8", "fp8_e4m3")
HEADER_LEN = 12


def connect_store(host: str, port: int, host_it: bool, timeout_s: float) -> dist.TCPStore:
    """The pair's rendezvous store: hosted (`host_it`, the producer's engine process) or joined.
    A client retries until the host is up or `timeout_s` passed (then RuntimeError)."""
    return dist.TCPStore(host, port, None, host_it, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def data_link_name(rank: int, world_size: int) -> str:
    return f"data-{rank}-of-{world_size}"


class KVLink:
    """One end of a pair: `send`/`recv` of tensors to the other rank, over a private group."""

    def __init__(self, store: dist.Store, name: str, rank: int, device: str = "cpu",
                 op_timeout_s: float = 86400.0, rendezvous: tuple[str, int] | None = None) -> None:
        """Blocks until the other end has joined group `name` of `store`. `op_timeout_s` bounds one
        send or recv; the producer waits that long for the next message. `rendezvous`: the store's
        (host, port); a gloo end then uses the local address that reaches that host."""
        if rank not in (PRODUCER_RANK, CONSUMER_RANK):
            raise ValueError(f"kv rank must be {PRODUCER_RANK} (producer) or {CONSUMER_RANK} (consumer), got {rank}")
        self.rank, self.peer, self.name = rank, 1 - rank, name
        self.device = torch.device(device)
        prefixed = dist.PrefixStore(name, store)
        op_timeout = datetime.timedelta(seconds=op_timeout_s)
        if self.device.type == "cuda":
            self.backend = "nccl"
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = op_timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        else:
            self.backend = "gloo"
            if rendezvous is None:
                self.group = dist.ProcessGroupGloo(prefixed, rank, 2, op_timeout)
            else:
                self.group = gloo_group_towards(prefixed, rank, 2, *rendezvous, op_timeout)

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

    def send_ids(self, ids: list[int]) -> None:
        """A list of ints: its length, then the list (nothing more when it is empty)."""
        self.send_header(len(ids))
        if ids:
            self.send(torch.tensor(ids, dtype=torch.int64, device=self.device))

    def recv_ids(self) -> list[int]:
        n = self.recv_header()[0]
        return self.recv(torch.empty(n, dtype=torch.int64, device=self.device)).tolist() if n else []

    def send_text(self, text: str) -> None:
        self.send_ids(list(text.encode()))

    def recv_text(self) -> str:
        return bytes(self.recv_ids()).decode()

    def close(self) -> None:
        self.group = None
