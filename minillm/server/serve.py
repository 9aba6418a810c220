"""`minillm serve`: flags with vLLM's names, then uvicorn (chapter 11).

    minillm serve                                  # the bundled model on http://127.0.0.1:8000
    minillm serve models/minillm-target --port 8001 --max-num-seqs 16 --enable-prefix-caching
    minillm serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    minillm serve --tensor-parallel-size 2 --pipeline-parallel-size 2   # 4 worker processes (chapter 12)
    minillm serve --tensor-parallel-size 2 --pipeline-parallel-size 2 --nnodes 2 --node-rank 0 --master-addr HEAD
    minillm serve --tensor-parallel-size 2 --pipeline-parallel-size 2 --nnodes 2 --node-rank 1 --master-addr HEAD \
        --headless                                 # the same world's ranks 2-3 on a second machine (docs/multinode.md)
    MINILLM_API_KEY=secret minillm serve           # or --api-key secret: /v1/* then needs the key

It binds 127.0.0.1 unless `--host` says otherwise (a toy server should not face a network by
accident). `--max-num-queued-reqs N` caps waiting + running requests; beyond it the answer is
503 with Retry-After (see `minillm.server.errors`).

Prefill/decode disaggregation (chapter 13, docs/pd.md): `--kv-transfer-config` makes this server
one half of a pair (`kv_producer`: the prefill instance, `kv_consumer`: the decode instance);
`--pd-disaggregation` starts both halves and a PD router on `--port`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Engine flags: (flag, EngineConfig name, type, help). The names are vLLM's engine arguments.
ENGINE_FLAGS = [
    ("--max-num-seqs", "max_num_seqs", int, "most requests running at once (the batch)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget per step"),
    ("--max-model-len", "max_model_len", int, "prompt + output tokens per request (default: the model's)"),
    ("--block-size", "block_size", int, "tokens per KV block"),
    ("--num-gpu-blocks-override", "num_kv_blocks", int, "KV blocks in the pool (vLLM's name; minillm's num_kv_blocks)"),
    ("--swap-space", "swap_space", float, "GiB of host memory for swapped-out KV"),
    ("--kv-offloading-size", "kv_offloading_size", float, "GiB of host memory for the prefix cache's offload tier "
     "(hash prefix cache; evicted blocks come back on a hit instead of being recomputed)"),
    ("--preemption-mode", "preemption_mode", str, "recompute or swap"),
    ("--scheduling-policy", "scheduling_policy", str, "fcfs, priority or lpm"),
    ("--long-prefill-token-threshold", "long_prefill_token_threshold", int, "cap on one request's prefill chunk"),
    ("--chunk-policy", "chunk_policy", str, "with --enable-chunked-prefill: sarathi (a fixed budget, default) or "
     "splitfuse (Dynamic SplitFuse: --max-num-batched-tokens is the target step size)"),
    ("--seed", "seed", int, "seed of requests that give none"),
    ("--batching", "batching", str, "continuous (default), dynamic or static (minillm's teaching knob)"),
    ("--kv-layout", "kv_layout", str, "paged (default) or slab"),
    ("--kv-cache-dtype", "kv_cache_dtype", str, "how the KV pool stores K/V: auto (the model's dtype), int8 (a scale "
     "per token and head) or fp8_e4m3 (vLLM's knob; minillm.kv.quant)"),
    ("--prefix-cache", "prefix_cache", str, "hash (vLLM) or radix (SGLang), with --enable-prefix-caching"),
    ("--tensor-parallel-size", "tensor_parallel_size", int, "ranks that split each layer (Megatron TP), one process each"),
    ("--pipeline-parallel-size", "pipeline_parallel_size", int, "stages that split the layers (PP), tp processes each"),
    ("--distributed-executor-backend", "distributed_executor_backend", str, "uni (one process) or mp (one per rank)"),
    # A world across nodes (issue 28, docs/multinode.md); node 0 serves, `--node-rank N --headless` only runs ranks
    ("--nnodes", "nnodes", int, "nodes the tp × pp ranks are spread over (TP inside a node, PP across)"),
    ("--node-rank", "node_rank", int, "this node's number, 0 .. nnodes-1 (0: the engine and the API server)"),
    ("--master-addr", "master_addr", str, "the head node's address, where the world's TCPStore listens"),
    ("--master-port", "master_port", int, "the TCPStore's port on the head (default 29500)"),
    ("--node-join-timeout-s", "node_join_timeout_s", float, "seconds start-up waits for every node (default 60)"),
    ("--num-threads", "num_threads", int, "torch threads per step (default: by the step's size and dtype, "
     "minillm/worker/threads.py)"),
]


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, help="HF model directory (default: the bundled target)")
    p.add_argument("--model", default=None, help="same as the positional model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) a request's `model` may give; answers and /v1/models report the first "
                        "(default: the model argument as typed, its directory's name and 'minillm'; "
                        "with no model argument 'minillm' and 'minillm-target')")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (or MINILLM_API_KEY)")
    p.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="most requests held (waiting + running); beyond it 503 + Retry-After")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    for flag, _, typ, help_text in ENGINE_FLAGS:
        p.add_argument(flag, type=typ, default=None, help=help_text)
    p.add_argument("--enable-prefix-caching", action="store_true", default=None)
    p.add_argument("--enable-chunked-prefill", action="store_true", default=None)
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="MoE: experts whole on the --tensor-parallel-size ranks (all-to-all), attention TP")
    p.add_argument("--speculative-config", default=None, help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--kv-transfer-config", default=None,
                   help='a prefill/decode pair\'s KV connector, JSON with vLLM\'s names, e.g. \'{"kv_connector": '
                        '"TorchDistConnector", "kv_role": "kv_producer", "kv_port": 14579}\' (minillm.kv_transfer)')
    p.add_argument("--pd-disaggregation", action="store_true",
                   help="start a prefill and a decode instance (processes, KV over torch.distributed) behind a "
                        "PD router on --port")
    p.add_argument("--headless", action="store_true",
                   help="with --nnodes N --node-rank R >= 1: run only this node's ranks (no engine, no API server)")
    p.add_argument("--uvicorn-log-level", default="warning")


def engine_knobs(args: argparse.Namespace) -> dict:
    knobs = {name: getattr(args, flag[2:].replace("-", "_")) for flag, name, _, _ in ENGINE_FLAGS}
    knobs["enable_prefix_caching"] = args.enable_prefix_caching
    knobs["enable_chunked_prefill"] = args.enable_chunked_prefill
    knobs["enable_expert_parallel"] = args.enable_expert_parallel
    if args.speculative_config is not None:
        try:
            knobs["speculative_config"] = json.loads(args.speculative_config)
        except json.JSONDecodeError as err:
            raise ValueError(f"--speculative-config must be JSON, e.g. "
                             f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}': {err}") from None
    return {k: v for k, v in knobs.items() if v is not None}


def served_model_names(args: argparse.Namespace) -> list[str]:
    """The names the API accepts for the model, the reported one first.

    Given `--served-model-name`, exactly those (vLLM). Otherwise vLLM's default, the model argument as
    typed, comes first, so a client may send what started the server; its directory's name (what a
    reader sees in models/) and `minillm` (the name every chapter, exercise and page uses) stay
    accepted. With no model argument nothing was typed: `minillm` comes first, as it always did, and
    the bundled model's directory name `minillm-target` is accepted too.
    """
    if args.served_model_name:
        return list(dict.fromkeys(args.served_model_name))
    model = args.model or args.model_tag
    if model is None:
        from minillm.llm import BUNDLED_TARGET

        return ["minillm", BUNDLED_TARGET.name]
    directory_name = Path(model).name or Path(model).resolve().name
    return list(dict.fromkeys([model, directory_name, "minillm"]))


# The start-up line: `minillm serve: ready in 8.41 s since launch: python + imports 3.10 s, tokenizer 0.90 s, ...`.
# bench/llamacpp.py reads it back (`parse_startup_line`) to explain its launch-to-ready row.
STARTUP_LINE_PREFIX = "minillm serve: ready"


def process_age_s() -> float | None:
    """Seconds since this process was started (Linux: its start time in /proc/self/stat, 10 ms ticks);
    None where that cannot be read. What the interpreter and the imports took before `main` ran."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name: field 3 onwards
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_s
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return age if 0 <= age < 86400 else None


