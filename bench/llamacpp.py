"""minillm against llama.cpp (llama-cpp-python), side by side in one run, on the bundled models (issue 29).

    python bench/llamacpp.py --install     # once: llama-cpp-python built from source into bench/.llamacpp-venv
    python bench/llamacpp.py               # the side-by-side table (a few minutes)
    python bench/llamacpp.py --llamacpp-python /path/to/venv/bin/python   # a llama-cpp-python built elsewhere

llama.cpp runs in a subprocess of its own venv (`bench/_llamacpp_peer.py`, no torch there), minillm in
this process, one after the other on the same token ids, rounds interleaved so that both see the
same load. The models go to GGUF F32 through tools/hf_to_gguf.py. In order:

1. greedy check, target and draft: llama.cpp's tokenizer gives minillm's ids; 3 prompts x 32 greedy
   tokens are identical through llama.cpp's raw decode, its multi-sequence batch and its `Llama.generate`
   (any difference stops the bench: the timings below would compare different work);
2. single sequence: a 200-token prompt + 128 greedy tokens, 1 and 2 threads (the draft at 1 thread);
3. 32 requests with heavy-tailed prompt and output lengths: minillm's continuous batching, llama.cpp's
   multi-sequence batching (one KV cache, one `llama_batch` with a sequence id per row), llama.cpp one
   request at a time;
4. prompt lookup at batch 1: llama.cpp's `LlamaPromptLookupDecoding` against its own `Llama.generate`,
   minillm's n-gram speculation against its plain decoding (its Python API has no draft-model speculation);
5. start-up: `minillm serve` from launch to /health 200, and the first token of a 200-token chat prompt;
   llama.cpp from launch to a loaded `Llama(...)` and its first token of the same chat.

Throughputs are output tokens per second over whole requests (prefill included), EOS ignored.
Printed: medians with [min-max] over the rounds, and the median of the per-round ratios
minillm / llama.cpp (> 1: minillm ahead; for times, llama.cpp's time / minillm's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

PEER_VENV = BENCH / ".llamacpp-venv"  # git-ignored; made by --install
PEER_PACKAGES = ["llama-cpp-python==0.3.36", "gguf==0.19.0", "numpy", "safetensors"]
MODELS = {"target": ROOT / "models" / "minillm-target", "draft": ROOT / "models" / "minillm-draft"}


def install(venv: Path) -> None:
    print(f"building llama-cpp-python from source into {venv} (minutes on 2 cores)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # LLAVA_BUILD=OFF: no multimodal library (a third of the compile); llama_cpp imports it only for image chats
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2),
           "CMAKE_ARGS": f"{os.environ.get('CMAKE_ARGS', '')} -DLLAVA_BUILD=OFF".strip()}
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", *PEER_PACKAGES], check=True, env=env)
    print(f"done: python bench/llamacpp.py  (uses {venv / 'bin' / 'python'})")


class LlamaCppPeer:
    """bench/_llamacpp_peer.py in llama-cpp-python's venv, answering one JSON request at a time."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.log_path = BENCH / "results" / "llamacpp-peer.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([python, str(BENCH / "_llamacpp_peer.py"), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)

    def __call__(self, op: str, **request) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the llama.cpp peer exited ({self.proc.wait()}); its log: {self.log_path}")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise SystemExit(f"llama.cpp peer, {op}: {answer['error']} (log: {self.log_path})")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def convert_models(python: str) -> dict[str, Path]:
    """GGUF files of the bundled models, written by the peer's python (it has gguf; this venv may not)."""
    from _machine import results_path

    paths = {}
    for name, model_dir in MODELS.items():
        paths[name] = results_path(f"minillm-{name}.gguf")
        subprocess.run([python, str(ROOT / "tools" / "hf_to_gguf.py"), str(model_dir), str(paths[name])],
                       check=True, stdout=subprocess.DEVNULL)
    return paths


