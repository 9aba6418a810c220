"""Grader of exercise 14 (chapter 14: squeezing the KV cache): int8 KV quantization with a scale per token
and head, its dequantization, StreamingLLM's keep-set, then both inside the engine.

Chapter 14 measures what 8-bit KV and eviction cost, but does not print the code of either: the
engine's int8 pool (`minillm.kv.quant`: quantize_int8, dequantize_int8, encode, decode, round_trip), the
simulated round trip (`minillm.kv.simulated_quant.round_trip`) and the keep-set behind
`kv_eviction={"policy": "streaming"}` (`minillm.kv.eviction.streaming_keep_positions`) are the
references here, disabled (`forbid`) while learner code runs. The checks test the properties that
define each piece, not one output:

- task 1 (quantize): codes are int8 in [-127, 127]; each (token, head) has one scale, finite and > 0
  (a head of zeros too: nothing is ever divided by zero), equal to that head's largest |x| / 127, so
  the largest value maps to ±127; every element comes back within half a step (round to nearest);
  the input is left as it was;
- task 2 (dequantize): codes × scale, broadcast per (token, head), in the dtype asked for;
- task 3 (keep-set): size min(seq_len, budget); the sinks and the recent window, nothing else; sorted;
- task 4 (in the engine): a float64 random model (the chapter's control) writes every K and V through
  the learner's round trip: the pool must hold values on each (token, head)'s int8 grid, equal to the
  reference's, and greedy tokens must equal the reference engine's; then StreamingLLM eviction with the
  learner's keep-set must evict as many tokens and emit the same tokens as the library's.
Tasks 1-3 add cases drawn when the check runs (`grade_time_seeds`); task 4 serves a prompt drawn then
beside its three seeded ones.
"""

from __future__ import annotations

import random

import torch

from minillm.grading import Fail, forbid, grade_time_seeds, task
from minillm.kv import eviction, quant, simulated_quant

LEARNER_TOOLS = ()  # nothing of this module is lent
# minillm's own answers: the simulated round trip, the engine's quantized pool (kv_cache_dtype) and the keep-set
REFERENCE = (simulated_quant.round_trip, simulated_quant.simulated_backend, simulated_quant.simulate_kv_dtype,
             quant.quantize_int8, quant.dequantize_int8, quant.round_trip, quant.encode, quant.decode,
             eviction.streaming_keep_positions)
FRESH_CASES = 3
TOLERANCE = 1e-6  # relative, on scales and dequantized values (float32 arithmetic in a learner's code)


# --- cases ---------------------------------------------------------------------------------------------------


