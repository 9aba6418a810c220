"""One place that assembles an engine from a config: `build_engine` (chapter 04).

`LLM` (the real model), the simulator (a cost model instead of a model) and the graders (a
stand-in executor and a learner's scheduler) all build their engine here; only the parts they
pass differ. The KV layout and the scheduler follow the config unless given; for a model, the
executor is one worker in this process (`UniProcExecutor`). This module sits above the engine
core, the executor and the worker (it wires them), so the core imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minillm.config import EngineConfig
from minillm.engine.core import LLMEngine
from minillm.engine.parts import make_kv_manager, make_scheduler
from minillm.model.config import ModelConfig
from minillm.scheduler.base import Scheduler

__all__ = ["build_engine", "make_kv_manager", "make_scheduler"]


def build_engine(config: EngineConfig, model_config: ModelConfig, *, model: Any = None, tokenizer: Any = None,
                 scheduler_factory: Callable[[EngineConfig, Any], Scheduler] | None = None, kv: Any = None,
                 executor: Any = None, clock: Any = None, proposer: Any = None):
    """An `LLMEngine` for `config`: with `model`, the real model runs in an in-process worker; without
    it, pass `executor` (the simulator's, a stand-in). `scheduler_factory(resolved_config, kv)`
    plugs in another scheduler (an exercise's); `kv` another KV manager."""
    resolved = config.resolve(model_config.max_position_embeddings)
    if kv is None:
        if model is not None:
            kv = make_kv_manager(resolved, model_config, model.dtype, str(model.device))
        else:
            kv = make_kv_manager(resolved, model_config, allocate_pool=False)
    scheduler = (scheduler_factory or make_scheduler)(resolved, kv)
    report = None
    if executor is None and model is not None:  # the real model, in a worker in this process
        from minillm.executor.uniproc import UniProcExecutor
        from minillm.kv_transfer import make_worker_connector
        from minillm.worker.model_runner import ModelRunner
        from minillm.worker.warm_up import warm_up

        transfer = resolved.kv_transfer_config
        backend = "torch" if resolved.kv_eviction is not None else resolved.attention_backend  # (the evicting path)
        worker = ModelRunner(model, kv.cache_spec, backend, None if transfer is None else make_worker_connector(transfer),
                             resolved.num_threads, kv_eviction=resolved.kv_eviction)
        executor = UniProcExecutor(worker, kv)
        report = warm_up(worker, resolved.max_num_seqs)  # compile and warm now, not in the first generate
    engine = LLMEngine(model_config, config, model=model, tokenizer=tokenizer, kv=kv, scheduler=scheduler,
                       executor=executor, clock=clock, proposer=proposer)
    if report is not None:
        engine.warm_up_report = report
    return engine
