"""An engine whose model runs on tp × pp worker processes (chapter 12): what `LLM(...,
tensor_parallel_size=..., pipeline_parallel_size=...)` builds.

The driver reads only the model's config.json: it checks that the model splits over the world
(`check_parallel_config`, naming the number that does not), keeps the scheduler and a KV manager that
accounts but allocates nothing (the pools live on the ranks, each with its heads and layers), and
hands steps to a `MultiprocExecutor`. Everything else — tokenizer, scheduler, prefix cache,
preemption, chunked prefill — is the one-process engine's, unchanged: the plan is the same data.

Why this module imports `minillm.executor.multiproc`, a layer above `minillm.distributed`: it is
not a part of the distributed machinery but the driver-side assembly of an engine over it — the
`build_engine` of several processes — and assembling one means constructing its executor. The
import is made inside `build_distributed_engine`, so importing `minillm.distributed` (as the ranks
and chapter 12 do) never loads the executor; nothing below imports this module (only `minillm.llm`
does). Its proper home is beside `build_engine` in `minillm/engine/build.py`, where the edge would
point downward; that move belongs to whoever owns `minillm/engine/`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from minillm.config import EngineConfig
from minillm.distributed.layout import check_parallel_config
from minillm.engine.build import build_engine
from minillm.engine.parts import make_kv_manager
from minillm.model.config import ModelConfig
from minillm.model.loader import read_hf_config
from minillm.model.tokenizer import generation_eos_ids


def read_model_config(model_dir: Path) -> ModelConfig:
    """The model's config.json (with generation_config.json's EOS ids), all the driver reads of the model."""
    model_config = ModelConfig.from_hf_dict(read_hf_config(model_dir))
    eos = generation_eos_ids(model_dir)
    if eos:
        model_config = dataclasses.replace(
            model_config, eos_token_ids=tuple(dict.fromkeys(model_config.eos_token_ids + eos)))
    return model_config


def plan_ranks(config: EngineConfig, model_dir: Path, model_config: ModelConfig, dtype: torch.dtype,
               device: str) -> tuple[Any, dict]:
    """What every layout of ranks needs: the world checked against the model (naming the number that does
    not split), the driver's KV manager (accounting only) and the `WorkerSpec` fields but tp, pp,
    init_file and timeout_s."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    check_parallel_config(model_config, tp, pp)
    if config.enable_expert_parallel or model_config.is_moe:
        from minillm.distributed.moe import check_expert_parallel

        if config.enable_expert_parallel:
            check_expert_parallel(model_config, tp)
        elif model_config.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the experts' intermediate_size="
                             f"{model_config.intermediate_size} (or use enable_expert_parallel=True)")
    resolved = config.resolve(model_config.max_position_embeddings)
    kv = make_kv_manager(resolved, model_config, dtype, "cpu", allocate_pool=False)
    spec = dict(model_dir=str(model_dir), model_config=model_config, dtype=dtype, device=device,
                max_positions=config.max_model_len or model_config.max_position_embeddings,
                cache_spec=kv.cache_spec, attention_backend=resolved.attention_backend,
                micro_batches=resolved.pipeline_micro_batches, expert_parallel=resolved.enable_expert_parallel,
                kv_transfer_config=resolved.kv_transfer_config, max_num_seqs=resolved.max_num_seqs)
    return kv, spec


def build_distributed_engine(config: EngineConfig, model_dir: Path, model_config: ModelConfig, dtype: torch.dtype,
                             device: str, tokenizer: Any, scheduler_factory=None, proposer=None):
    """`proposer`: a draft model's proposer (speculative decoding), run in the driver like the scheduler."""
    from minillm.executor.multiproc import MultiprocExecutor

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    local_ranks = tp * pp // config.nnodes  # a world across nodes: this node runs its share (minillm.distributed.nodes)
    if device.startswith("cuda") and torch.cuda.device_count() < local_ranks:
        raise ValueError(f"{local_ranks} ranks on this node (tensor_parallel_size × pipeline_parallel_size = {tp * pp} "
                         f"over nnodes={config.nnodes}), but this machine has {torch.cuda.device_count()} CUDA device(s)")
    kv, spec = plan_ranks(config, model_dir, model_config, dtype, device)
    rendezvous = None
    if config.nnodes > 1:
        from minillm.distributed.nodes import NodeRendezvous

        rendezvous = NodeRendezvous(config.nnodes, config.master_addr, config.master_port, config.node_join_timeout_s)
    executor = MultiprocExecutor(kv, spec, tp, pp, config.execute_model_timeout_s, rendezvous)
    try:
        return build_engine(config, model_config, tokenizer=tokenizer, kv=kv, executor=executor,
                            scheduler_factory=scheduler_factory, proposer=proposer)
    except BaseException:
        executor.shutdown()
        raise


def build_external_launcher_engine(config: EngineConfig, model_dir: Path, model_config: ModelConfig,
                                   dtype: torch.dtype, device: str, tokenizer: Any, scheduler_factory=None,
                                   proposer=None):
    """This process's engine in a world torchrun started (`distributed_executor_backend="external_launcher"`):
    its own scheduler over the same plans as every other rank's, and one worker, its rank's shard
    (minillm.executor.external_launcher)."""
    from minillm.distributed.worker import WorkerSpec
    from minillm.executor.external_launcher import ExternalLauncherExecutor

    kv, spec = plan_ranks(config, model_dir, model_config, dtype, device)
    executor = ExternalLauncherExecutor(kv, WorkerSpec(tp=config.tensor_parallel_size,
                                                       pp=config.pipeline_parallel_size, init_file="",
                                                       timeout_s=config.execute_model_timeout_s, **spec))
    try:
        engine = build_engine(config, model_config, tokenizer=tokenizer, kv=kv, executor=executor,
                              scheduler_factory=scheduler_factory, proposer=proposer)
    except BaseException:
        executor.shutdown()
        raise
    engine.warm_up_report = executor.warm_up_report
    return engine