# ---- the numbers ----------------------------------------------------------------------------------
def spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def row(label: str, ours: list[float], theirs: list[float], ratios: list[float], fmt: str = "{:,.0f}") -> None:
    print(f"  {label:<44} {spread(ours, fmt):>22} {spread(theirs, fmt):>22} {spread(ratios, '{:.2f}'):>18}")


def header(title: str, unit: str, ratio: str = "minillm / llama.cpp") -> None:
    print(f"\n{title}\n  {unit:<44} {'minillm':>22} {'llama.cpp':>22} {ratio:>18}")


def rounds_text(n: int) -> str:
    return f"{n} round{'s' * (n != 1)}"


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def require_identical(what: str, ours: list[list[int]], theirs: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        at = first_difference(a, b)
        if at is not None:
            raise SystemExit(f"NOT token-identical ({what}), prompt {i}, first difference at output token {at}:\n"
                             f"  minillm   {a[max(0, at - 3):at + 5]}\n  llama.cpp {b[max(0, at - 3):at + 5]}\n"
                             "Timings would compare different work; nothing is timed.")


# ---- the workloads ---------------------------------------------------------------------------------
def text_token_stream(tokenizer, n: int) -> list[int]:
    """At least n token ids of KJV text (no BOS), the verses the bundled models were trained on."""
    from spec import VERSES

    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(VERSES) + " ", add_special_tokens=False)
    return ids


def heavy_tailed_requests(tokenizer, bos: int, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """n prompts (log-normal lengths) and output lengths (Pareto: most short, a few long), seeded."""
    import numpy as np

    from minillm.traces.synthetic import lognormal_lengths, pareto_lengths

    rng = np.random.default_rng(seed)
    prompt_lens = lognormal_lengths(n, 96, 0.8, rng, min_len=8, max_len=512)
    output_lens = pareto_lengths(n, 24, 1.3, rng, min_len=8, max_len=384)
    stream = text_token_stream(tokenizer, 2048)
    starts = rng.integers(0, len(stream) - 512, size=n)
    prompts = [[bos, *stream[s:s + int(k) - 1]] for s, k in zip(starts, prompt_lens)]
    return prompts, [int(k) for k in output_lens]


def chat_of_length(tokenizer, n_tokens: int, skip_words: int = 0) -> tuple[list[dict], int]:
    """A one-message chat whose templated prompt is as close to n_tokens as whole words allow."""
    from spec import VERSES

    from minillm.llm import chat_prompt_ids

    words = ((" ".join(VERSES) + " ").split() * 5)[skip_words:]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose prompt fits in n_tokens
        mid = (lo + hi + 1) // 2
        fits = len(chat_prompt_ids(tokenizer, [{"role": "user", "content": " ".join(words[:mid])}])) <= n_tokens
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    messages = [{"role": "user", "content": " ".join(words[:lo])}]
    return messages, len(chat_prompt_ids(tokenizer, messages))


class Minillm:
    """minillm's LLM on the same token ids; threads set per run (torch's intra-op pool)."""

    def __init__(self, model: Path, **knobs) -> None:
        from minillm import LLM

        self.llm = LLM(str(model), **knobs)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], threads: int) -> tuple[list[list[int]], float]:
        import torch

        from minillm import SamplingParams

        torch.set_num_threads(threads)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        return [list(o.outputs[0].token_ids) for o in outs], wall


