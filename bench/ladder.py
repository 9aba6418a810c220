"""The batching ladder against named peers: one heavy-tailed trace, five ways to serve it.

    python bench/ladder.py [--model DIR] [--num-requests 200] [--rate inf] [--repeats 3] [--quick] [--profile]
                           [--attention-backend auto|torch|numba_cpu]

One seeded trace (log-normal prompt and output lengths, sigma 1: median ~40, p99 ~300 tokens;
all requests at t=0 unless `--rate` is given) is served, one system after another in the same
process, by

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

The table gives output tok/s, mean and P99 TTFT and TPOT, each also as a ratio to HF static, and
output tokens per CPU-second of the process (CPU %: how much of a core the run got). On a busy
shared machine wall-clock ratios swing with the neighbours' load; the per-CPU-second ratio is
what the wall-clock ratio becomes on an idle core. `--repeats N` (default 3) runs the systems
round-robin N times and keeps each one's fastest run. minillm uses `--attention-backend` (default
"auto": the numba @njit decode kernel on a CPU, minillm/attention/select.py); the header names it
and the machine's load average is printed before and after.
Aims: minillm continuous ≥ 6× HF static and ≥ 2.5× transformers CB in output tok/s (stretch: 10× and 4×).
After the table: for minillm continuous at max batch B and again at 64, the share of a step's wall
time spent outside the model's forward pass, and decode attention's keys read ÷ keys that exist.
`--profile` re-runs minillm continuous under cProfile (CPU-time clock) and prints where its
step time goes. `--quick`: 40 requests, a smoke run.

Torch runs with `--threads` (default 1) intra-op threads: on a shared 2-core machine a second
OpenMP thread that loses its core makes each small matmul several times slower, which would
measure the neighbours rather than the engines.
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
from functools import cached_property
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as minillm/__init__.py explains

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

from minillm.attention.select import resolve_backend  # noqa: E402
from minillm.llm import BUNDLED_TARGET, LLM, default_device  # noqa: E402
from minillm.metrics import MetricsCollector, RequestMetrics, Summary, summarize  # noqa: E402
from minillm.model.loader import read_hf_config  # noqa: E402
from minillm.request import SamplingParams  # noqa: E402
from minillm.traces.synthetic import LengthDist, Trace, make_trace  # noqa: E402

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
    cpu_s: float = 0.0  # CPU time of this process while the trace ran (all its threads)
    engine: object = None  # minillm's engine after the run (its runner's counters)

    @cached_property
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


class Stopwatch:
    """Wall and CPU seconds since start. On a shared machine the CPU seconds show how much of a
    core a run really got; output tokens per CPU second depend far less on the neighbours."""

    def __init__(self) -> None:
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def stop(self, run: Run) -> Run:
        run.wall_s, run.cpu_s = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        return run


def wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# --------------------------------------------------------------------------- HF transformers


def load_hf(model_dir: Path, device: str):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
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
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, streamer=clock)
    generated = out[:, width:]
    if generated.shape[1] != max_new_tokens or len(clock.times) != max_new_tokens:
        raise RuntimeError(f"generate stopped early: {generated.shape[1]} of {max_new_tokens} tokens")
    return generated.cpu(), clock.times


def run_hf_static(model_dir: Path, device: str, trace: Trace, batch_size: int) -> Run:
    """Batches of `batch_size` in arrival order; a batch starts when its last member has arrived
    and the previous batch is done (minillm's static scheduler fires the same way)."""
    model = load_hf(model_dir, device)
    hf_generate_batch(model, [[7, 8, 9]] * 2, 4)  # warm-up
    metrics, tokens = [], []
    watch = Stopwatch()
    t0 = watch.t0
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
    return watch.stop(Run(BASELINE, metrics, tokens))


def run_transformers_cb(model_dir: Path, device: str, trace: Trace, batch_size: int, max_batch_tokens: int) -> Run:
    """transformers' ContinuousBatchingManager, fed at the trace's arrival times."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf(model_dir, device)
    longest = max(r.prompt_len + r.max_tokens for r in trace)
    num_blocks = batch_size * (math.ceil(longest / CB_PAGE_SIZE) + 1)  # B requests of the longest length
    config = ContinuousBatchingConfig(page_size=CB_PAGE_SIZE, num_blocks=num_blocks,
                                      max_batch_tokens=max_batch_tokens, max_requests_per_batch=batch_size)
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.max_tokens for r in trace))
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.start()
    try:
        cb_collect(manager, [("warm-up", 0.0, [7, 8, 9], 4)], time.perf_counter())
        watch = Stopwatch()
        t0 = watch.t0
        outputs = cb_collect(manager, [(r.request_id, r.arrival_time_s, r.prompt_token_ids, r.max_tokens)
                                       for r in trace], t0)
        run = watch.stop(Run("transformers CB", [], []))
    finally:
        manager.stop(block=True)
    for req in trace:
        out = outputs[req.request_id]
        if out.error is not None or len(out.generated_tokens) != req.max_tokens:
            raise RuntimeError(f"transformers CB: {req.request_id} gave {len(out.generated_tokens)} of "
                               f"{req.max_tokens} tokens (error {out.error!r})")
        times = list(out.timestamps)
        run.metrics.append(RequestMetrics(req.request_id, t0 + req.arrival_time_s, req.prompt_len,
                                          first_scheduled_time=out.lifespan[0], first_token_time=times[0],
                                          token_times=times, finished_time=times[-1]))
        run.tokens.append(list(out.generated_tokens))
    return run


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


def make_llm(model_dir: Path, device: str, batching: str, batch_size: int, **knobs) -> LLM:
    llm = LLM(model_dir, device=device, batching=batching, max_num_seqs=batch_size, enable_prefix_caching=False,
              **knobs)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[7, 8, 9], [10, 11]], warm, use_tqdm=False)
    llm.engine.metrics = MetricsCollector()  # forget the warm-up
    return llm


def run_minillm(llm: LLM, batching: str, trace: Trace) -> Run:
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    watch = Stopwatch()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in trace], params,
                        arrival_times=[r.arrival_time_s for r in trace], use_tqdm=False)
    return watch.stop(Run(f"minillm {batching}", [o.metrics for o in outs], [o.outputs[0].token_ids for o in outs],
                          steps=list(llm.engine.metrics.steps), engine=llm.engine))


def make_measured_llm(model_dir: Path, device: str, batching: str, batch_size: int, **knobs) -> LLM:
    """`make_llm` with the runner's counters zeroed after the warm-up."""
    llm = make_llm(model_dir, device, batching, batch_size, **knobs)
    llm.engine.executor.stats(reset=True)
    llm.engine.time_in_steps_s = 0.0
    return llm


def engine_shares(run: Run) -> str:
    """Where a minillm step's wall time goes: the model (forward + lm_head) vs everything else
    (scheduling, building inputs, sampling, updating requests, metrics)."""
    engine = run.engine
    stats = engine.executor.stats()
    steps = engine.time_in_steps_s
    outside = 1 - stats.model_time_s / steps
    return (f"{len(run.steps)} steps, {1e3 * steps / len(run.steps):.2f} ms per step, of which "
            f"{1e3 * stats.model_time_s / len(run.steps):.2f} ms in the model: share outside the forward pass "
            f"{outside:.3f}; decode attention keys read / keys that exist {keys_read_ratio(stats)}")


def keys_read_ratio(stats) -> str:
    """Keys decode attention reads per key that exists (`stats`: the executor's `WorkerStats`). The torch
    backend reads each length group's longest run (the runner counts it); the numba_cpu kernel walks
    each row's blocks to its length."""
    if stats.attention_backend == "numba_cpu":
        return "1.000 (numba_cpu kernel: each key once)"
    return f"{stats.keys_read / stats.keys_exist:.3f}"


def profile_minillm(model_dir: Path, device: str, trace: Trace, batch_size: int, top: int = 30) -> str:
    """cProfile of minillm continuous on the trace: the functions its step time goes to. The
    profiler's clock is CPU time, so time lost to other processes does not count."""
    llm = make_llm(model_dir, device, "continuous", batch_size)
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    run = run_minillm(llm, "continuous", trace)
    profiler.disable()
    steps = run.steps
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return (f"minillm continuous under cProfile: {len(steps)} steps, {1e3 * run.cpu_s / len(steps):.2f} ms CPU "
            f"per step (profiler overhead included); seconds below are CPU seconds\n{text.getvalue()}")


# --------------------------------------------------------------------------- report

SYSTEMS = (BASELINE, "transformers CB", "minillm static", "minillm dynamic", "minillm continuous")

_COLUMNS = [  # (header, getter); ratios are value ÷ HF static's (latency: lower is better)
    ("output tok/s", lambda r: r.summary.output_throughput),
    ("mean TTFT ms", lambda r: r.summary.ttft.mean_ms),
    ("P99 TTFT ms", lambda r: r.summary.ttft.percentiles_ms[99]),
    ("mean TPOT ms", lambda r: r.summary.tpot.mean_ms),
    ("P99 TPOT ms", lambda r: r.summary.tpot.percentiles_ms[99]),
    ("out tok/CPU-s", lambda r: r.summary.total_output_tokens / r.cpu_s),
]


def table(runs: dict[str, Run]) -> str:
    base = runs[BASELINE]
    width = 19
    lines = [f"{'system':<19}" + "".join(f"{h:>{width}}" for h, _ in _COLUMNS)
             + f"{'CPU %':>7}{'steps':>7}{'pad %':>7}"]
    for name, run in runs.items():
        cells = [f"{get(run):.1f} ({get(run) / get(base):.2f}x)" for _, get in _COLUMNS]
        s = run.summary
        steps = f"{s.num_steps}" if s.num_steps else "-"
        pad = f"{100 * s.padding_waste:.0f}" if s.num_steps else "-"
        busy = f"{100 * run.cpu_s / run.wall_s:.0f}"
        lines.append(f"{name:<19}" + "".join(f"{c:>{width}}" for c in cells) + f"{busy:>7}{steps:>7}{pad:>7}")
    return "\n".join(lines)


def aims(runs: dict[str, Run]) -> str:
    def ratio(a: str, b: str, metric) -> float:
        return metric(runs[a]) / metric(runs[b])

    wall, per_cpu = _COLUMNS[0][1], _COLUMNS[-1][1]
    ours = "minillm continuous"
    return "\n".join(
        f"{ours} / {peer} output tok/s = {ratio(ours, peer, wall):.2f} (aim >= {aim}); "
        f"per CPU-second {ratio(ours, peer, per_cpu):.2f}"
        for peer, aim in ((BASELINE, 6), ("transformers CB", 2.5)))


def greedy_agreement(runs: dict[str, Run], name: str, n: int) -> str:
    """How many of the first n requests got exactly HF static's greedy tokens (a sanity check:
    fp32 near-ties and left-padding numerics can flip a token and everything after it)."""
    ours, ref = runs[name].tokens[:n], runs[BASELINE].tokens[:n]
    same = sum(a == b for a, b in zip(ours, ref))
    return f"greedy tokens, first {len(ref)} requests: {name} == {BASELINE} for {same} of {len(ref)}"


# --------------------------------------------------------------------------- main


def run_system(name: str, args: argparse.Namespace, trace: Trace) -> Run:
    b = args.batch_size
    if name == BASELINE:
        return run_hf_static(args.model, args.device, trace, b)
    if name == "transformers CB":
        return run_transformers_cb(args.model, args.device, trace, b, args.cb_max_batch_tokens)
    batching = name.removeprefix("minillm ")
    return run_minillm(make_measured_llm(args.model, args.device, batching, b, attention_backend=args.attention_backend),
                       batching, trace)


def run_ladder(args: argparse.Namespace, trace: Trace) -> dict[str, Run]:
    """Every system once per round, round-robin; each keeps its fastest round, so a burst of load
    from a neighbour penalizes one round of one system rather than the comparison."""
    best: dict[str, Run] = {}
    for round_ in range(args.repeats):
        for name in SYSTEMS:
            run = run_system(name, args, trace)
            print(f"  round {round_ + 1}: {name:<19} {run.wall_s:6.1f} s wall, {run.cpu_s:6.1f} s CPU", flush=True)
            if name not in best or run.wall_s < best[name].wall_s:
                best[name] = run
    return best


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--device", default=default_device(), help="cpu or cuda (default: cuda if found)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each system keeps its fastest")
    parser.add_argument("--attention-backend", default="auto", help="minillm's attention backend (default auto)")
    parser.add_argument("--check", type=int, default=8, help="requests whose greedy tokens are compared")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 requests")
    parser.add_argument("--profile", action="store_true", help="also profile minillm continuous")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.repeats = min(args.num_requests, 40), 1
    if not (args.model / "config.json").is_file():
        parser.error(f"no model at {args.model} (pass --model DIR)")
    return args


def main() -> None:
    args = parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    trace = bench_trace(args, read_hf_config(args.model)["vocab_size"])
    print(f"machine: {describe_machine()}")
    print(f"model: {args.model}; fp32 on {args.device}; max batch {args.batch_size} for every system; transformers CB: page_size "
          f"{CB_PAGE_SIZE}, max_batch_tokens {args.cb_max_batch_tokens}; minillm attention backend "
          f"{resolve_backend(args.attention_backend, args.device)}; best of {args.repeats} round-robin rounds")
    print(f"trace: {describe_trace(trace)}")
    print("HF static times: one streamer timestamp per decoding step; a request finishes at its own "
          "last token (its batch runs on to the longest)\n", flush=True)

    runs = run_ladder(args, trace)
    print(f"\n{table(runs)}\n")
    print(aims(runs))
    print(greedy_agreement(runs, "minillm continuous", args.check))
    print(greedy_agreement(runs, "transformers CB", args.check))
    print(f"\nminillm continuous, max batch {args.batch_size}: {engine_shares(runs['minillm continuous'])}")
    big = run_minillm(make_measured_llm(args.model, args.device, "continuous", 64,
                                        attention_backend=args.attention_backend), "continuous", trace)
    print(f"minillm continuous, max batch 64 (same trace; the table's systems run at {args.batch_size}): "
          f"{big.summary.output_throughput:.0f} output tok/s; {engine_shares(big)}")
    if args.profile:
        print(f"\n{profile_minillm(args.model, args.device, trace, args.batch_size)}")
    print(f"\nload average at the end (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
