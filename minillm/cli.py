"""`minillm` on the command line: generate text, serve the OpenAI API, or simulate a trace.

    minillm generate "Once upon a time" --max-tokens 32
    minillm generate "What is a KV cache?" --chat --temperature 0.8 --seed 1
    torchrun --nproc-per-node 2 -m minillm generate "Once upon a time" --tensor-parallel-size 2 \
        --distributed-executor-backend external_launcher     # every rank prints the same text
    minillm serve --port 8000 --max-num-seqs 16          # also: python -m minillm serve
    minillm serve --data-parallel-size 2 --port 8000     # 2 engine processes behind a router
    minillm serve --pd-disaggregation --port 8000        # a prefill and a decode instance behind a PD router
    minillm router --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002 --policy cache_aware
    minillm simulate --hardware A100-80GB --model llama-7b --batching continuous --num-requests 200
"""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from minillm import LLM, SamplingParams

    knobs = {"max_num_seqs": 1} if args.max_model_len is None else {"max_num_seqs": 1, "max_model_len": args.max_model_len}
    knobs.update(tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                 distributed_executor_backend=args.distributed_executor_backend)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, **knobs)
    prompt = args.prompt
    if args.chat:
        if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
            raise ValueError(f"--chat needs a tokenizer with a chat template; {args.model or 'the bundled model'} has none")
        prompt = {"prompt_token_ids": llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or None)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    if args.show_ids:
        print(f"prompt ids: {out.prompt_token_ids}")
        print(f"output ids: {completion.token_ids}")
    print(completion.text if args.chat else (args.prompt + completion.text))
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from minillm.sim import simulate
    from minillm.traces.synthetic import make_trace

    trace = make_trace(args.num_requests, seed=args.seed, vocab_size=32000, rate_per_s=args.rate,
                       burstiness=args.burstiness, max_prompt_len=2048, max_output_len=2048)
    result = simulate(trace, hardware=args.hardware, model=args.model,
                      engine_config={"batching": args.batching, "max_num_seqs": args.max_num_seqs})
    print(f"{args.model} on {args.hardware}, {args.batching} batching, max_num_seqs={args.max_num_seqs}, "
          f"{args.num_requests} ShareGPT-like requests at {args.rate} req/s (simulated clock)")
    print(result.summary.table())
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.pd_disaggregation:
        from minillm.router.pd_launch import run_pd_disaggregation

        return run_pd_disaggregation(args)
    if args.data_parallel_size != 1:
        if args.kv_transfer_config is not None:
            raise ValueError("--kv-transfer-config makes one server half of a prefill/decode pair; it cannot be "
                             "combined with --data-parallel-size (use --pd-disaggregation for the pair)")
        from minillm.router.launch import run_data_parallel

        return run_data_parallel(args, replica_argv(args.argv))
    from minillm.server.serve import run

    return run(args)


def replica_argv(argv: list[str]) -> list[str]:
    """The `serve` flags one replica gets: the command line after `serve`, less the router's and
    data-parallel flags and --host/--port (each replica gets its own loopback port)."""
    from minillm.router.launch import add_policy_arguments

    tokens = argv[argv.index("serve") + 1:]
    strip = argparse.ArgumentParser(add_help=False)
    strip.add_argument("--data-parallel-size", type=int)
    strip.add_argument("--host")
    strip.add_argument("--port")
    add_policy_arguments(strip)
    return strip.parse_known_args(tokens)[1]


def _router(args: argparse.Namespace) -> int:
    from minillm.router.launch import run_router

    return run_router(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minillm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF model directory (default: the bundled target)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--device", default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--show-ids", action="store_true", help="also print prompt and output token ids")
    gen.add_argument("--tensor-parallel-size", type=int, default=1)
    gen.add_argument("--pipeline-parallel-size", type=int, default=1)
    gen.add_argument("--distributed-executor-backend", default=None,
                     help="uni, mp (one process per rank, the default for several) or external_launcher (under "
                          "torchrun: every process one rank, each prints the same text; docs/multinode.md)")
    gen.set_defaults(func=_generate)

    from minillm.server.serve import __doc__ as serve_doc
    from minillm.server.serve import add_serve_arguments

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (FastAPI + uvicorn)",
                           description=serve_doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(serve)
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine replicas, each its own process, behind a router on --port (the flags below)")
    from minillm.router.launch import __doc__ as router_doc
    from minillm.router.launch import add_policy_arguments, add_router_arguments

    add_policy_arguments(serve.add_argument_group("router (with --data-parallel-size > 1)"))
    serve.set_defaults(func=_serve)

    router = sub.add_parser("router", help="an OpenAI-compatible router in front of running servers",
                            description=router_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_router_arguments(router)
    router.set_defaults(func=_router)

    sim = sub.add_parser("simulate", help="run a seeded trace through the scheduler on a simulated GPU")
    sim.add_argument("--hardware", default="A100-80GB")
    sim.add_argument("--model", default="llama-7b")
    sim.add_argument("--batching", default="continuous", choices=["static", "dynamic", "continuous"])
    sim.add_argument("--max-num-seqs", type=int, default=64)
    sim.add_argument("--num-requests", type=int, default=200)
    sim.add_argument("--rate", type=float, default=float("inf"), help="requests per second (default: all at once)")
    sim.add_argument("--burstiness", type=float, default=1.0)
    sim.add_argument("--seed", type=int, default=0)
    sim.set_defaults(func=_simulate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from minillm.benchmark import serve as bench_serve

    bench_serve_parser = bench.add_parser("serve", help="load-test an OpenAI-compatible server (as vllm bench serve)")
    bench_serve.add_arguments(bench_serve_parser)
    bench_serve_parser.set_defaults(func=bench_serve.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"minillm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