# ---- the sections ----------------------------------------------------------------------------------
def greedy_check(peer: LlamaCppPeer, engines: dict[str, Minillm], tokenizer, bos: int) -> None:
    texts = ["In the beginning God created the heaven", "And the king said unto", "Thou shalt not"]
    ours_ids = [[bos, *tokenizer.encode(t, add_special_tokens=False)] for t in texts]
    print("\n1. greedy check (3 prompts x 32 tokens; any difference stops the bench)")
    for name, engine in engines.items():
        theirs_ids = peer("tokenize", name=name, texts=texts)["ids"]
        require_identical(f"{name}: llama.cpp's tokenizer vs minillm's", ours_ids, theirs_ids)
        ours, _ = engine.generate(ours_ids, [32] * 3, threads=1)
        paths = {"raw decode": peer("generate", name=name, prompts=ours_ids, max_tokens=[32] * 3, threads=1,
                                    one_at_a_time=True),
                 "multi-sequence batch": peer("generate", name=name, prompts=ours_ids, max_tokens=[32] * 3, threads=1),
                 "Llama.generate": peer("generate_high_level", name=name, prompts=ours_ids, max_tokens=32, threads=1)}
        for path, answer in paths.items():
            require_identical(f"{name}: minillm vs llama.cpp's {path}", ours, answer["tokens"])
        print(f"  {name}: tokenizer ids identical; 96 greedy tokens identical through raw decode, multi-sequence batch "
              "and Llama.generate")


def single_sequence(peer, engines, prompt: list[int], max_tokens: int, rounds: int) -> None:
    header(f"2. single sequence: {len(prompt)}-token prompt + {max_tokens} greedy tokens, {rounds_text(rounds)}",
           "output tok/s")
    for name, threads in (("target", 1), ("target", 2), ("draft", 1)):
        ours, theirs = [], []
        for _ in range(rounds):
            ours.append(max_tokens / engines[name].generate([prompt], [max_tokens], threads)[1])
            theirs.append(max_tokens / peer("generate", name=name, prompts=[prompt], max_tokens=[max_tokens],
                                            threads=threads)["wall_s"])
        row(f"{name}, {threads} thread{'s' * (threads > 1)}", ours, theirs, [a / b for a, b in zip(ours, theirs)])
    print("  (2 threads: on a 2-core machine shared with other work, threads that wait on each other can be slower "
          "than one; compare at 1 thread)")


def batch(peer, engine: Minillm, prompts, max_tokens, rounds: int, threads: int) -> None:
    total = sum(max_tokens)
    header(f"3. {len(prompts)} requests, heavy-tailed: prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
           f"tokens (median {statistics.median(map(len, prompts)):.0f}), outputs {min(max_tokens)}-{max(max_tokens)} "
           f"(median {statistics.median(max_tokens):.0f}), {total} output tokens; {threads} thread(s), {rounds_text(rounds)}",
           "output tok/s")
    ours, multi, serial, same = [], [], [], 0
    for _ in range(rounds):
        tokens, wall = engine.generate(prompts, max_tokens, threads)
        ours.append(total / wall)
        answer = peer("generate", name="target", prompts=prompts, max_tokens=max_tokens, threads=threads)
        multi.append(total / answer["wall_s"])
        same = sum(a == b for a, b in zip(tokens, answer["tokens"]))
        serial.append(total / peer("generate", name="target", prompts=prompts, max_tokens=max_tokens, threads=threads,
                                   one_at_a_time=True)["wall_s"])
    row("vs llama.cpp multi-sequence batch", ours, multi, [a / b for a, b in zip(ours, multi)])
    row("vs llama.cpp one request at a time", ours, serial, [a / b for a, b in zip(ours, serial)])
    print(f"  outputs identical to llama.cpp's batch in {same} of {len(prompts)} requests (float32 sums in another order "
          "may flip a near-tie in a long output)")


