"""The quantized-KV numba.cuda kernels against their torch references, on numba's CUDA simulator (chapter 14).

Run by tests/test_kv_quant_kernels.py in a fresh process with NUMBA_ENABLE_CUDASIM=1. The simulator
runs a thread in ~70 µs, so shapes are tiny (blocks of 4, 2 KV heads, D = 8: a few hundred threads
per launch) and each kernel runs once per dtype; the whole script takes well under a minute alone.
Ragged lengths (1, block_size ± 1, a long one) over a shuffled pool whose unused blocks hold bytes
0xFF — NaN both as an FP8 code and as an int8 row's float32 scale — so a read past a sequence's end
would show. Then the engine on attention_backend="numba" must generate the torch backend's greedy
tokens with the same kv_cache_dtype.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run me with NUMBA_ENABLE_CUDASIM=1"
sys.setswitchinterval(1e-4)

import torch  # noqa: E402
from minillm.kernels.quantized_kv import (  # noqa: E402
    paged_attention_decode_quantized_reference,
    prefill_attention_quantized_reference,
    reshape_and_cache_quantized_reference,
)

from minillm import kernels  # noqa: E402
from minillm.kv.quant import encode, kv_format  # noqa: E402

g = torch.Generator().manual_seed(0)
BS, HKV, HQ, D, NB = 4, 2, 4, 8, 24
TOLERANCE = 1e-5  # kernel and reference decode every byte to the same float; only the sums' order differs


def scattered_tables(lens: list[int]) -> torch.Tensor:
    order = torch.randperm(NB, generator=g).tolist()
    tables = torch.full((len(lens), max(-(-n // BS) for n in lens)), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        need = -(-n // BS)
        tables[b, :need] = torch.tensor([order.pop() for _ in range(need)], dtype=torch.int32)
    return tables


def quantized_pools(tables: torch.Tensor, lens: list[int], dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pools of bytes 0xFF (NaN when decoded) except the sequences' own slots, written by torch's encoder."""
    fmt = kv_format(dtype)
    k = torch.full((NB, BS, HKV, fmt.row_bytes(D)), 255, dtype=torch.uint8)
    v = k.clone()
    for b, n in enumerate(lens):
        for p in range(n):
            blk = int(tables[b, p // BS])
            k[blk, p % BS] = encode(torch.randn(HKV, D, generator=g) * 3, fmt)
            v[blk, p % BS] = encode(torch.randn(HKV, D, generator=g), fmt)
    return k, v


def check(name: str, got: torch.Tensor, want: torch.Tensor, tolerance: float = TOLERANCE) -> None:
    err = (got.float() - want.float()).abs().max().item()
    ok = bool(torch.isfinite(got.float()).all()) and err <= tolerance
    print(f"{'PASS' if ok else 'FAIL'} {name}: max |error| {err:.2e}")
    if not ok:
        sys.exit(1)


for dtype in ("int8", "fp8_e4m3"):
    fmt = kv_format(dtype)
    # the write: scattered slots, one skipped (-1), one all-zero row (its scale must be 1, not 0/0)
    key, value = torch.randn(6, HKV, D, generator=g) * 4, torch.randn(6, HKV, D, generator=g)
    key[2, 1] = 0.0
    # FP8's edges: -0, subnormals (one a tie), a mantissa tie, the largest, two that saturate
    key[4, 0] = torch.tensor([-0.0, 2.5 * 2**-9, 0.0117, 1.0625, -3.3, 447.0, 500.0, -600.0])
    slots = torch.tensor([5, 0, 17, -1, 93, 42])
    kc = torch.zeros(NB, BS, HKV, fmt.row_bytes(D), dtype=torch.uint8)
    vc, rk, rv = kc.clone(), kc.clone(), kc.clone()
    kernels.reshape_and_cache_quantized(key, value, kc, vc, slots, dtype)
    reshape_and_cache_quantized_reference(key, value, rk, rv, slots, dtype)
    check(f"reshape_and_cache_quantized {dtype} (bytes equal torch's)", torch.cat([kc, vc]), torch.cat([rk, rv]), 0)

    lens = [1, BS - 1, BS, BS + 1, 13]
    tables = scattered_tables(lens)
    kp, vp = quantized_pools(tables, lens, dtype)
    q = torch.randn(len(lens), HQ, D, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    check(f"paged_attention_decode_quantized {dtype}",
          kernels.paged_attention_decode_quantized(q, kp, vp, tables, seq_lens, D**-0.5, dtype),
          paged_attention_decode_quantized_reference(q, kp, vp, tables, seq_lens, D**-0.5, dtype))

    lens, q_lens = [6, 11, 9, 1], [6, 3, 4, 1]  # a fresh prompt, a chunk after a prefix, a speculative row, one token
    tables = scattered_tables(lens)
    kp, vp = quantized_pools(tables, lens, dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), HQ, D, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    check(f"prefill_attention_quantized {dtype}",
          kernels.prefill_attention_quantized(q, kp, vp, tables, qsl, seq_lens, D**-0.5, dtype),
          prefill_attention_quantized_reference(q, kp, vp, tables, qsl, seq_lens, D**-0.5, dtype))

# the engine on the kernels: the torch backend's greedy tokens, per kv_cache_dtype (bundled model, float32)
from minillm import LLM, SamplingParams  # noqa: E402

prompts = ["In the beginning", "And God said", "Blessed"]
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
knobs = dict(max_num_seqs=3, block_size=8, num_kv_blocks=24, max_model_len=64)
for dtype in ("int8", "fp8_e4m3"):
    tokens = {backend: [o.outputs[0].token_ids for o in LLM(attention_backend=backend, kv_cache_dtype=dtype, **knobs)
                        .generate(prompts, params, use_tqdm=False)] for backend in ("torch", "numba")}
    same = tokens["numba"] == tokens["torch"]
    print(f"{'PASS' if same else 'FAIL'} engine kv_cache_dtype={dtype!r}: attention_backend='numba' == 'torch': "
          f"{tokens['numba']}")
    if not same:
        sys.exit(1)
