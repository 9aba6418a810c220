"""`LLM`: the offline entry point, shaped like vLLM's (chapter 00 onwards).

    from minillm import LLM, SamplingParams
    llm = LLM()                                   # the bundled model, on CPU
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=16, temperature=0.0))
    outs[0].outputs[0].text

Engine knobs are keyword arguments with vLLM's names (`max_num_seqs`, `batching`, …).

`generate` runs on the same engine core as the server (`minillm.engine`), on the caller's thread:
it adds every request, then steps until all have finished. `n > 1` fans a prompt out into n
requests (vLLM's parallel sampling) and gathers them back into one `RequestOutput`. `chat` renders
messages with the tokenizer's chat template (the bundled tokenizer has one; a tokenizer without
one gets `DEFAULT_CHAT_TEMPLATE`). `get_metrics()` reads vLLM-named Prometheus metrics back.

Stats, as vLLM's `LLM` does: off by default (`disable_log_stats=True`), because an offline run has
nobody scraping them and feeding them costs every step (23 Python calls of a batch-1 decode step's
135, issue 29). `LLM(disable_log_stats=False)` feeds them from the start, and the server turns them
on for itself (`attach_prometheus`, called by `minillm.server.app.create_app`): its `/metrics` always
counts. The engine's own records (`llm.engine.metrics`: per-request times, step records) are kept
either way — the chapters and the benchmarks read those.

Why this module imports from the server package (`minillm.server.metrics`): vLLM's offline `LLM`
and its server report the same Prometheus series, so there is one collector, `PrometheusMetrics`,
fed by the engine's observers; it lives with the server because `/metrics` is where it is served
and taught (chapter 11). `minillm.server.metrics` needs neither FastAPI nor uvicorn and imports
nothing above the engine; the server app in turn imports `chat_prompt_ids` from here: the two
packages use each other, the modules form no circle (tests/test_import_cycles.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minillm.config import EngineConfig
from minillm.engine import build_engine
from minillm.model.config import ModelConfig
from minillm.model.loader import load_hf_model, load_model_dir
from minillm.model.tokenizer import generation_eos_ids, load_tokenizer
from minillm.request import CompletionOutput, Request, RequestOutput, SamplingParams
from minillm.server.metrics import PrometheusMetrics

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_TARGET = REPO_ROOT / "models" / "minillm-target"
BUNDLED_DRAFT = REPO_ROOT / "models" / "minillm-draft"

# For a tokenizer that ships no chat template: the bundled tokenizer's own format, written with
# the tokenizer's bos/eos strings — "<s>", then per message "<|role|>\n{content}</s>\n", then
# "<|assistant|>\n" when a reply is wanted.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)


def chat_prompt_ids(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
    """Token ids of `messages` ([{"role": ..., "content": ...}]) rendered by the chat template."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model has none")
    template = chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
    # The template renders text (its bos token included); the post-processor must not add another.
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class LLM:
    def __init__(self, model: str | Path | Any | None = None, *, tokenizer: Any | None = None,
                 dtype: str | torch.dtype = "float32", device: str | None = None,
                 scheduler_factory: Callable[[EngineConfig, Any], Any] | None = None,
                 disable_log_stats: bool = True, **engine_knobs: Any) -> None:
        """`model`: an HF directory, an in-memory transformers model, or None for the bundled target.

        `scheduler_factory(config, kv_manager)` plugs in your own scheduler (the exercises do).
        `disable_log_stats=False` feeds the Prometheus series that `get_metrics()` reads (vLLM's knob and default).
        """
        self.prometheus: PrometheusMetrics | None = None
        config = EngineConfig.from_kwargs(engine_knobs)
        torch_dtype = resolve_dtype(dtype)
        device = device or default_device()
        if device == "cpu" and torch_dtype is torch.float16:
            raise ValueError("dtype=float16 matmuls run at ~1-3 GFLOP/s on this CPU; use float32 or bfloat16 on CPU")
        backend = config.executor_backend
        if backend in ("mp", "external_launcher"):  # the weights live in the ranks (chapter 12)
            if model is not None and not isinstance(model, (str, Path)):
                raise ValueError(f"distributed_executor_backend={backend!r} loads each rank's shard from a model "
                                 "directory: pass a path, not an in-memory model")
            from minillm.distributed.launch_engine import (
                build_distributed_engine,
                build_external_launcher_engine,
                read_model_config,
            )

            model_dir = Path(model) if model is not None else BUNDLED_TARGET
            if not model_dir.is_dir():
                raise FileNotFoundError(f"model directory {model_dir} does not exist")
            self.model = None
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
            self._model_config = read_model_config(model_dir)
            proposer = self._draft_proposer(config, torch_dtype, device)  # the draft runs in this process
            build = build_distributed_engine if backend == "mp" else build_external_launcher_engine
            self.engine = build(config, model_dir, self._model_config, torch_dtype, device, self.tokenizer,
                                scheduler_factory, proposer)
            if not disable_log_stats:
                self.attach_prometheus()
            return
        if model is None or isinstance(model, (str, Path)):
            model_dir = Path(model) if model is not None else BUNDLED_TARGET
            if not model_dir.is_dir():
                raise FileNotFoundError(f"model directory {model_dir} does not exist")
            self.model = load_model_dir(model_dir, torch_dtype, device, config.max_model_len)
            eos = generation_eos_ids(model_dir)
            if eos:
                self.model.config = dataclasses.replace(
                    self.model.config, eos_token_ids=tuple(dict.fromkeys(self.model.config.eos_token_ids + eos)))
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        else:
            self.model = load_hf_model(model, torch_dtype, device, config.max_model_len)
            self.tokenizer = tokenizer
        self._model_config = self.model.config
        proposer = self._draft_proposer(config, torch_dtype, device)
        self.engine = build_engine(config, self.model.config, model=self.model, tokenizer=self.tokenizer,
                                   scheduler_factory=scheduler_factory, proposer=proposer)
        if not disable_log_stats:
            self.attach_prometheus()

    def attach_prometheus(self) -> PrometheusMetrics:
        """The Prometheus series (vLLM's names), fed by the engine's observers from now on: made on
        the first call, the same object after. The server calls it before its engine thread starts."""
        if self.prometheus is None:
            self.prometheus = PrometheusMetrics(self.engine, "minillm")
        return self.prometheus

    def get_metrics(self) -> list:
        """vLLM's `LLM.get_metrics()`: every series as Counter / Gauge / Histogram / Vector objects
        with vLLM's names (`vllm:prompt_tokens`, `vllm:time_to_first_token_seconds`, …)."""
        if self.prometheus is None:
            raise ValueError("get_metrics() reads the Prometheus series, which this LLM does not feed: build it "
                             "with LLM(..., disable_log_stats=False) (off by default, as in vLLM's LLM)")
        return self.prometheus.snapshot()

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list | None = None,
             *, chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role", "content"}, …]) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": chat_prompt_ids(self.tokenizer, c, add_generation_prompt, chat_template)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _draft_proposer(self, config: EngineConfig, dtype: torch.dtype, device: str):
        """The draft model of `speculative_config={"method": "draft_model", ...}`, with its own KV cache:
        run by one compiled loop where the draft qualifies (minillm.spec.draft_compiled), else by the
        engine's own worker (minillm.spec.draft)."""
        spec = config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        from minillm.attention.select import numba_installed
        from minillm.spec.draft import DraftModelProposer

        draft_dir = Path(spec.model) if spec.model is not None else BUNDLED_DRAFT
        if not draft_dir.is_dir():
            raise FileNotFoundError(f"speculative_config model directory {draft_dir} does not exist")
        resolved = config.resolve(self._model_config.max_position_embeddings)
        draft = load_model_dir(draft_dir, dtype, device, resolved.max_model_len)
        if draft.config.vocab_size != self._model_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                             f"target's ({self._model_config.vocab_size}): they must share a tokenizer")
        if numba_installed():
            from minillm.spec.draft_compiled import CompiledDraftProposer
            from minillm.spec.draft_kernel import supports

            if supports(draft):
                return CompiledDraftProposer(draft, spec.num_speculative_tokens, resolved.max_model_len)
        return DraftModelProposer(draft, spec.num_speculative_tokens, resolved.num_kv_blocks, resolved.block_size,
                                  resolved.max_model_len)

    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if it has any (distributed_executor_backend='mp');
        garbage collection and interpreter exit do it too."""
        self.engine.shutdown()

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 arrival_times: list[float] | None = None, priority: list[int] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        `arrival_times` (seconds from now) replays a trace: each request is only visible to the
        scheduler once its time has come. `priority` (lower runs first) matters under
        `scheduling_policy="priority"`.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params_list = sampling_params
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        if arrival_times is not None and len(arrival_times) != len(prompts):
            raise ValueError(f"got {len(arrival_times)} arrival times for {len(prompts)} prompts")

        engine = self.engine
        start = engine.clock.now()
        requests: list[Request] = []
        groups: list[list[Request]] = []  # per prompt, its n samples
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                arrival = None if arrival_times is None else start + arrival_times[i]
                group = []
                for child in ([params] if params.n == 1 else [params.for_child(j) for j in range(params.n)]):
                    req = engine.add_request(prompt, child, arrival_time=arrival,
                                             priority=0 if priority is None else priority[i])
                    group.append(req)
                    requests.append(req)
                groups.append(group)
            self._run(len(requests), use_tqdm)
        except BaseException:
            # A bad prompt, a failing step, Ctrl-C: leave the engine as it was, nothing half-done.
            for req in requests:
                engine.abort_request(req.request_id)
            raise
        outs = []
        for group in groups:
            out = to_request_output(group[0], engine.metrics.requests.get(group[0].request_id))
            out.outputs = [to_completion(req, j) for j, req in enumerate(group)]
            outs.append(out)
        return outs

    def _run(self, total: int, use_tqdm: bool) -> None:
        engine = self.engine
        engine.expect_more_requests = False
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="generate", unit="req", leave=False)
        try:
            def progress(updates) -> None:  # (the bar is touched only when a request finished: most steps, none did;
                for update in updates:       # a plain loop and an attribute, no call per step for the others)
                    if update.finish_status is not None:
                        bar.update(1)
            if not engine.run_until_done(None if bar is None else progress):
                raise RuntimeError(self._stuck_message())
        finally:
            engine.expect_more_requests = True
            if bar is not None:
                bar.close()

    def _stuck_message(self) -> str:
        engine = self.engine
        stuck = list(engine.requests.values())
        usage = engine.kv.usage()
        return (f"no request can make progress: {len(stuck)} unfinished (e.g. {stuck[0]!r}), "
                f"{engine.scheduler.num_running} running, {engine.scheduler.num_waiting} waiting, KV "
                f"{usage.reserved_tokens}/{usage.total_tokens} slots reserved, no arrival or timer to wait for; "
                f"check max_num_seqs, num_kv_blocks and max_num_batched_tokens={engine.config.max_num_batched_tokens}")


def to_completion(req: Request, index: int = 0) -> CompletionOutput:
    return CompletionOutput(index, req.output_text or "", list(req.output_token_ids), req.finish_reason,
                            req.cumulative_logprob, req.output_logprobs, req.stop_reason)


def to_request_output(req: Request, metrics: Any = None) -> RequestOutput:
    return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [to_completion(req)],
                         req.status.finished, metrics)