def prompt_lookup(peer, prompts: list[list[int]], max_tokens: int, k: int, ngram: int, rounds: int) -> None:
    plain = Minillm(MODELS["target"], max_num_seqs=1)
    spec = Minillm(MODELS["target"], max_num_seqs=1, speculative_config={
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ngram, "prompt_lookup_min": 1})
    lookup = {"max_ngram_size": ngram, "num_pred_tokens": k}
    n_out = max_tokens * len(prompts)
    header(f"4. prompt lookup at batch 1: {len(prompts)} prompts x {max_tokens} tokens, {k} guessed tokens, "
           f"n-grams up to {ngram}; 1 thread, {rounds_text(rounds)}", "output tok/s")
    ours_plain, ours_spec, theirs_plain, theirs_spec, outputs = [], [], [], [], {}
    for _ in range(rounds):
        for engine, sink, key in ((plain, ours_plain, "minillm plain"), (spec, ours_spec, "minillm n-gram")):
            tokens, wall = engine.generate(prompts, [max_tokens] * len(prompts), threads=1)
            sink.append(n_out / wall)
            outputs[key] = tokens
        for setting, sink, key in ((None, theirs_plain, "llama.cpp plain"), (lookup, theirs_spec, "llama.cpp lookup")):
            answer = peer("generate_high_level", name="target", prompts=prompts, max_tokens=max_tokens, threads=1,
                          lookup=setting)
            sink.append(n_out / answer["wall_s"])
            outputs[key] = answer["tokens"]
    row("plain decoding (llama.cpp: Llama.generate)", ours_plain, theirs_plain,
        [a / b for a, b in zip(ours_plain, theirs_plain)])
    row("n-gram / prompt lookup", ours_spec, theirs_spec, [a / b for a, b in zip(ours_spec, theirs_spec)])
    row("speculation / plain, each engine's own", [a / b for a, b in zip(ours_spec, ours_plain)],
        [a / b for a, b in zip(theirs_spec, theirs_plain)],
        [(a / b) / (c / d) for a, b, c, d in zip(ours_spec, ours_plain, theirs_spec, theirs_plain)], "{:.2f}")
    reference = outputs["minillm plain"]
    same = {key: sum(a == b for a, b in zip(reference, tokens)) for key, tokens in outputs.items() if key != "minillm plain"}
    print("  outputs identical to minillm plain: " + ", ".join(f"{key} {n}/{len(prompts)}" for key, n in same.items()))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric_sum(exposition: str, name: str) -> float:
    """A histogram's `_sum` in Prometheus text (0 before anything was observed)."""
    for line in exposition.splitlines():
        if line.startswith(name + "_sum"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _first_token_s(client, url: str, messages: list[dict]) -> tuple[float, float]:
    """(seconds from sending the chat to its first streamed token, the engine's own share: arrival in the engine
    to first token, from the server's TTFT histogram). The rest is HTTP and the API: the request, its parsing,
    the chat template, tokenizing, the hand-offs to and from the engine thread, the SSE chunk."""
    ttft = "vllm:time_to_first_token_seconds"
    engine_before = _metric_sum(client.get(url + "/metrics").text, ttft)
    body = {"model": "minillm", "messages": messages, "max_tokens": 8, "temperature": 0.0, "stream": True}
    first = None
    sent = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = time.perf_counter() - sent
    if first is None:
        raise SystemExit(f"minillm serve streamed no token for the chat (HTTP {r.status_code})")
    return first, _metric_sum(client.get(url + "/metrics").text, ttft) - engine_before


def minillm_startup(chats: list[list[dict]]) -> tuple[float, list[float], list[float], dict[str, float]]:
    """`minillm serve` (its defaults) from launch to /health 200, then the first streamed token of each chat:
    (ready s, first-token s per chat, the engine's share of each, the server's start-up phases in s).

    One HTTP client, made before the clock starts, polls and sends: building one (httpx makes a TLS context
    even for http://) took 74-209 ms of wall time here under load (2026-12-02, load average 7 on 2 cores), and
    the bench used to build one per chat inside the clock: the client's time, not the server's."""
    import httpx

    from minillm.server.serve import STARTUP_LINE_PREFIX, parse_startup_line

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=120) as client:
        launched = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", str(port)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"minillm serve exited with {proc.returncode}:\n{proc.stderr.read()[-2000:]}")
                try:
                    if client.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.01)
            ready = time.time()
            firsts, engine = zip(*[_first_token_s(client, url, messages) for messages in chats])
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=60)
    lines = [line for line in out.splitlines() if line.startswith(STARTUP_LINE_PREFIX)]
    phases = parse_startup_line(lines[0])[1] if lines else {}
    return ready - launched, list(firsts), list(engine), phases


