"""The batching ladder against named peers: one heavy-tailed trace, five ways to serve it.

    python bench/ladder.py [--model DIR] [--num-requests 200] [--rate inf] [--quick] [--profile]

One seeded trace (log-normal prompt and output lengths, a long right tail; all requests at t=0
unless `--rate` is given) is served, one system after another in the same process, by

1. HF static         — transformers `generate` on static batches of B requests in trace order, each
                       left-padded to its longest prompt and run for its longest `max_tokens`;
2. transformers CB   — transformers' own continuous batching (`ContinuousBatchingManager`) with an
                       explicit small config: max_requests_per_batch=B, max_batch_tokens=256,
                       page_size=16, a KV pool sized for B requests of the longest length;
3. minillm static, 4. minillm dynamic, 5. minillm continuous — `LLM(batching=..., max_num_seqs=B)`.

Same model (fp32), same max batch B (default 16), same torch thread count. Every request
generates exactly its `max_tokens` tokens (EOS ignored), greedily. Latencies are computed by
`minillm.metrics` for every system, so the definitions are identical: TTFT from the trace arrival
time, TPOT excluding the first token (vLLM's), a request finishing at its own last token. For
HF static the per-token times come from a streamer (one timestamp per decoding step, shared by
the batch); a request's tokens are its first `max_tokens` steps, the rest of its row is padding
work. For transformers CB they are its own per-token timestamps (`record_timestamps=True`).

The table gives output tok/s, mean and P99 TTFT and TPOT, each also as a ratio to HF static.
Aims: minillm continuous ≥ 4× HF static and ≥ 2× transformers CB in output tok/s.
`--profile` re-runs minillm continuous under cProfile and prints where its step time goes.

Torch runs with `--threads` (default 1) intra-op threads: on a shared 2-core machine a second
OpenMP thread that loses its core makes each small matmul ~100× slower, which would measure
the neighbours rather than the engines.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

from minillm.llm import BUNDLED_TARGET, LLM  # noqa: E402
from minillm.metrics import MetricsCollector, RequestMetrics, Summary, summarize  # noqa: E402
from minillm.model.loader import read_hf_config  # noqa: E402
from minillm.request import SamplingParams  # noqa: E402
from minillm.workload import LengthDist, Trace, make_trace  # noqa: E402

NUM_SPECIAL_TOKENS = 6  # the bundled tokenizers reserve ids 0..5; prompts avoid them
CB_PAGE_SIZE = 16
BASELINE = "HF static"


@dataclass
class Run:
    """One system's pass over the trace: per-request metrics and tokens, in trace order."""

    name: str
    metrics: list[RequestMetrics]
    tokens: list[list[int]]
    steps: list = field(default_factory=list)  # minillm's StepRecords (padding waste, step count)
    wall_s: float = 0.0

    def summary(self) -> Summary:
        return summarize(self.metrics, self.steps)


# --------------------------------------------------------------------------- the trace


def bench_trace(args: argparse.Namespace, vocab_size: int) -> Trace:
    """Heavy-tailed prompt and output lengths: most requests short, a few ~10× the median."""
    return make_trace(
        args.num_requests, seed=args.seed, vocab_size=vocab_size, rate_per_s=args.rate,
        prompt_len=LengthDist.lognormal(args.prompt_mean, 1.0), output_len=LengthDist.lognormal(args.output_mean, 1.0),
        min_prompt_len=4, max_prompt_len=args.max_len // 2, min_output_len=2, max_output_len=args.max_len // 2,
        token_id_range=(NUM_SPECIAL_TOKENS, vocab_size))


def describe_trace(trace: Trace) -> str:
    def spread(values: list[int]) -> str:
        v = sorted(values)
        return f"median {v[len(v) // 2]}, mean {sum(v) / len(v):.0f}, p99 {v[int(0.99 * (len(v) - 1))]}, max {v[-1]}"

    rate = trace.meta["rate_per_s"]
    arrivals = "all at t=0 (offline)" if math.isinf(rate) else f"Poisson at {rate:g} req/s"
    return (f"{len(trace)} requests, seed {trace.meta['seed']}, {arrivals}\n"
            f"  prompt tokens: {spread([r.prompt_len for r in trace])}\n"
            f"  output tokens: {spread([r.max_tokens for r in trace])}; total {trace.total_output_tokens}")


def wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# --------------------------------------------------------------------------- HF transformers


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    # Greedy, and never stop at EOS: `generate` fills unset fields from the model's own generation
    # config, so EOS must be cleared there rather than only passed as None.
    pad = model.generation_config.pad_token_id
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None,
                                               pad_token_id=pad if pad is not None else 0)
    return model.eval()


