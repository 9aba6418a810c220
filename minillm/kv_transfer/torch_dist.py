"""`TorchDistConnector`: a prefill instance's K/V pulled block by block by its decode instance (chapter 13).

The pair is one `KVLink` (`minillm.kv_transfer.transport`): a 2-rank torch.distributed group,
gloo on CPU. Each instance runs one transfer thread; the decode side (consumer) drives:

    decode (rank 1)                                prefill (rank 0)
    a request with do_remote_prefill arrives:      a request with do_remote_decode runs its prompt
      held, not scheduled                          and samples its first token, then finishes:
                                                   request_finished → blocks pinned under its transfer id
    send [PULL, blocks it has cached] + transfer id ─►  look the id up
                                       ◄───────    [OK, prompt len, blocks, first token, dtype, L, bs, H, D]
                                       ◄───────    prompt ids (checked against the decode's own)
                                       ◄───────    block k K|V, block k+1 K|V, ...  (one tensor each;
                                                   the first k: the decode side's prefix cache has them)
    send [ACK]                         ───────►    free the pinned blocks (on the engine thread)
    engine thread: append the first token (the client sees it now), queue the request;
    admission: get_num_new_matched_tokens = prompt length → blocks allocated →
    update_state_after_alloc → the worker's start_load_kv copies the blocks in before the forward
    → the first step is a decode row: no prompt token is computed on the decode side.

As SGLang's PD mode does, the prefill's sampled token travels with the K/V, so the decode side
needs no logits of the last prompt token (vLLM's decode instance recomputes that one token
instead). If the decode side never asks, the prefill side frees the blocks after
`abort_timeout_s`; if the link breaks (a peer died: the send or recv raises), it frees them all at
once, and the decode side fails the requests it holds with a clear error.

Only engine-thread code touches scheduler and KV-manager state: the transfer thread hands its
results over with `engine.call_soon`. The prefill side reads pinned blocks from the worker's pool
on the transfer thread; nobody writes them while they are pinned.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial

import torch

from minillm.engine.threaded import ADD_FAILED
from minillm.kv_transfer.base import KVConnectorBase, kv_transfer_params
from minillm.kv_transfer.config import KVTransferConfig
from minillm.kv_transfer.transport import DTYPES, KVLink
from minillm.request import Request
from minillm.scheduler.base import RequestUpdate

logger = logging.getLogger("minillm.kv_transfer")

OP_PULL, OP_ACK = 1, 2
STATUS_OK, STATUS_UNKNOWN = 0, 1


@dataclass
class Pinned:
    """A finished prefill's blocks, kept for the decode side."""

    request: Request
    block_ids: list[int]
    first_token: int
    deadline: float


@dataclass
class Pull:
    request: Request
    transfer_id: str
    skip_blocks: int = 0  # leading prompt blocks the decode side's prefix cache holds: not sent


@dataclass
class TransferStats:
    """Counters of one side (written by one thread each; read by the metrics exporter)."""

    ok: int = 0
    unknown: int = 0
    failed: int = 0
    expired: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    external_prompt_tokens: int = 0  # consumer: prompt tokens loaded instead of computed
    prompt_tokens_computed: int = 0  # prompt tokens this engine's steps computed


class TorchDistConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, engine) -> None:
        self.config = config
        self.role = config.kv_role
        self.engine = engine
        self.kv = engine.kv
        self.runner = engine.executor.worker
        spec = self.kv.cache_spec
        self.block_size = spec.block_size
        self.block_shape = (2, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.dtype = spec.dtype
        self.device = str(self.runner.k_pool.device)
        self.abort_timeout_s = config.extra["abort_timeout_s"]
        self.delay_s = config.extra["link_delay_per_block_s"]
        self.lock = threading.Lock()
        self.pinned: dict[str, Pinned] = {}  # producer: transfer id -> pinned blocks
        self.pulls: queue.SimpleQueue = queue.SimpleQueue()  # consumer: transfers to ask for, in order
        self.held: dict[str, Pull] = {}  # consumer: request id -> its transfer (engine thread only)
        # consumer: request id -> (received blocks [nb - skip, 2, L, bs, H, D], skip: the prompt blocks not sent)
        self.staged: dict[str, tuple[torch.Tensor, int]] = {}
        self.loads: dict[str, tuple[int, list[int]]] = {}  # consumer: request id -> (first staged block, its blocks)
        self.link: KVLink | None = None
        self.link_up = threading.Event()
        self.link_error: str | None = None
        self.stats = TransferStats()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def is_producer(self) -> bool:
        return self.config.is_producer

    def start(self) -> None:
        """Join the pair (on the transfer thread: the server answers /health meanwhile), then serve it."""
        t = threading.Thread(target=self._run, name=f"kv-transfer-{self.role}", daemon=True)
        t.start()
        self._threads.append(t)
        if self.is_producer:
            e = threading.Thread(target=self._expire_loop, name="kv-transfer-expiry", daemon=True)
            e.start()
            self._threads.append(e)

    def stop(self) -> None:
        self._stop.set()
        self.pulls.put(None)

    # ---- engine hook: arrival ------------------------------------------------------------------
    def on_arrival(self, request: Request) -> bool:
        params = kv_transfer_params(request)
        if params is None:
            return False
        if self.is_producer:
            if not params.get("do_remote_decode"):
                raise ValueError("kv_transfer_params on a prefill instance (kv_producer) must set "
                                 "do_remote_decode: true")
            # The prefill instance computes the prompt and samples the first token only. The client's
            # max_tokens stays in the request the router sends (so this server judges it as the decode
            # server will); the cap is applied here.
            request.params = dataclasses.replace(request.params, max_tokens=1,
                                                 min_tokens=min(request.params.min_tokens, 1))
            return False
        if not params.get("do_remote_prefill"):
            raise ValueError("kv_transfer_params on a decode instance (kv_consumer) must set do_remote_prefill: true")
        if request.params.n != 1:
            raise ValueError(f"n must be 1 for a request whose prompt was prefilled remotely, got {request.params.n}")
        if self.link_error is not None:
            raise RuntimeError(f"the KV link to the prefill instance is down ({self.link_error})")
        # Blocks this instance's prefix cache holds now need not cross; if they are evicted before the
        # request is admitted, it recomputes its prompt instead (counted: minillm:prompt_tokens_computed).
        pull = Pull(request, params["transfer_id"], self.kv.cached_prefix_tokens(request) // self.block_size)
        self.held[request.request_id] = pull
        self.pulls.put(pull)
        return True

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        staged = self.staged.get(request.request_id)
        if staged is None or num_computed_tokens < staged[1] * self.block_size:
            return 0, False  # nothing received, or the prefix the pull skipped is no longer cached
        # The blocks are in host memory already: the load is synchronous (before this step's forward).
        return max(0, request.num_prompt_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        bs = self.block_size
        first = (request.num_computed_tokens - num_external_tokens) // bs  # after the prefix-cached blocks
        last = -(-request.num_computed_tokens // bs)
        self.loads[request.request_id] = (first, list(block_ids[first:last]))
        self.stats.external_prompt_tokens += num_external_tokens

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        if not self.is_producer:
            self.staged.pop(rid, None)
            self.loads.pop(rid, None)
            return False, None
        params = kv_transfer_params(request)
        if params is None or not request.output_token_ids or self.link_error is not None:
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        entry = Pinned(request, list(block_ids[:num_blocks]), request.output_token_ids[0],
                       time.monotonic() + self.abort_timeout_s)
        with self.lock:
            old = self.pinned.pop(params["transfer_id"], None)
            self.pinned[params["transfer_id"]] = entry
        if old is not None:  # the same id again: the older copy can never be asked for
            self._release([old])
        return True, {"transfer_id": params["transfer_id"], "num_blocks": num_blocks}

    def on_step(self, step) -> None:
        """A step observer: prompt tokens this engine computed (0 on a decode instance, if all goes well)."""
        self.stats.prompt_tokens_computed += step.num_prefill_tokens

    # ---- worker side ---------------------------------------------------------------------------
    def start_load_kv(self, runner, plan) -> None:
        if not self.loads:
            return
        bs = self.block_size
        for rid in plan.req_ids:
            entry = self.loads.pop(rid, None)
            staged = self.staged.get(rid)
            if entry is None or staged is None:
                continue
            first, blocks = entry
            kv, skip = staged
            for i, b in enumerate(blocks):  # block by block into the request's own blocks
                runner.k_pool[:, b * bs:(b + 1) * bs] = kv[first - skip + i, 0]
                runner.v_pool[:, b * bs:(b + 1) * bs] = kv[first - skip + i, 1]

    # ---- engine-thread actions (queued by the transfer threads) --------------------------------
    def _release(self, entries: list[Pinned]) -> None:
        for e in entries:
            self.kv.free(e.request)

    def _received(self, pull: Pull, staged: tuple[torch.Tensor, int], prompt_ids: list[int], first_token: int) -> None:
        engine, rid = self.engine, pull.request.request_id
        self.held.pop(rid, None)
        for gone in [r for r in self.staged if r not in engine.requests]:
            del self.staged[gone]  # aborted while running: nobody will load them
        req = engine.requests.get(rid)
        if req is not pull.request:
            return  # aborted while its K/V were on the way
        if prompt_ids != req.prompt_token_ids:
            self._fail(req, f"the prefill instance computed a different prompt for transfer id "
                            f"{pull.transfer_id!r} ({len(prompt_ids)} tokens vs {req.num_prompt_tokens} here)")
            return
        self.staged[rid] = staged
        req.append_token(first_token)  # the prefill's sampled token: the client gets it now
        status = req.check_stop(first_token, engine.config.max_model_len)
        if status is not None:
            req.status = status
            self.staged.pop(rid, None)
        else:
            engine.scheduler.add_request(req)
        engine._on_update(RequestUpdate(req, [first_token], status), engine.clock.now())

    def _fail(self, req: Request, message: str) -> None:
        self.held.pop(req.request_id, None)
        if self.engine.requests.get(req.request_id) is not req:
            return
        req.error = f"{ADD_FAILED}: {message}"  # the server answers 500: not the client's fault
        self.engine.abort_request(req.request_id)

    def _fail_held(self, message: str) -> None:
        for pull in list(self.held.values()):
            self._fail(pull.request, message)

    # ---- transfer threads ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.link = KVLink(self.config.kv_rank, self.config.kv_ip, self.config.kv_port, self.device,
                               timeout_s=self.config.extra["connect_timeout_s"])
            self.link_up.set()
            logger.info("KV link up: %s rank %d (%s) at %s:%d", self.role, self.link.rank, self.link.backend,
                        self.config.kv_ip, self.config.kv_port)
            if self.is_producer:
                self._serve_pulls()
            else:
                self._pull_loop()
        except Exception as err:  # noqa: BLE001 - a dead peer or a failed rendezvous ends the link, not the server
            if self._stop.is_set():
                return
            self.link_error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            logger.error("KV link (%s) is down: %s", self.role, self.link_error)
            if self.is_producer:
                with self.lock:
                    entries = list(self.pinned.values())
                    self.pinned.clear()
                if entries:
                    self.stats.failed += len(entries)
                    self.engine.call_soon(partial(self._release, entries))
            else:
                self.engine.call_soon(partial(self._fail_held, f"the KV link to the prefill instance broke "
                                                               f"({self.link_error})"))

    def _serve_pulls(self) -> None:
        link, itemsize = self.link, torch.finfo(self.dtype).bits // 8
        while not self._stop.is_set():
            op, skip = link.recv_header()[:2]  # waits for the next pull; raises if the consumer died
            if op != OP_PULL:
                raise RuntimeError(f"expected a pull (op {OP_PULL}) from the consumer, got op {op}")
            tid = link.recv_text()
            with self.lock:
                entry = self.pinned.pop(tid, None)
            if entry is None:
                self.stats.unknown += 1
                link.send_header(STATUS_UNKNOWN)
                continue
            start, nbytes = time.perf_counter(), 0
            try:
                req = entry.request
                skip = min(skip, len(entry.block_ids))
                link.send_header(STATUS_OK, req.num_prompt_tokens, len(entry.block_ids) - skip, entry.first_token,
                                 DTYPES.index(self.dtype), *self.block_shape[1:])
                link.send(torch.tensor(req.prompt_token_ids, dtype=torch.int64, device=link.device))
                for block in self.save_kv_blocks(self.runner, entry.block_ids[skip:]):
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    link.send(block)
                    self.stats.blocks += 1
                    nbytes += block.numel() * itemsize
                if link.recv_header()[0] != OP_ACK:
                    raise RuntimeError("the consumer did not acknowledge the blocks")
                self.stats.ok += 1
            except Exception:
                self.stats.failed += 1
                raise
            finally:  # acknowledged, or the link broke: either way nobody will read them again
                self.stats.bytes += nbytes
                self.stats.seconds += time.perf_counter() - start
                self.engine.call_soon(partial(self._release, [entry]))

    def _pull_loop(self) -> None:
        link = self.link
        while True:
            pull = self.pulls.get()
            if pull is None or self._stop.is_set():
                return
            start = time.perf_counter()
            link.send_header(OP_PULL, pull.skip_blocks)
            link.send_text(pull.transfer_id)
            status, n, nb, first, dtype_code, *shape = link.recv_header()[:9]
            if status == STATUS_UNKNOWN:
                self.stats.unknown += 1
                self.engine.call_soon(partial(self._fail, pull.request, (
                    f"the prefill instance holds no KV for transfer id {pull.transfer_id!r} (never prefilled "
                    f"there, or its blocks expired after {self.abort_timeout_s:.0f} s)")))
                continue
            dtype, shape = DTYPES[dtype_code], (2, *shape)
            prompt = link.recv(torch.empty(n, dtype=torch.int64, device=link.device))
            staged = torch.empty((nb, *shape), dtype=dtype, device=link.device)
            for i in range(nb):
                link.recv(staged[i])
            link.send_header(OP_ACK)
            self.stats.blocks += nb
            nbytes = staged.numel() * staged.element_size()
            self.stats.bytes += nbytes
            self.stats.seconds += time.perf_counter() - start
            if shape != self.block_shape or dtype != self.dtype:
                self.stats.failed += 1
                self.engine.call_soon(partial(self._fail, pull.request, (
                    f"the prefill instance's KV blocks are {tuple(shape)} {dtype}, this instance's "
                    f"{self.block_shape} {self.dtype}: start both with the same model, dtype and --block-size")))
                continue
            self.stats.ok += 1
            self.engine.call_soon(partial(self._received, pull, (staged, pull.skip_blocks), prompt.tolist(), first))

    def _expire_loop(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self.lock:
                expired = [tid for tid, e in self.pinned.items() if e.deadline < now]
                entries = [self.pinned.pop(tid) for tid in expired]
            if entries:
                self.stats.expired += len(entries)
                logger.warning("freeing the KV of %d finished prefill(s) nobody pulled within %.0f s",
                               len(entries), self.abort_timeout_s)
                self.engine.call_soon(partial(self._release, entries))