def llamacpp_startup(python: str, gguf: Path, chats: list[list[dict]]) -> tuple[float, list[float], list[int]]:
    launched = time.time()
    done = subprocess.run([python, str(BENCH / "_llamacpp_peer.py"), "startup", str(gguf), repr(launched), "0",
                           json.dumps(chats)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp start-up run failed:\n{done.stderr[-2000:]}")
    t = json.loads(done.stdout.strip().splitlines()[-1])
    return t["ready_at"] - t["launched_at"], t["first_token_s"], t["prompt_tokens"]


def startup(python: str, gguf: Path, tokenizer, rounds: int) -> None:
    """Two chats of 200 tokens, different words (so no prefix cache helps the second): the first request
    on a fresh process, then one on the warm process."""
    (first, n_prompt), (second, _) = chat_of_length(tokenizer, 200), chat_of_length(tokenizer, 200, skip_words=7)
    ours: dict[str, list[float]] = {"ready": [], "first": [], "second": []}
    theirs: dict[str, list[float]] = {"ready": [], "first": [], "second": []}
    their_prompt: list[int] = []
    engine_ms: list[tuple[float, float]] = []
    phases: list[dict[str, float]] = []
    for _ in range(rounds):
        ready, ttfts, engine_s, phase_s = minillm_startup([first, second])
        engine_ms.append((engine_s[0] * 1e3, engine_s[1] * 1e3))
        phases.append({**phase_s, "health poll and the rest": ready - sum(phase_s.values())})
        their_ready, their_ttfts, their_prompt = llamacpp_startup(python, gguf, [first, second])
        for sink, r, (t1, t2) in ((ours, ready, ttfts), (theirs, their_ready, their_ttfts)):
            sink["ready"].append(r)
            sink["first"].append(t1 * 1e3)
            sink["second"].append(t2 * 1e3)
    header(f"5. start-up and first token: `minillm serve` vs `Llama(...)`, each with its default threads, a fresh "
           f"process each round, {rounds_text(rounds)}; chat prompts of {n_prompt} tokens in minillm, "
           f"{' and '.join(map(str, their_prompt))} in llama.cpp",
           "time", "llama.cpp / minillm")
    ratio = {k: [b / a for a, b in zip(ours[k], theirs[k])] for k in ours}
    row("launch to ready (s): /health 200 | Llama loaded", ours["ready"], theirs["ready"], ratio["ready"], "{:.2f}")
    row("first token, first chat (ms)", ours["first"], theirs["first"], ratio["first"], "{:.1f}")
    row("first token, second chat, warm (ms)", ours["second"], theirs["second"], ratio["second"], "{:.1f}")
    total = [a + b / 1e3 for a, b in zip(ours["ready"], ours["first"])]
    their_total = [a + b / 1e3 for a, b in zip(theirs["ready"], theirs["first"])]
    row("launch to first token (s)", total, their_total, [b / a for a, b in zip(total, their_total)], "{:.2f}")
    print("  (time ratios: > 1 means minillm takes less time)")
    print("  minillm's launch to ready by phase, from its start-up line (s, median over rounds): " + ", ".join(
        f"{name} {statistics.median(p.get(name, 0.0) for p in phases):.2f}" for name in phases[0]))
    for i, which in enumerate(("first chat", "second chat, warm")):
        engine = [e[i] for e in engine_ms]
        rest = [t - e for t, e in zip(ours["first" if i == 0 else "second"], engine)]
        print(f"  minillm's first token, {which} (ms, median over rounds): in the engine (arrival to first token: "
              f"prefill, sampling, detokenizing) {statistics.median(engine):.1f}, HTTP and API (request, chat "
              f"template, tokenizing, hand-offs, SSE) {statistics.median(rest):.1f}")
    print("  llama.cpp's first token is in-process (no HTTP); its ready is import + load")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--install", action="store_true", help=f"build llama-cpp-python into {PEER_VENV} and stop")
    parser.add_argument("--llamacpp-python", default=None,
                        help=f"the python of a venv with {', '.join(PEER_PACKAGES)} (default: {PEER_VENV}/bin/python)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the single-sequence runs")
    parser.add_argument("--batch-rounds", type=int, default=3)
    parser.add_argument("--startup-rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--batch-threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=4, help="guessed tokens per prompt-lookup step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", default="2,3,4,5", help="which of sections 2-5 to run (the greedy check, 1, "
                        "always runs first)")
    args = parser.parse_args()
    sections = {int(x) for x in args.sections.split(",") if x.strip()}
    if not sections <= {2, 3, 4, 5}:
        raise SystemExit(f"--sections takes numbers from 2,3,4,5; got {args.sections!r}")
    if args.install:
        install(PEER_VENV)
        return
    python = args.llamacpp_python or str(PEER_VENV / "bin" / "python")
    if not Path(python).is_file():
        raise SystemExit(f"no llama-cpp-python at {python}: run `python bench/llamacpp.py --install` (builds it from "
                         "source into its own venv, minutes) or pass --llamacpp-python PATH")

    import torch
    from _machine import describe_machine, describe_memory

    import minillm

    print(f"command: python bench/llamacpp.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"machine: {describe_machine()}")
    ggufs = convert_models(python)
    engines = {"target": Minillm(MODELS["target"], max_num_seqs=args.num_requests),
               "draft": Minillm(MODELS["draft"], max_num_seqs=args.num_requests)}
    print(f"memory: {describe_memory(engines['target'].llm.engine.executor.worker.model.weight_bytes)}")
    tokenizer = engines["target"].llm.tokenizer
    bos = tokenizer.bos_token_id
    prompts, max_tokens = heavy_tailed_requests(tokenizer, bos, args.num_requests, args.seed)
    n_ctx = -(-max(4096, sum(len(p) + n for p, n in zip(prompts, max_tokens)) + 256) // 256) * 256
    peer = LlamaCppPeer(python)
    try:
        loaded = {name: peer("load", name=name, path=str(path), n_ctx=n_ctx, n_seq_max=args.num_requests)
                  for name, path in ggufs.items()}
        print(f"versions: minillm {minillm.__file__} (torch {torch.__version__}); llama-cpp-python "
              f"{loaded['target']['llama_cpp_version']} ({python}); both float32, greedy, EOS ignored")
        for name, engine in engines.items():  # warm-up, untimed
            engine.generate([[bos, 5, 6, 7]], [4], threads=1)
            peer("generate", name=name, prompts=[[bos, 5, 6, 7]], max_tokens=[4], threads=1)
        greedy_check(peer, engines, tokenizer, bos)
        if 2 in sections:
            long_prompt = [bos, *text_token_stream(tokenizer, 199)[:199]]
            single_sequence(peer, engines, long_prompt, 128, args.rounds)
        if 3 in sections:
            batch(peer, engines["target"], prompts, max_tokens, args.batch_rounds, args.batch_threads)
        if 4 in sections:
            lookup_prompts = [[bos, *text_token_stream(tokenizer, 400)[s:s + 99]] for s in (0, 40, 80, 120)]
            prompt_lookup(peer, lookup_prompts, 128, args.k, 3, args.batch_rounds)
    finally:
        peer.close()
    if 5 in sections:
        startup(python, ggufs["target"], tokenizer, args.startup_rounds)
    print("\nmedian [min-max] over rounds; ratios are per round (same load), then their median and range")


if __name__ == "__main__":
    main()