class StepClock:
    """A `generate` streamer that timestamps each decoding step (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def hf_generate_batch(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[torch.Tensor, list[float]]:
    """Left-padded batch through `generate`: (generated ids [B, max_new_tokens], step times)."""
    width = max(len(p) for p in prompts)
    pad = model.generation_config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, streamer=clock)
    generated = out[:, width:]
    if generated.shape[1] != max_new_tokens or len(clock.times) != max_new_tokens:
        raise RuntimeError(f"generate stopped early: {generated.shape[1]} of {max_new_tokens} tokens")
    return generated, clock.times


def run_hf_static(model_dir: Path, trace: Trace, batch_size: int) -> Run:
    """Batches of `batch_size` in arrival order; a batch starts when its last member has arrived
    and the previous batch is done (minillm's static scheduler fires the same way)."""
    model = load_hf(model_dir)
    hf_generate_batch(model, [[7, 8, 9]] * 2, 4)  # warm-up
    metrics, tokens = [], []
    t0 = time.perf_counter()
    for start in range(0, len(trace), batch_size):
        batch = trace.requests[start : start + batch_size]
        wait_until(t0 + batch[-1].arrival_time_s)
        generated, times = hf_generate_batch(model, [r.prompt_token_ids for r in batch],
                                             max(r.max_tokens for r in batch))
        for row, req in enumerate(batch):
            n = req.max_tokens
            token_times = times[:n]
            metrics.append(RequestMetrics(req.request_id, t0 + req.arrival_time_s, req.prompt_len,
                                          first_token_time=token_times[0], token_times=token_times,
                                          finished_time=token_times[-1]))
            tokens.append(generated[row, :n].tolist())
    return Run(BASELINE, metrics, tokens, wall_s=time.perf_counter() - t0)


def run_transformers_cb(model_dir: Path, trace: Trace, batch_size: int, max_batch_tokens: int) -> Run:
    """transformers' ContinuousBatchingManager, fed at the trace's arrival times."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf(model_dir)
    longest = max(r.prompt_len + r.max_tokens for r in trace)
    num_blocks = batch_size * (math.ceil(longest / CB_PAGE_SIZE) + 1)  # B requests of the longest length
    config = ContinuousBatchingConfig(page_size=CB_PAGE_SIZE, num_blocks=num_blocks,
                                      max_batch_tokens=max_batch_tokens, max_requests_per_batch=batch_size)
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.max_tokens for r in trace))
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.start()
    try:
        cb_collect(manager, [("warm-up", 0.0, [7, 8, 9], 4)], time.perf_counter())
        t0 = time.perf_counter()
        outputs = cb_collect(manager, [(r.request_id, r.arrival_time_s, r.prompt_token_ids, r.max_tokens)
                                       for r in trace], t0)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    metrics, tokens = [], []
    for req in trace:
        out = outputs[req.request_id]
        if out.error is not None or len(out.generated_tokens) != req.max_tokens:
            raise RuntimeError(f"transformers CB: {req.request_id} gave {len(out.generated_tokens)} of "
                               f"{req.max_tokens} tokens (error {out.error!r})")
        times = list(out.timestamps)
        metrics.append(RequestMetrics(req.request_id, t0 + req.arrival_time_s, req.prompt_len,
                                      first_scheduled_time=out.lifespan[0], first_token_time=times[0],
                                      token_times=times, finished_time=times[-1]))
        tokens.append(list(out.generated_tokens))
    return Run("transformers CB", metrics, tokens, wall_s=wall)


def cb_collect(manager, requests: list[tuple[str, float, list[int], int]], t0: float) -> dict:
    """Add each request at t0 + its arrival offset, then wait for every result. Token timestamps
    are taken by the manager's own thread, so collecting late costs nothing."""
    for rid, arrival_s, prompt, max_tokens in requests:
        wait_until(t0 + arrival_s)
        manager.add_request(prompt, request_id=rid, max_new_tokens=max_tokens, record_timestamps=True,
                            eos_token_id=-1)
    results = {}
    while len(results) < len(requests):
        out = manager.get_result(timeout=60)
        if out is None:
            raise RuntimeError(f"transformers CB: no result within 60 s ({len(results)} of {len(requests)} done)")
        if out.is_finished():
            results[out.request_id] = out
    return results


# --------------------------------------------------------------------------- minillm


def make_llm(model_dir: Path, batching: str, batch_size: int) -> LLM:
    llm = LLM(model_dir, batching=batching, max_num_seqs=batch_size)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[7, 8, 9], [10, 11]], warm, use_tqdm=False)
    llm.engine.metrics = MetricsCollector()  # forget the warm-up
    return llm


def run_minillm(llm: LLM, batching: str, trace: Trace) -> Run:
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params,
                        arrival_times=[r.arrival_time_s for r in trace], use_tqdm=False)
    wall = time.perf_counter() - t0
    return Run(f"minillm {batching}", [o.metrics for o in outs], [o.outputs[0].token_ids for o in outs],
               steps=list(llm.engine.metrics.steps), wall_s=wall)


def profile_minillm(model_dir: Path, trace: Trace, batch_size: int, top: int = 25) -> str:
    """cProfile of minillm continuous on the trace: the functions its step time goes to."""
    llm = make_llm(model_dir, "continuous", batch_size)
    profiler = cProfile.Profile()
    profiler.enable()
    run = run_minillm(llm, "continuous", trace)
    profiler.disable()
    steps = run.steps
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    mean_ms = 1e3 * sum(s.duration_s for s in steps) / len(steps)
    return (f"minillm continuous under cProfile: {len(steps)} steps, mean step {mean_ms:.2f} ms "
            f"(profiler overhead included)\n{text.getvalue()}")