def _tensor_cases(seed: int, count: int) -> list[tuple[str, torch.Tensor]]:
    """K/V-shaped tensors [tokens, heads, head_dim]: heads of very different magnitudes, outlier tokens,
    heads of zeros, float32 and float64."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cases = []
    for number in range(count):
        tokens, heads, dim = rng.randint(1, 9), rng.randint(1, 5), rng.choice([1, 2, 8, 16, 32])
        dtype = rng.choice([torch.float32, torch.float64])
        magnitude = 10.0 ** torch.empty(tokens, heads, 1, dtype=torch.float64).uniform_(-3, 3, generator=gen)
        x = torch.randn(tokens, heads, dim, generator=gen, dtype=torch.float64) * magnitude
        if rng.random() < 0.4:
            x[rng.randrange(tokens), :, rng.randrange(dim)] *= 50.0  # an outlier channel in one token
        if rng.random() < 0.4:
            x[rng.randrange(tokens), rng.randrange(heads)] = 0.0  # a head of zeros
        cases.append((f"seed {seed} case {number} ({tokens}x{heads}x{dim}, {str(dtype)[6:]})", x.to(dtype)))
    return cases


EDGE_CASES = [
    ("all zeros", torch.zeros(3, 2, 4)),
    ("one element", torch.tensor([[[-2.5]]])),
    ("positive only: the max is the largest |x|", torch.tensor([[[0.1, 0.5, 3.0, 1.0]]])),
    ("negative extreme: -4 is the largest |x|", torch.tensor([[[-4.0, 1.0, 2.0, 0.0]]])),
    ("two heads, 1000x apart (one scale per head, not per token)",
     torch.tensor([[[1000.0, -500.0, 250.0], [1.0, -0.5, 0.25]]])),
    ("two tokens, 1000x apart (one scale per token, not per tensor)",
     torch.tensor([[[1000.0, -500.0]], [[0.001, 0.0005]]], dtype=torch.float64)),
    ("a tiny head next to a zero head", torch.tensor([[[1e-30, -1e-30], [0.0, 0.0]]], dtype=torch.float64)),
]


def _as_float(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


# --- task 1: quantize ---------------------------------------------------------------------------------------


def _check_quantized(where: str, x: torch.Tensor, got) -> None:
    if not isinstance(got, tuple | list) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
        raise Fail(f"{where}: quantize_int8 returned {type(got).__name__}; return (codes, scales), two tensors")
    codes, scales = got
    tokens, heads, _ = x.shape
    if codes.dtype != torch.int8 or codes.shape != x.shape:
        raise Fail(f"{where}: codes are {codes.dtype} {tuple(codes.shape)}; expected torch.int8 {tuple(x.shape)}")
    if tuple(scales.shape) != (tokens, heads, 1) or not scales.is_floating_point():
        raise Fail(f"{where}: scales are {scales.dtype} {tuple(scales.shape)}; expected a float tensor "
                   f"{(tokens, heads, 1)}: one scale per token and head (keepdim)")
    s, c, xf = _as_float(scales), _as_float(codes), _as_float(x)
    if not torch.isfinite(s).all() or (s <= 0).any():
        t, h = [int(i) for i in torch.nonzero(~torch.isfinite(s) | (s <= 0))[0][:2]]
        raise Fail(f"{where}: scale of token {t}, head {h} is {float(s[t, h, 0])!r} (that head's largest |x| is "
                   f"{float(xf[t, h].abs().max())!r}); a scale must be finite and > 0, even for a head of zeros, "
                   "so that nothing is divided by zero")
    if c.abs().max() > 127:
        raise Fail(f"{where}: a code is {int(c.abs().max())}; symmetric int8 codes stay in [-127, 127]")
    amax = xf.abs().amax(dim=-1, keepdim=True)
    live = amax > 0
    want = amax / 127
    off = live & ((s - want).abs() > TOLERANCE * want)
    if off.any():
        t, h = [int(i) for i in torch.nonzero(off)[0][:2]]
        raise Fail(f"{where}: scale of token {t}, head {h} is {float(s[t, h, 0]):.6g}; its largest |x| is "
                   f"{float(amax[t, h, 0]):.6g}, so the scale that maps it to ±127 is {float(want[t, h, 0]):.6g} "
                   "(one scale per token and head, from that head's own values)")
    error = (c * s - xf).abs()
    bound = s * (0.5 + 1e-3) + 1e-300  # (a float32 division may land a hair past a half)
    if (error > bound).any():
        t, h, d = [int(i) for i in torch.nonzero(error > bound)[0]]
        raise Fail(f"{where}: x[{t}, {h}, {d}] = {float(xf[t, h, d]):.6g} came back as code {int(c[t, h, d])} x scale "
                   f"{float(s[t, h, 0]):.6g} = {float(c[t, h, d] * s[t, h, 0]):.6g}, off by more than half a step "
                   f"({float(s[t, h, 0]) / 2:.3g}): round to the nearest code, do not truncate")


@task(1, "quantize to int8, a scale per token and head")
def check_task_1(quantize_int8) -> list[str]:
    cases = list(EDGE_CASES) + _tensor_cases(14, 60)
    for seed in grade_time_seeds(FRESH_CASES):
        cases += _tensor_cases(seed, 20)
    for where, x in cases:
        before = x.clone()
        with forbid(*REFERENCE):
            got = quantize_int8(x)
        if not torch.equal(x, before):
            raise Fail(f"{where}: quantize_int8 changed its input; the engine still needs K and V after writing them")
        _check_quantized(where, x, got)
    return [f"{len(cases)} K/V tensors ({len(EDGE_CASES)} edge cases, {FRESH_CASES * 20} drawn as the check ran): int8 codes in [-127, 127], one scale per token and head = its largest |x| / 127 "
            "(> 0 for a head of zeros), every element back within half a step"]


# --- task 2: dequantize -------------------------------------------------------------------------------------


def _code_cases(seed: int, count: int) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.dtype]]:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cases = []
    for number in range(count):
        tokens, heads, dim = rng.randint(1, 7), rng.randint(1, 4), rng.choice([1, 4, 16])
        codes = torch.randint(-127, 128, (tokens, heads, dim), generator=gen).to(torch.int8)
        codes[0, 0, 0] = rng.choice([-127, 127, 0])
        scales = 10.0 ** torch.empty(tokens, heads, 1, dtype=torch.float64).uniform_(-4, 2, generator=gen)
        scales = scales.to(rng.choice([torch.float32, torch.float64]))
        dtype = rng.choice([torch.float32, torch.float64])
        cases.append((f"seed {seed} case {number} ({tokens}x{heads}x{dim} -> {str(dtype)[6:]})", codes, scales, dtype))
    return cases


@task(2, "dequantize")
def check_task_2(dequantize_int8) -> list[str]:
    cases = _code_cases(14, 40)
    cases.append(("scales differ per head", torch.tensor([[[127, -127], [127, -127]]], dtype=torch.int8),
                  torch.tensor([[[1.0], [0.001]]]), torch.float32))
    cases.append(("scales differ per token", torch.tensor([[[2, -3]], [[2, -3]]], dtype=torch.int8),
                  torch.tensor([[[0.5]], [[8.0]]], dtype=torch.float64), torch.float64))
    for seed in grade_time_seeds(FRESH_CASES):
        cases += _code_cases(seed, 10)
    for where, codes, scales, dtype in cases:
        with forbid(*REFERENCE):
            got = dequantize_int8(codes.clone(), scales.clone(), dtype)
        if not isinstance(got, torch.Tensor) or got.shape != codes.shape or got.dtype != dtype:
            shown = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise Fail(f"{where}: dequantize_int8 returned {shown}; expected {dtype} {tuple(codes.shape)}: the dtype "
                       "the caller asks for (the engine's K/V dtype)")
        want = _as_float(codes) * _as_float(scales)
        wrong = (_as_float(got) - want).abs() > TOLERANCE * want.abs() + 1e-30
        if wrong.any():
            t, h, d = [int(i) for i in torch.nonzero(wrong)[0]]
            raise Fail(f"{where}: element [{t}, {h}, {d}]: code {int(codes[t, h, d])}, scale {float(scales[t, h, 0]):.6g} "
                       f"gave {float(got[t, h, d]):.6g}; expected code x scale = {float(want[t, h, d]):.6g} (the scale "
                       "of that token and head)")
    return [f"{len(cases)} (codes, scales) pairs ({FRESH_CASES * 10} drawn as the check ran), float32 and float64 out: "
            "code x the scale of its token and head, in the dtype asked for"]


# --- task 3: StreamingLLM's keep-set ------------------------------------------------------------------------

KEEP_EDGES = [(1, 4, 1), (4, 4, 1), (5, 4, 1), (6, 4, 0), (6, 4, 3), (10, 4, 3), (100, 8, 4), (9, 8, 4),
              (8, 8, 4), (3, 8, 4), (2, 2, 0), (3, 2, 1), (1000, 64, 4), (65, 64, 4), (70, 10, 9)]


def _keep_cases(seed: int, count: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        budget = rng.randint(2, 80)
        out.append((rng.randint(1, 3 * budget), budget, rng.randint(0, budget - 1)))
    return out


@task(3, "StreamingLLM keep-set")
def check_task_3(streaming_keep_set) -> list[str]:
    cases = KEEP_EDGES + _keep_cases(14, 300)
    for seed in grade_time_seeds(FRESH_CASES):
        cases += _keep_cases(seed, 100)
    for seq_len, budget, sinks in cases:
        want = eviction.streaming_keep_positions(seq_len, budget, sinks).tolist()
        with forbid(*REFERENCE):
            got = streaming_keep_set(seq_len, budget, sinks)
        shown = f"streaming_keep_set(seq_len={seq_len}, budget={budget}, num_sinks={sinks})"
        try:
            got = [int(p) for p in got]
        except (TypeError, ValueError):
            raise Fail(f"{shown} returned {got!r}; return the kept positions, a list of ints") from None
        if len(got) != min(seq_len, budget):
            raise Fail(f"{shown} kept {len(got)} positions; expected min(seq_len, budget) = {min(seq_len, budget)}")
        if got != sorted(set(got)):
            raise Fail(f"{shown} returned {got[:12]}...: positions must be distinct and in increasing order")
        if got != want:
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            raise Fail(f"{shown}: missing {missing[:6]}, not to be kept {extra[:6]}: keep the first {sinks} (the "
                       f"sinks) and the last {budget - sinks} (the recent window) once the sequence is longer than "
                       "the budget, every position before that")
    return [f"{len(cases)} (seq_len, budget, num_sinks) cases ({len(KEEP_EDGES)} on the edges, {FRESH_CASES * 100} "
            "drawn as the check ran): the sinks plus the recent window, min(seq_len, budget) positions, in order"]


# --- task 4: both inside the engine -------------------------------------------------------------------------

PROMPTS = [[(i * 37 + 11 * j) % 4000 + 6 for i in range(24)] for j in range(3)]
NEW_TOKENS = 40
STREAMING = {"policy": "streaming", "budget_tokens": 16, "num_sinks": 4}


def _control_llm(model, **knobs):
    from minillm import LLM

    return LLM(model, dtype="float64", max_num_seqs=4, max_model_len=128, **knobs)


def _drawn_prompt() -> list[int]:
    """A prompt of the seeded ones' length, drawn when the check runs: the engine's answers cannot be known in advance."""
    rng = random.Random(grade_time_seeds(1)[0])
    return [rng.randrange(6, 4006) for _ in range(len(PROMPTS[0]))]


def _greedy(llm, prompts) -> list[list[int]]:
    from minillm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _written(llm) -> torch.Tensor:
    """The K and V values the run wrote: the pool's slots that are not all zero, [slots, heads, dim] per layer."""
    worker = llm.engine.executor.worker
    pool = torch.cat([worker.k_pool, worker.v_pool]).reshape(-1, *worker.k_pool.shape[2:])
    return pool[pool.abs().amax(dim=(1, 2)) > 0]


