"""The KV connector's API, split as vLLM's `KVConnectorBase_V1` splits it (chapter 13).

A connector lets an engine use K/V it did not compute (the decode instance of a prefill/decode
pair) and hand over K/V it did compute (the prefill instance). vLLM splits the work between the
scheduler process and the worker processes; minillm keeps the names, so the chapter can point at
vLLM's (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`):

scheduler side (plans; touches no tensor)
    get_num_new_matched_tokens(request, num_computed_tokens) -> (tokens, load_async)
        how many of the request's tokens after its local (prefix-cached) ones the connector
        can supply; asked when the scheduler admits a request
    update_state_after_alloc(request, block_ids, num_external_tokens)
        the KV manager gave the request its blocks: remember which ones the load must fill
    request_finished(request, block_ids) -> (delay_free, kv_transfer_params)
        a request finished: True keeps its blocks pinned (the producer, until the consumer has
        them); the connector frees them later

worker side (moves K/V in and out of the worker's pool)
    start_load_kv(runner, plan)   before the forward: copy received K/V into the request's blocks
    save_kv_blocks(block_ids)     the producer's blocks as tensors, one block at a time, to send

minillm-only: `on_arrival(request)`, asked by the engine when a request arrives; True means the
connector holds it until its remote K/V are here (vLLM parks such requests in the scheduler's
WAITING_FOR_REMOTE_KVS state instead).

A request asks for a transfer with vLLM's `kv_transfer_params` (OpenAI body field, carried in
`SamplingParams.extra_args`): `{"do_remote_decode": true, "transfer_id": ...}` on the prefill
instance, `{"do_remote_prefill": true, "transfer_id": ...}` on the decode instance.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from minillm.request import Request

MAX_TRANSFER_ID_LEN = 128


def kv_transfer_params(request: Request) -> dict | None:
    """The request's `kv_transfer_params`, checked; None if it has none. ValueError names what is wrong."""
    extra = getattr(request.params, "extra_args", None) or {}
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


class KVConnectorBase:
    """The default does nothing: no remote tokens, nothing pinned, nothing loaded."""

    role: str = ""

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None

    # ---- engine (minillm) ----------------------------------------------------------------------
    def on_arrival(self, request: Request) -> bool:
        return False

    # ---- worker side ---------------------------------------------------------------------------
    def start_load_kv(self, runner: Any, plan: Any) -> None:
        pass

    def save_kv_blocks(self, runner: Any, block_ids: list[int]) -> Iterator[torch.Tensor]:
        """Each block's K and V, stacked: [2, num_layers, block_size, num_kv_heads, head_dim]."""
        bs = runner.block_size
        for b in block_ids:
            yield torch.stack((runner.k_pool[:, b * bs:(b + 1) * bs], runner.v_pool[:, b * bs:(b + 1) * bs]))
