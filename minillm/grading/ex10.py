"""Grader of exercise 10: the learner's paged decode attention kernel (chapter 10).

The learner writes the body of a numba.cuda kernel with the signature of minillm's own,

    def kernel(query, key_cache, value_cache, block_tables, seq_lens, scale, out)

launched with one thread per (sequence, query head): thread i = cuda.grid(1) serves sequence
i // H_q and query head i % H_q. The checks:

- task 1: in numba's CUDA simulator (or on the GPU, where there is one), on ragged GQA batches
  built by `minillm.kernels.scenarios.paged_scenario` (scattered blocks, partial last blocks,
  lengths 1 and block_size ± 1, -1 padded tables, NaN in every slot no sequence owns, one batch
  with logits beyond exp()'s range), against the torch reference;
- task 2: the same source compiles to PTX for sm_90 (a subprocess without the simulator, which has
  no compiler): a kernel that only works as Python, e.g. one that calls torch, fails here;
- task 3: plugged into the engine (`attention_backend="numba"`), it serves every decode row of the
  bundled model and the greedy tokens equal the torch backend's.

`KNOWN_WRONG` holds kernels with the bugs the exercise is about; the grader must fail each of them
(chapter 10, section 6, runs them too).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from numba import cuda, float32

from minillm.kernels._launch import device_array, launch
from minillm.kernels.scenarios import PagedScenario, paged_scenario

MAX_HEAD_DIM = 64  # the learner's accumulator: cuda.local.array(MAX_HEAD_DIM, float32)
# Name, arguments of paged_scenario. Ragged lengths around the block size, GQA 2:1, MQA 4:1 with a
# wide table, 3:1 with logits up to ~3000 (exp() of them overflows without the running max).
CASES: tuple[tuple[str, dict], ...] = (
    ("lengths 1, bs-1, bs, bs+1, 13; GQA 4:2", dict(seq_lens=[1, 3, 4, 5, 13], block_size=4, num_blocks=16,
                                                    kv_heads=2, q_heads=4, head_dim=8, seed=10)),
    ("block_size 8, MQA 4:1, -1 padded width", dict(seq_lens=[7, 2, 16, 9], block_size=8, num_blocks=10,
                                                    kv_heads=1, q_heads=4, head_dim=4, seed=11,
                                                    extra_table_width=2)),
    ("large logits, GQA 6:2", dict(seq_lens=[5, 12, 3], block_size=4, num_blocks=10, kv_heads=2, q_heads=6,
                                   head_dim=8, seed=12, logit_scale=1000.0)),
)
ATOL = RTOL = 1e-4
_THREAD_ID = re.compile(r"tid=\[[^\]]*\] ctaid=\[[^\]]*\]:\s*")  # which thread failed first varies
PTX_PREAMBLE = "import math\n\nfrom numba import cuda, float32, int32\n\nMAX_HEAD_DIM = {max_head_dim}\n\n"


def run_decode_kernel(python_function: Callable, query, key_cache, value_cache, block_tables, seq_lens,
                      scale: float) -> torch.Tensor:
    """Launch `python_function` as a numba.cuda kernel, one thread per (sequence, query head); on CPU."""
    if not callable(python_function):
        raise TypeError(f"expected the kernel's Python function, got {type(python_function).__name__}")
    out = torch.full_like(query, float("nan"))  # a thread that writes nothing leaves NaN
    launch(cuda.jit(python_function), query.shape[0] * query.shape[1], device_array(query), device_array(key_cache),
           device_array(value_cache), device_array(block_tables), device_array(seq_lens), float(scale),
           device_array(out))
    return out.cpu()


def scenarios(device: str = "cpu") -> list[tuple[str, PagedScenario]]:
    return [(name, paged_scenario(**kwargs).to(device)) for name, kwargs in CASES]


def check_kernel(python_function: Callable, device: str = "cpu") -> tuple[bool, list[str]]:
    """Task 1: (passed, one line per case)."""
    from minillm.kernels.decode_attention import paged_attention_decode_reference

    lines, passed = [], True
    for name, case in scenarios(device):
        want = paged_attention_decode_reference(*case.to("cpu").args())
        try:
            with warnings.catch_warnings():  # numpy's overflow warnings, from the simulator's threads
                warnings.simplefilter("ignore", RuntimeWarning)
                got = run_decode_kernel(python_function, *case.args())
        except Exception as error:  # the simulator raises on what a GPU would get silently wrong
            passed = False
            message = _THREAD_ID.sub("", (str(error).splitlines() or [""])[0])[:120]
            lines.append(f"{name}: {type(error).__name__}: {message}")
            continue
        if got.isnan().any():
            passed = False
            lines.append(f"{name}: NaN in {int(got.isnan().any(-1).sum())} of {got.shape[0] * got.shape[1]} "
                         "(sequence, head) outputs: a slot past a sequence's end or a -1 block was read")
        elif not torch.allclose(got, want, atol=ATOL, rtol=RTOL):
            err = (got - want).abs()
            b, h = divmod(int(err.amax(-1).argmax()), got.shape[1])
            passed = False
            lines.append(f"{name}: max |error| {err.max():.3g} (first at sequence {b}, query head {h})")
        else:
            lines.append(f"{name}: matches the reference")
    return passed, lines


def kernel_source(python_function: Callable) -> str:
    """The function's source (IPython keeps notebook cells' sources, so this works for them too)."""
    return textwrap.dedent(inspect.getsource(python_function))


def compile_to_ptx(source: str, name: str, cc: int = 90, max_head_dim: int = MAX_HEAD_DIM,
                   timeout_s: float = 300) -> tuple[bool, str]:
    """Task 2: compile the kernel's source for sm_<cc> in a fresh process without the simulator."""
    with tempfile.TemporaryDirectory() as tmp:
        module = Path(tmp) / "learner_kernel.py"
        module.write_text(PTX_PREAMBLE.format(max_head_dim=max_head_dim) + source)
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {tmp!r})
            from numba import cuda, types
            import learner_kernel
            f32_3, f32_4 = types.Array(types.float32, 3, "C"), types.Array(types.float32, 4, "C")
            sig = (f32_3, f32_4, f32_4, types.Array(types.int32, 2, "C"), types.Array(types.int32, 1, "C"),
                   types.float32, f32_3)
            ptx, _ = cuda.compile_ptx(getattr(learner_kernel, {name!r}), sig, cc=({cc // 10}, {cc % 10}))
            print(ptx.count(".entry"), len(ptx.splitlines()))
        """)
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    if proc.returncode != 0:
        last = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["(no message)"]
        return False, f"does not compile for sm_{cc}: {last[0][:200]}"
    entries, lines = (int(x) for x in proc.stdout.split())
    return entries == 1, f"compiles for sm_{cc}: one kernel entry" if entries == 1 else f"{entries} entries"


@contextlib.contextmanager
def engine_decode_kernel(python_function: Callable):
    """Inside the block, minillm's paged_attention_decode launches `python_function` instead of its own."""
    from minillm.kernels import decode_attention

    own = decode_attention.kernel
    decode_attention.kernel = cuda.jit(python_function)
    try:
        yield
    finally:
        decode_attention.kernel = own


def check_in_engine(python_function: Callable, device: str = "cpu") -> tuple[bool, list[str]]:
    """Task 3: greedy tokens of the bundled model, decode rows on the learner's kernel, == torch backend."""
    from minillm import LLM, SamplingParams

    prompts = ["In the beginning", "And God said", "Blessed"]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    knobs = dict(max_num_seqs=3, block_size=4, num_kv_blocks=24, max_model_len=32, device=device)
    want = [o.outputs[0].token_ids for o in LLM(attention_backend="torch", **knobs).generate(prompts, greedy,
                                                                                             use_tqdm=False)]
    calls = []
    from minillm.kernels import decode_attention

    launched = decode_attention.launch

    def counting_launch(kernel, *args):
        calls.append(kernel)
        return launched(kernel, *args)

    with engine_decode_kernel(python_function):
        mine = decode_attention.kernel
        decode_attention.launch = counting_launch
        try:
            got = [o.outputs[0].token_ids for o in LLM(attention_backend="numba", **knobs).generate(
                prompts, greedy, use_tqdm=False)]
        finally:
            decode_attention.launch = launched
    used = sum(k is mine for k in calls)
    lines = [f"decode launches on your kernel: {used}", f"greedy tokens equal the torch backend's: {got == want}"]
    return used > 0 and got == want, lines


# ---- known-wrong kernels: minillm's kernel with one bug each (all compile; task 1 must catch them) ----

def _no_partial_block_mask(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m, total = -math.inf, 0.0
    for p in range((seq_lens[b] + bs - 1) // bs * bs):  # BUG: every slot of the last block, past the end too
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        m_new = max(m, s)
        correction, weight = math.exp(m - m_new), math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * value_cache[block, off, kv_head, d]
        m = m_new
    for d in range(dim):
        out[b, h, d] = acc[d] / total


def _wrong_gqa_mapping(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h % key_cache.shape[2]  # BUG: interleaves query heads over KV heads; HF groups neighbours
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m, total = -math.inf, 0.0
    for p in range(seq_lens[b]):
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        m_new = max(m, s)
        correction, weight = math.exp(m - m_new), math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * value_cache[block, off, kv_head, d]
        m = m_new
    for d in range(dim):
        out[b, h, d] = acc[d] / total


def _no_running_max(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    total = 0.0
    for p in range(seq_lens[b]):
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        weight = math.exp(s * scale)  # BUG: no max subtracted: overflows past ~88 (float32), ~709 (float64)
        total += weight
        for d in range(dim):
            acc[d] += weight * value_cache[block, off, kv_head, d]
    for d in range(dim):
        out[b, h, d] = acc[d] / total


def _max_without_rescale(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m, total = -math.inf, 0.0
    for p in range(seq_lens[b]):
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        m = max(m, s)
        weight = math.exp(s - m)  # BUG: the sums so far were taken against a smaller max and are not rescaled
        total += weight
        for d in range(dim):
            acc[d] += weight * value_cache[block, off, kv_head, d]
    for d in range(dim):
        out[b, h, d] = acc[d] / total


def _reads_padding(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
    i = cuda.grid(1)
    num_seqs, q_heads, dim = query.shape
    if i >= num_seqs * q_heads:
        return
    b, h = i // q_heads, i % q_heads
    kv_head = h // (q_heads // key_cache.shape[2])
    bs = key_cache.shape[1]
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for d in range(dim):
        acc[d] = 0.0
    m, total = -math.inf, 0.0
    for p in range(block_tables.shape[1] * bs):  # BUG: the whole table width, -1 entries included ...
        block, off = block_tables[b, p // bs], p % bs
        s = 0.0
        for d in range(dim):
            s += query[b, h, d] * key_cache[block, off, kv_head, d]
        s *= scale
        if p >= seq_lens[b]:
            s = -math.inf  # ... masked after the read; the value is read anyway (0 · NaN = NaN)
        m_new = max(m, s)
        correction, weight = math.exp(m - m_new), math.exp(s - m_new)
        total = total * correction + weight
        for d in range(dim):
            acc[d] = acc[d] * correction + weight * value_cache[block, off, kv_head, d]
        m = m_new
    for d in range(dim):
        out[b, h, d] = acc[d] / total


KNOWN_WRONG: dict[str, Callable] = {
    "no partial-block mask": _no_partial_block_mask,
    "wrong GQA head mapping": _wrong_gqa_mapping,
    "softmax without a max": _no_running_max,
    "max kept, never rescaled": _max_without_rescale,
    "reads the -1 padding": _reads_padding,
}