@task(4, "int8 KV and the keep-set in the engine", check_time_limit_s=240)
def check_task_4(kv_round_trip, streaming_keep_set) -> list[str]:
    from minillm.kv.quality import random_control_model

    model = random_control_model()
    prompts = [*PROMPTS, _drawn_prompt()]  # the seeded prompts and one drawn now
    reference = _control_llm(model, attention_backend="torch")
    simulated_quant.simulate_kv_dtype(reference, "int8")
    ref_tokens, ref_values = _greedy(reference, prompts), _written(reference)
    yours = _control_llm(model, attention_backend="torch")
    yours.engine.executor.worker.backend = simulated_quant.round_trip_backend(kv_round_trip)
    with forbid(*REFERENCE):
        tokens = _greedy(yours, prompts)
    values = _written(yours)
    if values.shape != ref_values.shape:
        raise Fail(f"your round trip left {values.shape[0]} written K/V rows in the pool, the reference "
                   f"{ref_values.shape[0]}: is a whole head coming back as zeros?")
    step = ref_values.abs().amax(dim=-1, keepdim=True) / 127
    codes = values / torch.where(step > 0, step, torch.ones_like(step))
    off_grid = (codes - codes.round()).abs() > 1e-6
    if off_grid.any():
        raise Fail(f"{int(off_grid.sum())} K/V values in the pool are not on their token and head's int8 grid "
                   "(largest |x| / 127): does kv_round_trip quantize, then dequantize, what it is given?")
    if ((values - ref_values).abs() > step * (1 + 1e-9)).any():
        raise Fail("K/V values in the pool differ from the reference's int8 round trip by more than a step")
    if tokens != ref_tokens:
        raise Fail(f"greedy tokens with your int8 KV differ from the reference's: {tokens[0][:10]} vs "
                   f"{ref_tokens[0][:10]} (first prompt)")
    seeded = len(PROMPTS)  # the PASS lines count the seeded prompts (the drawn one differs per run)
    exact = _greedy(_control_llm(model, attention_backend="torch"), PROMPTS)
    same_as_exact = sum(a == b for x, y in zip(tokens[:seeded], exact) for a, b in zip(x, y))

    ref_evict = _control_llm(model, kv_eviction=STREAMING)
    ref_evict_tokens = _greedy(ref_evict, prompts)
    ref_evicted = ref_evict.engine.executor.worker.eviction.evicted_tokens
    evicting = _control_llm(model, kv_eviction=STREAMING)
    tracker = evicting.engine.executor.worker.eviction
    tracker.streaming_keep = streaming_keep_set
    with forbid(*REFERENCE):
        evict_tokens = _greedy(evicting, prompts)
    if tracker.evicted_tokens != ref_evicted or evict_tokens != ref_evict_tokens:
        raise Fail(f"with your keep-set the engine evicted {tracker.evicted_tokens} tokens (the library's keep-set: "
                   f"{ref_evicted}) and its greedy tokens {'equal' if evict_tokens == ref_evict_tokens else 'differ'}")
    total = seeded * NEW_TOKENS
    return [f"int8 KV through your round trip: {values.numel()} K/V values on their int8 grid, equal to the reference's; "
            f"greedy tokens equal the reference engine's ({same_as_exact}/{total} on the {seeded} seeded prompts equal "
            "to the exact float64 cache's), and on a prompt drawn now",
            f"StreamingLLM, budget {STREAMING['budget_tokens']} with {STREAMING['num_sinks']} sinks, your keep-set: "
            f"{tracker.evicted_tokens} tokens evicted, greedy tokens equal the library's on {seeded} seeded prompts "
            "and one drawn now"]