def startup_line(ready_s: float | None, phases: dict[str, float]) -> str:
    since = "" if ready_s is None else f" in {ready_s:.2f} s since launch"
    return f"{STARTUP_LINE_PREFIX}{since}: " + ", ".join(f"{name} {s:.2f} s" for name, s in phases.items())


def parse_startup_line(line: str) -> tuple[float | None, dict[str, float]]:
    """`startup_line` read back: (seconds since launch, or None; {phase: seconds})."""
    if not line.startswith(STARTUP_LINE_PREFIX):
        raise ValueError(f"not a start-up line: {line!r}")
    head, _, tail = line[len(STARTUP_LINE_PREFIX):].partition(": ")
    ready = float(head.split()[1]) if head.strip() else None
    phases = {}
    for part in tail.split(", "):
        name, value, _unit = part.rsplit(" ", 2)
        phases[name] = float(value)
    return ready, phases


def build_app(args: argparse.Namespace, phases: dict[str, float] | None = None,
              on_started: Callable[[], None] | None = None):
    """The app for `args`; `phases` (if given) receives how long each start-up phase took, in seconds;
    `on_started` goes to `create_app`."""
    from minillm import LLM
    from minillm.llm import BUNDLED_TARGET, chat_prompt_ids
    from minillm.model.tokenizer import load_tokenizer
    from minillm.server.app import create_app

    phases = {} if phases is None else phases

    if args.max_num_queued_reqs is not None and args.max_num_queued_reqs < 1:
        raise ValueError(f"--max-num-queued-reqs must be >= 1, got {args.max_num_queued_reqs}")
    kv_transfer = None
    if args.kv_transfer_config is not None:
        from minillm.kv_transfer import parse_kv_transfer_config

        kv_transfer = parse_kv_transfer_config(args.kv_transfer_config)  # a bad config fails before the model loads
    model = args.model or args.model_tag
    knobs = engine_knobs(args)
    if knobs.get("distributed_executor_backend") == "external_launcher":
        raise ValueError("--distributed-executor-backend external_launcher makes every process that torchrun starts "
                         "an engine of its own, for offline LLM.generate scripts (docs/multinode.md); a server is "
                         "one engine: use mp (the default for several ranks)")
    if kv_transfer is not None:
        knobs["kv_transfer_config"] = kv_transfer
    start = time.perf_counter()
    model_dir = Path(model) if model is not None else BUNDLED_TARGET
    tokenizer = load_tokenizer(model_dir) if model_dir.is_dir() else None  # (a missing directory: LLM says so)
    phases["tokenizer"] = time.perf_counter() - start
    start = time.perf_counter()
    llm = LLM(model, tokenizer=tokenizer, dtype=args.dtype, device=args.device, **knobs)
    report = llm.engine.warm_up_report
    warm_up_s = report.seconds if report is not None else 0.0
    phases["model + engine"] = time.perf_counter() - start - warm_up_s
    phases["warm-up"] = warm_up_s
    if report is not None:
        print(f"minillm serve: {report}", flush=True)
    if llm.tokenizer is not None:
        # transformers compiles a chat template on its first use (then caches it): do it now, not in the first chat
        start = time.perf_counter()
        try:
            chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": "Hello"}])
        except Exception:  # noqa: BLE001 - a template that cannot render answers each chat with its error instead
            pass
        phases["chat template"] = time.perf_counter() - start
    api_key = args.api_key or os.environ.get("MINILLM_API_KEY") or None
    start = time.perf_counter()
    app = create_app(llm, served_model_name=served_model_names(args), api_key=api_key,
                     max_num_queued_reqs=args.max_num_queued_reqs, on_started=on_started)
    phases["API server"] = time.perf_counter() - start  # the routes; `run` adds uvicorn's start
    return app


