"""Every engine knob in one place, checked once at construction (chapters 02–07).

Names follow vLLM's engine arguments so that what a learner tunes here carries over.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from minillm.attention.registry import backend_names  # the backends' names (one line each there)

BATCHING_MODES = ("static", "dynamic", "continuous")
KV_LAYOUTS = ("paged", "slab")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
PREFIX_CACHES = ("hash", "radix")
DTYPES = ("float32", "float64", "bfloat16", "float16")
CHUNK_POLICIES = ("sarathi", "splitfuse")  # minillm.scheduler.chunk_policy
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # minillm.kv.quant (chapter 14)
# minillm.executor: in this process, one process per rank (forked where safe), or this process as one rank of a
# world that torchrun started (every process an engine; vLLM's name)
EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")


@dataclass
class EngineConfig:
    batching: str = "continuous"
    max_num_seqs: int = 32  # most requests running at once (the batch size)
    max_num_batched_tokens: int | None = None  # token budget per step; default max(2048, max_model_len), 2048 chunked
    enable_chunked_prefill: bool = False  # split long prefills across steps so running decodes never stall (ch. 08)
    long_prefill_token_threshold: int = 0  # chunked prefill: most tokens one request prefills per step (0: no cap)
    # chunked prefill: how big each step is (minillm.scheduler.chunk_policy, ch. 08): "sarathi", a fixed
    # max_num_batched_tokens budget; "splitfuse" (DeepSpeed-FastGen's Dynamic SplitFuse), max_num_batched_tokens
    # is the target size and the queued prompt tokens are split evenly over the steps they need
    chunk_policy: str = "sarathi"
    max_model_len: int | None = None  # prompt + output; default the model's max_position_embeddings
    max_queue_delay_ms: float = 10.0  # dynamic batching: fire when the oldest request waited this long
    static_batch_timeout_ms: float = math.inf  # static batching: fire a partial batch after this wait
    # static/dynamic: a finished request is returned only when its whole batch ends (Orca's second waste)
    static_hold_finished: bool = False
    kv_layout: str = "paged"  # continuous batching only: "paged" blocks, or one "slab" per request
    block_size: int = 16  # token slots per KV block
    num_kv_blocks: int | None = None  # pool size; default: as much KV as max_num_seqs slabs would hold
    enable_prefix_caching: bool = False
    prefix_cache: str = "hash"  # how cached prefixes are found: vLLM's "hash" chain or SGLang's "radix" tree
    kv_watermark: float = 0.01  # fraction of blocks kept free when admitting new requests
    preemption_mode: str = "recompute"  # or "swap": K/V of a preempted request go to host memory
    swap_space: float = 4.0  # GiB of host memory for swapped-out K/V (vLLM's name and default)
    # GiB of host memory for the prefix cache's offload tier (vLLM's --kv-offloading-size; 0: none): evicted
    # cached blocks spill there and come back on a hit instead of being recomputed (chapter 14, minillm.kv.offload)
    kv_offloading_size: float = 0.0
    # "fcfs"; "priority": lower priority value runs first; "lpm": longest cached prefix first (SGLang)
    scheduling_policy: str = "fcfs"
    seed: int = 0  # seeds requests that sample without their own seed
    # "torch", "numba" (chapter 10's CUDA kernels), "numba_cpu" (its @njit CPU decode kernel) or "auto":
    # numba on CUDA, numba_cpu on a CPU (minillm.attention.select says why); any name in minillm.attention.registry
    attention_backend: str = "auto"
    # Speculative decoding (chapter 09), vLLM's dict: {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}
    speculative_config: Any = None
    # Several processes, one model (chapter 12; minillm.distributed): TP ranks per stage × PP stages, each rank a
    # process ("mp", forked where safe: minillm.executor.start_method), or each process one rank under torchrun
    # ("external_launcher", docs/multinode.md); None picks "uni" for one rank, "mp" for more. A step that takes
    # longer than execute_model_timeout_s on the workers fails with an error naming the rank (a hung or dead worker).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    execute_model_timeout_s: float = 300.0
    # A world across nodes (issue 28; minillm.distributed.nodes, docs/multinode.md), vLLM's multi-node flags: the
    # engine runs on node 0 with its share of the ranks, each other node runs `minillm serve --headless` with the
    # rest; all meet at the TCPStore master_addr:master_port that the engine hosts. A node whose ranks have not all
    # joined within node_join_timeout_s fails start-up, named. nnodes=1: this machine, a FileStore, no port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_join_timeout_s: float = 60.0
    # Mixtral (chapter 12): experts whole on the tensor-parallel ranks (EP size = TP size), tokens sent to them
    # with all-to-alls (minillm.distributed.moe); attention stays tensor-parallel. vLLM's name.
    enable_expert_parallel: bool = False
    # Pipeline stages: cut each step's rows into this many micro-batches that follow each other through the
    # stages, so a stage works on one while the next works on the previous (GPipe within a step; minillm's knob,
    # not vLLM's: vLLM keeps several steps in flight instead, its "virtual engines").
    pipeline_micro_batches: int = 1
    # One half of a prefill/decode pair (chapter 13; minillm.kv_transfer): vLLM's KVTransferConfig, as a
    # KVTransferConfig, its dict or its JSON. The engine builds the connector's scheduler side, every worker its
    # worker side.
    kv_transfer_config: Any = None
    # How the KV pool stores K and V (chapter 14; vLLM's name): "auto" (the model's dtype), "int8" (a scale per
    # token and head) or "fp8_e4m3" (one static scale); minillm.kv.quant
    kv_cache_dtype: str = "auto"
    # torch threads per step: None follows the step's size and dtype (minillm/worker/threads.py: one
    # thread for every step by default, never more than torch had at start); an integer fixes the count.
    num_threads: int | None = None
    # KV eviction (chapter 14; minillm.kv.eviction): None keeps every token (exact); a dict such as
    # {"policy": "streaming" | "h2o", "budget_tokens": 64} keeps at most that many per sequence for decode
    # attention. minillm's knob (vLLM has none); the torch attention path only.
    kv_eviction: Any = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}")
        if self.kv_eviction is not None:
            self._check_eviction()
        if self.kv_transfer_config is not None:
            from minillm.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config

            if not isinstance(self.kv_transfer_config, KVTransferConfig):
                self.kv_transfer_config = parse_kv_transfer_config(self.kv_transfer_config)
            if self.batching != "continuous" or self.kv_layout != "paged":
                raise ValueError("kv_transfer_config needs continuous batching over the paged KV cache "
                                 "(batching='continuous', kv_layout='paged', the defaults)")
            if self.speculative_config is not None:
                raise ValueError("kv_transfer_config cannot be combined with speculative_config")
        if self.speculative_config is not None:
            from minillm.spec.config import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if self.batching != "continuous":
                raise ValueError(f"speculative_config needs batching='continuous' (got {self.batching!r})")
        self._check_parallel()
        if self.attention_backend not in backend_names():
            raise ValueError(f"attention_backend={self.attention_backend!r}; choose one of {backend_names()}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching={self.batching!r}; choose one of {BATCHING_MODES}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={self.kv_layout!r}; choose one of {KV_LAYOUTS}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r}; choose one of {PREEMPTION_MODES}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}; choose one of {SCHEDULING_POLICIES}")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache={self.prefix_cache!r}; choose one of {PREFIX_CACHES}")
        if self.prefix_cache != "hash" and not self.enable_prefix_caching:
            raise ValueError(f"prefix_cache={self.prefix_cache!r} has no effect without enable_prefix_caching=True")
        if self.scheduling_policy == "lpm" and not self.enable_prefix_caching:
            raise ValueError("scheduling_policy='lpm' ranks waiting requests by their cached prefix: "
                             "it needs enable_prefix_caching=True")
        if self.preemption_mode == "swap" and self.kv_layout != "paged":
            raise ValueError("preemption_mode='swap' needs kv_layout='paged'")
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        if self.num_threads is not None:
            _require_int("num_threads", self.num_threads, 1)
        _require_int("block_size", self.block_size, 1)
        if self.num_kv_blocks is not None:
            _require_int("num_kv_blocks", self.num_kv_blocks, 1)
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or \
                not self.swap_space >= 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        if isinstance(self.kv_offloading_size, bool) or not isinstance(self.kv_offloading_size, (int, float)) or \
                not self.kv_offloading_size >= 0:
            raise ValueError(f"kv_offloading_size must be a number of GiB >= 0, got {self.kv_offloading_size!r}")
        if self.kv_offloading_size and not (self.enable_prefix_caching and self.prefix_cache == "hash"):
            raise ValueError("kv_offloading_size offloads the prefix cache: it needs enable_prefix_caching=True and "
                             f"prefix_cache='hash' (the radix tree has no offload tier), got enable_prefix_caching="
                             f"{self.enable_prefix_caching}, prefix_cache={self.prefix_cache!r}")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark!r}")
        if self.enable_prefix_caching and (self.batching != "continuous" or self.kv_layout != "paged"):
            raise ValueError("enable_prefix_caching=True needs batching='continuous' and kv_layout='paged' "
                             f"(got batching={self.batching!r}, kv_layout={self.kv_layout!r})")
        if self.max_model_len is not None:
            _require_int("max_model_len", self.max_model_len, 2)
        if self.max_num_batched_tokens is not None:
            _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be True or False, got {self.enable_chunked_prefill!r}")
        if self.enable_chunked_prefill and self.batching != "continuous":
            raise ValueError(f"enable_chunked_prefill=True needs batching='continuous' (got {self.batching!r}): "
                             "a static or dynamic batch prefills its prompts in one padded step")
        _require_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold caps prefill chunks: it needs enable_chunked_prefill=True")
        if self.chunk_policy not in CHUNK_POLICIES:
            raise ValueError(f"chunk_policy={self.chunk_policy!r}; choose one of {CHUNK_POLICIES}")
        if self.chunk_policy == "splitfuse" and not self.enable_chunked_prefill:
            raise ValueError("chunk_policy='splitfuse' sizes steps by splitting prompts across them: it needs "
                             "enable_chunked_prefill=True (without it every prompt runs whole in one step)")
        if not self.max_queue_delay_ms >= 0:
            raise ValueError(f"max_queue_delay_ms must be >= 0, got {self.max_queue_delay_ms!r}")
        if not self.static_batch_timeout_ms >= 0:
            raise ValueError(f"static_batch_timeout_ms must be >= 0, got {self.static_batch_timeout_ms!r}")
        if not isinstance(self.static_hold_finished, bool):
            raise ValueError(f"static_hold_finished must be True or False, got {self.static_hold_finished!r}")
        if self.static_hold_finished and self.batching == "continuous":
            raise ValueError("static_hold_finished=True holds results until a batch ends: it needs batching='static' "
                             "or 'dynamic' (continuous batching has no batch end)")

    def _check_eviction(self) -> None:
        from minillm.kv.eviction import KVEvictionConfig

        self.kv_eviction = KVEvictionConfig.parse(self.kv_eviction)
        if self.batching != "continuous" or self.kv_layout != "paged":
            raise ValueError("kv_eviction needs continuous batching over the paged KV cache "
                             "(batching='continuous', kv_layout='paged', the defaults)")
        if self.attention_backend not in ("auto", "torch"):
            raise ValueError(f"kv_eviction masks evicted tokens in the torch attention path; got attention_backend="
                             f"{self.attention_backend!r}: use 'torch' or 'auto'")
        others = {"speculative_config": self.speculative_config, "kv_transfer_config": self.kv_transfer_config,
                  "tensor_parallel_size > 1": self.tensor_parallel_size > 1,
                  "pipeline_parallel_size > 1": self.pipeline_parallel_size > 1}
        clash = [name for name, value in others.items() if value not in (None, False)]
        if clash:
            raise ValueError(f"kv_eviction runs in one in-process worker without speculation or KV transfer; "
                             f"it cannot be combined with {clash}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_parallel(self) -> None:
        """The parallel knobs on their own; what the model can split is checked against it
        (`minillm.distributed.layout.check_parallel_config`)."""
        _require_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _require_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r}; choose one of {EXECUTOR_BACKENDS} (or None: "
                             "'uni' for one rank, 'mp' for more)")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one process, but tensor_parallel_size × "
                             f"pipeline_parallel_size = {self.world_size}: use 'mp' (or 'external_launcher' under "
                             "torchrun)")
        if backend == "external_launcher" and self.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config makes a server one half of a prefill/decode pair; "
                             "distributed_executor_backend='external_launcher' is for offline LLM.generate under "
                             "torchrun: run the pair with 'mp' (or one process each)")
        if isinstance(self.execute_model_timeout_s, bool) or not isinstance(self.execute_model_timeout_s, (int, float)) \
                or not self.execute_model_timeout_s > 0:
            raise ValueError(f"execute_model_timeout_s must be a number of seconds > 0, got {self.execute_model_timeout_s!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError("enable_expert_parallel=True splits the experts over the tensor-parallel ranks: it needs "
                             f"tensor_parallel_size >= 2 (got {self.tensor_parallel_size})")
        _require_int("pipeline_micro_batches", self.pipeline_micro_batches, 1)
        self._check_nodes()
        if self.pipeline_micro_batches > 1 and self.pipeline_parallel_size < 2:
            raise ValueError(f"pipeline_micro_batches={self.pipeline_micro_batches} cuts steps for pipeline stages: "
                             f"it needs pipeline_parallel_size >= 2 (got {self.pipeline_parallel_size})")

    def _check_nodes(self) -> None:
        """The multi-node knobs (issue 28): the world splits evenly with TP inside a node (so it has ranks, and 'uni'
        is refused above); an engine is node 0."""
        _require_int("nnodes", self.nnodes, 1)
        _require_int("node_rank", self.node_rank, 0)
        _require_int("master_port", self.master_port, 1)
        if self.node_join_timeout_s is True or not isinstance(self.node_join_timeout_s, (int, float)) \
                or not self.node_join_timeout_s > 0:
            raise ValueError(f"node_join_timeout_s must be a number of seconds > 0, got {self.node_join_timeout_s!r}")
        if self.nnodes == 1:
            return
        from minillm.distributed.nodes import check_node_layout

        check_node_layout(self.tensor_parallel_size, self.pipeline_parallel_size, self.nnodes)
        if self.node_rank != 0:
            raise ValueError(f"node_rank={self.node_rank}: the engine runs on node 0; the other nodes run only ranks "
                             "(`minillm serve ... --node-rank N --headless`)")
        if self.executor_backend == "external_launcher":
            raise ValueError(f"nnodes={self.nnodes} is for the 'mp' backend's own nodes; under torchrun "
                             "(external_launcher) torchrun's --nnodes places the ranks: leave nnodes=1")

    @property
    def executor_backend(self) -> str:
        """"uni", "mp" or "external_launcher": the backend asked for, or the one the world size implies."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.world_size > 1 else "uni"

    def resolve(self, model_max_len: int) -> EngineConfig:
        """A copy with the defaults that depend on the model filled in, the knobs checked together."""
        self = dataclasses.replace(self)
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_max_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(2048, self.max_model_len)
        elif self.max_num_batched_tokens < self.max_model_len and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_model_len="
                f"{self.max_model_len}: a long prompt could never be scheduled without chunked prefill; "
                f"use max_num_batched_tokens >= {self.max_model_len} or enable_chunked_prefill=True")
        if self.num_kv_blocks is None:
            self.num_kv_blocks = -(-self.max_num_seqs * self.max_model_len // self.block_size)
        elif self.batching == "continuous" and self.kv_layout == "paged" and \
                self.num_kv_blocks * self.block_size < self.max_model_len:
            need = -(-self.max_model_len // self.block_size)
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks} × block_size={self.block_size} holds "
                f"{self.num_kv_blocks * self.block_size} tokens, less than one max_model_len={self.max_model_len} "
                f"request: it could never finish. Use num_kv_blocks >= {need} or a smaller max_model_len")
        return self

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)


def _require_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
