"""The KV connector's API, split as vLLM's `KVConnectorBase_V1` splits it (chapter 13).

A connector lets an engine use K/V it did not compute (the decode instance of a prefill/decode
pair) and hand over K/V it did compute (the prefill instance). As in vLLM, one class describes
both halves and each process builds the half its role needs: the *scheduler side* in the engine
process, the *worker side* in every worker (one per tensor/pipeline-parallel rank). The two never
share an object: what the scheduler side decides reaches the workers inside the step's plan
(`SchedulerOutput.kv_connector_metadata`), and what the workers did comes back inside their output
(`ModelRunnerOutput.kv_connector_output`). vLLM's file, for comparison:
`vllm/distributed/kv_transfer/kv_connector/v1/base.py`.

scheduler side (plans; touches no tensor)
    get_num_new_matched_tokens(request, num_computed_tokens) -> (tokens, load_async)
        how many of the request's tokens after its local (prefix-cached) ones the connector
        can supply; asked when the scheduler admits a request
    update_state_after_alloc(request, block_ids, num_external_tokens)
        the KV manager gave the request its blocks: remember which ones the load must fill
    build_connector_meta(plan) -> KVConnectorMetadata | None
        at the end of `schedule()`: what the workers must load this step, as data
    update_connector_output(output)
        in `update_from_output`: what the workers finished loading
    request_finished(request, block_ids) -> (delay_free, kv_transfer_params)
        a request finished: True keeps its blocks pinned (the producer, until the consumer has
        them); the connector frees them later

worker side (moves K/V in and out of its own rank's pool)
    register_kv_caches(k_pool, v_pool, block_size)   the rank's pool, once
    start_load_kv(metadata) -> KVConnectorOutput     before the forward: fill the plan's blocks
    save_kv_blocks(runner, block_ids)                a pool's blocks as tensors, one at a time

minillm-only, scheduler side: `on_arrival(request)`, asked by the engine when a request arrives;
True means the connector holds it until its remote K/V can be loaded (vLLM parks such requests in
the scheduler's WAITING_FOR_REMOTE_KVS state instead); `take_events()` returns what happened on
the connector's own threads since the last call (held requests now ready or failed, pinned
blocks to free) for the engine thread to apply; the connector calls the `notify` function it was
built with when there is something to take.

A request asks for a transfer with vLLM's `kv_transfer_params` (OpenAI body field, carried in
`SamplingParams.extra_args`): `{"do_remote_decode": true, "transfer_id": ...}` on the prefill
instance, `{"do_remote_prefill": true, "transfer_id": ...}` on the decode instance.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from minillm.request import Request

MAX_TRANSFER_ID_LEN = 128


def kv_transfer_params(request: Request) -> dict | None:
    """The request's `kv_transfer_params`, checked; None if it has none. ValueError names what is wrong."""
    extra = request.params.extra_args or {}
    params = extra.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {params!r}")
    tid = params.get("transfer_id")
    if not isinstance(tid, str) or not 0 < len(tid) <= MAX_TRANSFER_ID_LEN:
        raise ValueError(f"kv_transfer_params.transfer_id must be a string of 1 to {MAX_TRANSFER_ID_LEN} "
                         f"characters, got {tid!r}")
    return params


@dataclass
class KVLoad:
    """One request's load: the producer's blocks `remote_block_ids` into this instance's `local_block_ids`."""

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells every worker for one step (plain data: it is pickled to the ranks)."""

    loads: list[KVLoad] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    """What a worker side did in one step (vLLM's `KVConnectorOutput`)."""

    finished_recving: list[str] = field(default_factory=list)  # request ids whose blocks are loaded
    load_seconds: float = 0.0


@dataclass
class ConnectorEvents:
    """What the connector's threads produced for the engine thread (`take_events`)."""

    ready: list[tuple[Request, int]] = field(default_factory=list)  # held requests, with the prefill's first token
    failed: list[tuple[Request, str]] = field(default_factory=list)  # held requests that cannot be served, and why
    release: list[Request] = field(default_factory=list)  # finished prefills whose pinned blocks can be freed


class KVConnectorBase:
    """The default does nothing: no remote tokens, nothing pinned, nothing loaded."""

    role: str = ""

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, plan: Any) -> KVConnectorMetadata | None:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None

    def on_arrival(self, request: Request) -> bool:
        return False

    def take_events(self) -> ConnectorEvents:
        return ConnectorEvents()

    def on_step(self, step: Any) -> None:
        """A step observer (the engine's metrics call it after every step)."""

    def start(self) -> None:
        """Start the connector's threads (the engine calls it once it is built)."""

    def stop(self) -> None:
        """Stop the connector's threads."""

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int) -> None:
        pass

    def start_load_kv(self, metadata: KVConnectorMetadata) -> KVConnectorOutput | None:
        return None

    def save_kv_blocks(self, runner: Any, block_ids: list[int]) -> Iterator[torch.Tensor]:
        """Each block's K and V, stacked: [2, num_layers, block_size, num_kv_heads, head_dim] (the
        layers and KV heads `runner`'s pool holds: on a tensor-parallel rank, its own)."""
        bs = runner.block_size
        for b in block_ids:
            yield torch.stack((runner.k_pool[:, b * bs:(b + 1) * bs], runner.v_pool[:, b * bs:(b + 1) * bs]))
