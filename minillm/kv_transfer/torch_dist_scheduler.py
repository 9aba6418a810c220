"""`TorchDistConnector`'s scheduler side: which blocks cross, and when they may be freed (chapter 13).

The engine process of each instance builds this half. The two engine processes talk over the
pair's "control" group (`minillm.kv_transfer.transport`, gloo): small messages only. The K/V
themselves go worker rank to worker rank (`torch_dist_worker.py`), told what to move by the plan.
The decode side (consumer) drives:

    decode engine (rank 1)                            prefill engine (rank 0)
    a request with do_remote_prefill arrives:         a request with do_remote_decode runs its prompt
      held, not scheduled                             and samples its first token, then finishes:
                                                      request_finished → blocks pinned under its transfer id
    [PULL, blocks it has cached] + transfer id ──►    look the id up
                                              ◄──     [OK, prompt len, blocks, first token, dtype, L, bs, H, D,
                                                       ranks], the prompt ids (checked against its own),
                                                      the block ids (after those the decode side has)
    engine thread (take_events): append the first token (the client sees it now), queue the request;
    admission: get_num_new_matched_tokens = prompt length → blocks allocated → update_state_after_alloc
    → build_connector_meta puts the load into the plan → every decode rank reads its share of the
    blocks from the same prefill rank before the forward → update_connector_output: loaded →
    [ACK] + transfer id                        ──►    free the pinned blocks (on the engine thread)

The first step of the request on the decode side is a decode row: no prompt token is computed
there. As SGLang's PD mode does, the prefill's sampled token travels with the K/V, so the decode
side needs no logits of the last prompt token (vLLM's decode instance recomputes that one token
instead). If the decode side never asks, the prefill side frees the blocks after
`abort_timeout_s`; if the link breaks (a peer died: the send or recv raises), it frees them all at
once, and the decode side fails the requests it holds with a clear error.

This half never touches an engine, a scheduler or a worker: its threads queue what they learned
(`take_events`) and call `notify()`; the engine thread takes the events and applies them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from minillm.kv.base import KVCacheSpec
from minillm.kv_transfer.base import (
    ConnectorEvents,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLoad,
    kv_transfer_params,
)
from minillm.kv_transfer.config import KVTransferConfig
from minillm.kv_transfer.transport import BLOCK_KINDS, KVLink, connect_store
from minillm.request import Request, RequestStatus

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
class Remote:
    """Consumer: a request whose prefill is done remotely, waiting to be loaded."""

    transfer_id: str
    block_ids: list[int]  # the producer's blocks of the prompt, after the first `skip_blocks`
    skip_blocks: int


@dataclass
class TransferStats:
    """Counters of one side (written by one thread each; read by the metrics exporter)."""

    ok: int = 0
    unknown: int = 0
    failed: int = 0
    expired: int = 0
    blocks: int = 0  # producer: blocks handed to a pull; consumer: blocks loaded into its pool
    bytes: int = 0  # their K/V bytes, every rank's share together
    seconds: float = 0.0
    external_prompt_tokens: int = 0  # consumer: prompt tokens loaded instead of computed
    prompt_tokens_computed: int = 0  # prompt tokens this engine's steps computed


class TorchDistConnectorScheduler(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, cache_spec: KVCacheSpec, world_size: int,
                 cached_prefix_tokens: Callable[[Request], int], notify: Callable[[], None]) -> None:
        """`cache_spec`: the whole model's KV pool (the workers hold their shares of it, `world_size`
        ranks); `cached_prefix_tokens(request)`: how many of its prompt tokens this instance's prefix
        cache holds; `notify()`: called (from the connector's threads) when `take_events` has news."""
        self.config = config
        self.role = config.kv_role
        self.cached_prefix_tokens = cached_prefix_tokens
        self.notify = notify
        self.world_size = world_size
        self.block_size = cache_spec.block_size
        self.block_shape = (2, cache_spec.num_layers, cache_spec.block_size, cache_spec.num_kv_heads,
                            cache_spec.row_width)  # (a quantized pool's rows are bytes: codes, then the scale)
        self.kind = cache_spec.kv_cache_dtype if cache_spec.quantized else cache_spec.dtype  # one of BLOCK_KINDS
        self.block_bytes = cache_spec.block_bytes
        self.abort_timeout_s = config.extra["abort_timeout_s"]
        self.lock = threading.Lock()
        self.events = ConnectorEvents()  # (under the lock)
        self.pinned: dict[str, Pinned] = {}  # producer: transfer id -> blocks waiting for a pull
        self.sending: dict[str, Pinned] = {}  # producer: transfer id -> blocks pulled, not yet acknowledged
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # consumer: pulls and acks, in order
        # consumer: request id -> its pull, from arrival until the producer answered
        self.held: dict[str, Pull] = {}
        # consumer: request id -> where its blocks are (set by the transfer thread before it posts the
        # request as ready; then read and removed on the engine thread only)
        self.remote: dict[str, Remote] = {}
        self.loads: dict[str, KVLoad] = {}  # consumer: loads for the next plan (engine thread)
        self.link: KVLink | None = None
        self.link_up = threading.Event()
        self.link_error: str | None = None
        self.stats = TransferStats()
        self._stop = threading.Event()
        self._store = None

    @property
    def is_producer(self) -> bool:
        return self.config.is_producer

    def start(self) -> None:
        """Join the pair (on the transfer thread: the server answers /health meanwhile), then serve it."""
        threading.Thread(target=self._run, name=f"kv-transfer-{self.role}", daemon=True).start()
        if self.is_producer:
            threading.Thread(target=self._expire_loop, name="kv-transfer-expiry", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.outbox.put(None)

    def take_events(self) -> ConnectorEvents:
        with self.lock:
            events, self.events = self.events, ConnectorEvents()
        return events

    def _post(self, **items) -> None:
        with self.lock:
            for name, values in items.items():
                getattr(self.events, name).extend(values)
        self.notify()

    # ---- arrival (engine thread) -------------------------------------------------------------------
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
        pull = Pull(request, params["transfer_id"], self.cached_prefix_tokens(request) // self.block_size)
        self.held[request.request_id] = pull
        self.outbox.put(pull)
        return True

    # ---- scheduler side (engine thread) ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self.remote.get(request.request_id)
        if remote is None or num_computed_tokens < remote.skip_blocks * self.block_size or self.link_error:
            # nothing to load, the prefix the pull skipped is no longer cached, or the prefill instance
            # is gone: the request computes its prompt here (counted: minillm:prompt_tokens_computed)
            return 0, False
        # The blocks are loaded in the step that schedules the request, before its forward.
        return max(0, request.num_prompt_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        remote, bs = self.remote[request.request_id], self.block_size
        first = (request.num_computed_tokens - num_external_tokens) // bs  # after the prefix-cached blocks
        last = -(-request.num_computed_tokens // bs)
        self.loads[request.request_id] = KVLoad(request.request_id, list(block_ids[first:last]),
                                                remote.block_ids[first - remote.skip_blocks:last - remote.skip_blocks])
        self.stats.external_prompt_tokens += num_external_tokens

    def build_connector_meta(self, plan) -> KVConnectorMetadata | None:
        if not self.loads:
            return None
        loads, self.loads = list(self.loads.values()), {}
        return KVConnectorMetadata(loads)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            remote = self.remote.pop(rid, None)
            if remote is None:
                continue
            n = len(remote.block_ids)
            self.stats.ok += 1
            self.stats.blocks += n
            self.stats.bytes += n * self.block_bytes
            self.outbox.put(remote.transfer_id)  # the producer may free them now
        self.stats.seconds += output.load_seconds

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        if not self.is_producer:
            self.loads.pop(rid, None)
            remote = self.remote.pop(rid, None)
            if remote is not None:  # finished or aborted before its blocks were loaded: let the producer free them
                self.outbox.put(remote.transfer_id)
            return False, None
        params = kv_transfer_params(request)
        if params is None or not request.output_token_ids or request.status is RequestStatus.FINISHED_ABORTED or \
                self.link_error is not None:
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        entry = Pinned(request, list(block_ids[:num_blocks]), request.output_token_ids[0],
                       time.monotonic() + self.abort_timeout_s)
        with self.lock:
            old = self.pinned.pop(params["transfer_id"], None)
            self.pinned[params["transfer_id"]] = entry
        if old is not None:  # the same id again: the older copy can never be asked for
            self._post(release=[old.request])
        return True, {"transfer_id": params["transfer_id"], "num_blocks": num_blocks}

    def on_step(self, step) -> None:
        """A step observer: prompt tokens this engine computed (0 on a decode instance, if all goes well)."""
        self.stats.prompt_tokens_computed += step.num_prefill_tokens

    # ---- transfer threads ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._store = connect_store(self.config.kv_ip, self.config.kv_port, self.is_producer,
                                        self.config.extra["connect_timeout_s"])
            self.link = KVLink(self._store, "control", self.config.kv_rank, "cpu",
                              rendezvous=(self.config.kv_ip, self.config.kv_port))
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
                    entries = list(self.pinned.values()) + list(self.sending.values())
                    self.pinned.clear()
                    self.sending.clear()
                self.stats.failed += len(entries)
                self._post(release=[e.request for e in entries])
            else:
                message = f"the KV link to the prefill instance broke ({self.link_error})"
                self._post(failed=[(pull.request, message) for pull in list(self.held.values())])

    def _serve_pulls(self) -> None:
        link = self.link
        while not self._stop.is_set():
            op, skip = link.recv_header()[:2]  # waits for the next message; raises if the consumer died
            tid = link.recv_text()
            if op == OP_ACK:
                with self.lock:
                    entry = self.sending.pop(tid, None)
                if entry is not None:
                    self.stats.ok += 1
                    self._post(release=[entry.request])
                continue
            if op != OP_PULL:
                raise RuntimeError(f"expected a pull (op {OP_PULL}) or an ack (op {OP_ACK}), got op {op}")
            with self.lock:
                entry = self.pinned.pop(tid, None)
                if entry is not None:
                    self.sending[tid] = entry
            if entry is None:
                self.stats.unknown += 1
                link.send_header(STATUS_UNKNOWN)
                continue
            req, blocks = entry.request, entry.block_ids[min(skip, len(entry.block_ids)):]
            link.send_header(STATUS_OK, req.num_prompt_tokens, len(blocks), entry.first_token,
                             BLOCK_KINDS.index(self.kind), *self.block_shape[1:], self.world_size)
            link.send_ids(req.prompt_token_ids)
            link.send_ids(blocks)
            self.stats.blocks += len(blocks)  # handed to the pull: the decode ranks read them now
            self.stats.bytes += len(blocks) * self.block_bytes

    def _pull_loop(self) -> None:
        link = self.link
        while True:
            item = self.outbox.get()
            if item is None or self._stop.is_set():
                return
            if isinstance(item, str):  # an ack: the blocks of this transfer are loaded (or not needed)
                link.send_header(OP_ACK)
                link.send_text(item)
                continue
            pull, start = item, time.perf_counter()
            link.send_header(OP_PULL, pull.skip_blocks)
            link.send_text(pull.transfer_id)
            status, n, nb, first, dtype_code, *shape = link.recv_header()[:10]
            if status == STATUS_UNKNOWN:
                self.stats.unknown += 1
                self.held.pop(pull.request.request_id, None)
                self._post(failed=[(pull.request, (
                    f"the prefill instance holds no KV for transfer id {pull.transfer_id!r} (never prefilled "
                    f"there, or its blocks expired after {self.abort_timeout_s:.0f} s)"))])
                continue
            prompt, block_ids = link.recv_ids(), link.recv_ids()
            self.stats.seconds += time.perf_counter() - start
            *shape, ranks = shape
            why = None
            if (2, *shape) != self.block_shape or BLOCK_KINDS[dtype_code] != self.kind:
                why = (f"the prefill instance's KV blocks are {(2, *shape)} {BLOCK_KINDS[dtype_code]}, this instance's "
                       f"{self.block_shape} {self.kind}: start both with the same model, dtype, --kv-cache-dtype "
                       "and --block-size")
            elif ranks != self.world_size:
                why = (f"the prefill instance runs on {ranks} worker rank(s), this one on {self.world_size}: "
                       "start both with the same --tensor-parallel-size and --pipeline-parallel-size")
            elif prompt != pull.request.prompt_token_ids:
                why = (f"the prefill instance computed a different prompt for transfer id {pull.transfer_id!r} "
                       f"({n} tokens vs {pull.request.num_prompt_tokens} here)")
            if why is not None:
                self.stats.failed += 1
                link.send_header(OP_ACK)  # nobody will read those blocks: free them
                link.send_text(pull.transfer_id)
                self.held.pop(pull.request.request_id, None)
                self._post(failed=[(pull.request, why)])
                continue
            self.remote[pull.request.request_id] = Remote(pull.transfer_id, block_ids, pull.skip_blocks)
            self.held.pop(pull.request.request_id, None)
            self._post(ready=[(pull.request, first)])

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
                self._post(release=[e.request for e in entries])