def run_headless_node(args: argparse.Namespace) -> int:
    """`--headless` (or `--node-rank` >= 1): this node's ranks of a world whose engine runs on node 0."""
    from minillm.config import EngineConfig
    from minillm.distributed.headless import run_headless
    from minillm.distributed.nodes import NodeRendezvous
    from minillm.llm import BUNDLED_TARGET

    knobs = engine_knobs(args)
    config = EngineConfig(**{k: knobs[k] for k in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes",
                                                   "master_addr", "master_port", "node_join_timeout_s") if k in knobs})
    model_dir = Path(args.model or args.model_tag or BUNDLED_TARGET)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist on this node (every node needs the model)")
    rendezvous = NodeRendezvous(config.nnodes, config.master_addr, config.master_port, config.node_join_timeout_s)
    return run_headless(model_dir, config.tensor_parallel_size, config.pipeline_parallel_size, rendezvous,
                        knobs.get("node_rank", 0))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    if args.headless or (args.node_rank or 0) >= 1:
        if not args.headless:
            print("minillm serve: --node-rank >= 1 runs headless (this node's ranks only, no API server)", flush=True)
        if not (args.node_rank or 0) >= 1:
            raise ValueError("--headless runs a node other than the head: give --nnodes N --node-rank R with R >= 1")
        return run_headless_node(args)

    phases = {"python + imports": process_age_s() or 0.0}  # the interpreter, torch, minillm: before main() ran
    built_at = 0.0

    def on_started() -> None:  # the engine thread runs; uvicorn binds the port next
        phases["API server"] += time.perf_counter() - built_at
        print(startup_line(process_age_s(), phases), flush=True)

    app = build_app(args, phases, on_started)
    built_at = time.perf_counter()
    server = app.state.server
    aliases = f"; also answers to {', '.join(server.model_names[1:])}" if len(server.model_names) > 1 else ""
    print(f"minillm serve: http://{args.host}:{args.port}/v1 (model {server.model_name}{aliases}, "
          f"max_model_len={server.max_model_len})", flush=True)
    # uvicorn shuts down gracefully on SIGTERM and then raises the signal again under the handler it found: with
    # Python's default that kills the process before `finally` could stop the ranks (on several nodes the others'
    # ranks would see a broken world instead of "stop"). With this handler the re-raised signal exits through it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        # ws="none": the API has no websocket route, so uvicorn need not import a websocket library
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, ws="none")
    finally:
        app.state.server.llm.shutdown()  # join the worker processes, if any
    return 0