# --------------------------------------------------------------------------- report

_COLUMNS = [  # (header, getter); ratios are value ÷ HF static's (latency: lower is better)
    ("output tok/s", lambda s: s.output_throughput),
    ("mean TTFT ms", lambda s: s.ttft.mean_ms),
    ("P99 TTFT ms", lambda s: s.ttft.percentiles_ms[99]),
    ("mean TPOT ms", lambda s: s.tpot.mean_ms),
    ("P99 TPOT ms", lambda s: s.tpot.percentiles_ms[99]),
]


def table(summaries: dict[str, Summary]) -> str:
    base = summaries[BASELINE]
    width = 20
    lines = [f"{'system':<20}" + "".join(f"{h:>{width}}" for h, _ in _COLUMNS) + f"{'steps':>8}{'pad %':>7}"]
    for name, s in summaries.items():
        cells = [f"{get(s):.1f} ({get(s) / get(base):.2f}x)" for _, get in _COLUMNS]
        steps = f"{s.num_steps}" if s.num_steps else "-"
        pad = f"{100 * s.padding_waste:.0f}" if s.num_steps else "-"
        lines.append(f"{name:<20}" + "".join(f"{c:>{width}}" for c in cells) + f"{steps:>8}{pad:>7}")
    return "\n".join(lines)


def greedy_agreement(runs: dict[str, Run], name: str, n: int) -> str:
    """How many of the first n requests got exactly HF static's greedy tokens (a sanity check:
    fp32 near-ties and left-padding numerics can flip a token and everything after it)."""
    ours, ref = runs[name].tokens[:n], runs[BASELINE].tokens[:n]
    same = sum(a == b for a, b in zip(ours, ref))
    return f"greedy tokens, first {len(ref)} requests: {name} == {BASELINE} for {same} of {len(ref)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BUNDLED_TARGET, help="HF model directory (default: bundled)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=math.inf, help="requests/s, Poisson (default inf: offline)")
    parser.add_argument("--batch-size", type=int, default=16, help="max batch B for every system")
    parser.add_argument("--prompt-mean", type=float, default=64, help="mean prompt length (log-normal, sigma 1)")
    parser.add_argument("--output-mean", type=float, default=64, help="mean output length (log-normal, sigma 1)")
    parser.add_argument("--max-len", type=int, default=1024, help="prompt and output are each clipped to half")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=256, help="transformers CB token budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (all systems)")
    parser.add_argument("--check", type=int, default=8, help="requests whose greedy tokens are compared")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 requests")
    parser.add_argument("--profile", action="store_true", help="also profile minillm continuous")
    args = parser.parse_args()
    if args.quick:
        args.num_requests = min(args.num_requests, 40)
    if not (args.model / "config.json").is_file():
        sys.exit(f"no model at {args.model} (pass --model DIR)")

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab_size = read_hf_config(args.model)["vocab_size"]
    trace = bench_trace(args, vocab_size)
    b = args.batch_size
    print(f"machine: {describe_machine()}")
    print(f"model: {args.model}; fp32; max batch {b} for every system; transformers CB: page_size {CB_PAGE_SIZE}, "
          f"max_batch_tokens {args.cb_max_batch_tokens}")
    print(f"trace: {describe_trace(trace)}")
    print("HF static times: one streamer timestamp per decoding step; a request finishes at its own "
          "last token (its batch runs on to the longest)\n", flush=True)

    runs: dict[str, Run] = {}
    runs[BASELINE] = run_hf_static(args.model, trace, b)
    print(f"  ran {BASELINE} in {runs[BASELINE].wall_s:.1f} s", flush=True)
    runs["transformers CB"] = run_transformers_cb(args.model, trace, b, args.cb_max_batch_tokens)
    print(f"  ran transformers CB in {runs['transformers CB'].wall_s:.1f} s", flush=True)
    for batching in ("static", "dynamic", "continuous"):
        run = run_minillm(make_llm(args.model, batching, b), batching, trace)
        runs[run.name] = run
        print(f"  ran {run.name} in {run.wall_s:.1f} s", flush=True)

    summaries = {name: run.summary() for name, run in runs.items()}
    print()
    print(table(summaries))
    tput = {name: s.output_throughput for name, s in summaries.items()}
    ours = tput["minillm continuous"]
    print(f"\nminillm continuous / HF static output tok/s = {ours / tput[BASELINE]:.2f} (aim >= 4)")
    print(f"minillm continuous / transformers CB output tok/s = {ours / tput['transformers CB']:.2f} (aim >= 2)")
    print(greedy_agreement(runs, "minillm continuous", args.check))
    print(greedy_agreement(runs, "transformers CB", args.check))
    if args.profile:
        print()
        print(profile_minillm(args.model, trace, b))


if __name__ == "__main__":
    main()
