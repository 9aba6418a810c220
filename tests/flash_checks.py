"""The tiled attention kernel (kernels/tiled_attention.py) on numba's CUDA simulator (chapter 10).

Run by tests/test_flash_attention.py in a fresh process with NUMBA_ENABLE_CUDASIM=1. Prints one
PASS/FAIL line per check and exits non-zero on the first FAIL:

- flash_attention equals its reference (and prefill_attention's) on ragged varlen batches: a fresh
  prompt, a chunk after a cached prefix, a speculative row, one token, a long prompt; GQA 2:1 and
  MQA 6:1; tiles that divide nothing (3 x 5), several query and key tiles per sequence, logits in
  the hundreds (the running max rescaled across tiles); pools poisoned with NaN outside the
  sequences;
- a traced run: no shared-memory race, no negative index, every output element written once;
- the HBM bytes measured by tracing both kernels equal the count from their loop bounds.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run me with NUMBA_ENABLE_CUDASIM=1"
sys.setswitchinterval(1e-4)

import torch  # noqa: E402

from minillm.kernels import tiled_attention as fa  # noqa: E402
from minillm.kernels.io_measured import expected_elements, measure_attention_io  # noqa: E402
from minillm.kernels.scenarios import paged_scenario  # noqa: E402
from minillm.kernels.trace import trace_launch  # noqa: E402


def case(lens, q_lens, kv_heads, q_heads, head_dim, block_size, seed, logit_scale=1.0):
    need = sum(-(-n // block_size) for n in lens) + 1
    s = paged_scenario(lens, block_size=block_size, num_blocks=need + 2, kv_heads=kv_heads, q_heads=q_heads,
                       head_dim=head_dim, seed=seed, extra_table_width=1)
    query = torch.randn(sum(q_lens), q_heads, head_dim, generator=torch.Generator().manual_seed(seed)) * logit_scale
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return [query, s.key_cache, s.value_cache, s.block_tables, qsl, s.seq_lens, s.scale]


def verdict(ok: bool, line: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {line}")
    if not ok:
        sys.exit(1)


CASES = [
    # (label, lens, q_lens, kv_heads, q_heads, head_dim, block_size, seed, logit_scale, (block_m, block_n))
    ("fresh 6, chunk 3 after 8 cached, spec 4 after 5, one token, fresh 13; GQA 4:2; 4x4 tiles",
     [6, 11, 9, 1, 13], [6, 3, 4, 1, 13], 2, 4, 8, 4, 0, 1.0, (4, 4)),
    ("same batch, tiles 3x5 (divide nothing)", [6, 11, 9, 1, 13], [6, 3, 4, 1, 13], 2, 4, 8, 4, 0, 1.0, (3, 5)),
    ("MQA 6:1, block_size 8, chunk 7 after 12, logits x30", [19, 5], [7, 5], 1, 6, 4, 8, 1, 30.0, (2, 8)),
    ("default 16x16 tiles, 21-token prompt and a 2-token chunk", [21, 18], [21, 2], 2, 2, 8, 4, 2, 1.0,
     (fa.BLOCK_M, fa.BLOCK_N)),
]

for label, lens, q_lens, hkv, hq, d, bs, seed, logit_scale, (bm, bn) in CASES:
    args = case(lens, q_lens, hkv, hq, d, bs, seed, logit_scale)
    want = fa.flash_attention_reference(*args)
    got = fa.flash_attention(*args, block_m=bm, block_n=bn)
    err = (got - want).abs().max().item()
    verdict(bool(torch.isfinite(got).all()) and err < 1e-4,
            f"flash_attention == reference: {label}: max |error| {err:.1e}")

# a traced run of the first case: no race, no wrapped index, every output written exactly once
args = case(*CASES[0][1:9])
out = torch.full_like(args[0], float("nan"))
grid, threads = fa.launch_shape(args[4], args[0].shape[1], args[1].shape[2], 4)
trace = trace_launch(fa.kernel_for(4, 4), grid, threads, [*args, out])
writes = [count for per_thread in trace.accesses["out", "w"].values() for count in per_thread.values()]
ok = (not trace.races() and not trace.wrapped and len(writes) == out.numel() and set(writes) == {1}
      and torch.allclose(out, fa.flash_attention_reference(*args), atol=1e-4))
verdict(ok, f"traced: {len(trace.threads())} threads, {len(writes)} outputs written once each, races "
            f"{trace.races()[:1]}, negative indices {trace.wrapped[:1]}")

# HBM bytes: the traced count equals the loop-bound arithmetic, and the tiled kernel reads K/V less
for n, hq, hkv, bm in ((20, 4, 2, 8), (9, 3, 1, 4)):
    measured = measure_attention_io(seq_len=n, q_heads=hq, kv_heads=hkv, head_dim=4, block_m=bm, block_n=4)
    expected = expected_elements(n, hq, hkv, 4, bm)
    got = {k: {a: measured[k][a]["written" if a == "out" else "read"] // 4 for a in expected[k]}
           for k in ("prefill_attention", "flash_attention")}
    kv = {k: got[k]["key_cache"] for k in got}
    verdict(all(got[k] == expected[k] for k in got) and kv["flash_attention"] < kv["prefill_attention"],
            f"HBM elements, N={n}, {hq}:{hkv} heads, tiles of {bm}: measured {got} == loop-bound count")

# the launch shape, and what the launcher refuses
qsl = torch.tensor([0, 6, 9, 13, 14], dtype=torch.int32)  # query lengths 6, 3, 4, 1
shape = fa.launch_shape(qsl, q_heads=4, kv_heads=2, block_m=4)
refused = []
table = torch.zeros(1, 1, dtype=torch.int32)
for label, call in (
        ("multiple of KV heads", lambda: fa.flash_attention(torch.zeros(3, 4, 8), torch.zeros(2, 4, 3, 8),
                                                           torch.zeros(2, 4, 3, 8), table, qsl[:2], qsl[1:2], 1.0)),
        ("head_dim 200 > 128", lambda: fa.flash_attention(torch.zeros(3, 4, 200), torch.zeros(2, 4, 2, 200),
                                                         torch.zeros(2, 4, 2, 200), table, qsl[:2], qsl[1:2], 1.0)),
        ("<= 1024 threads", lambda: fa.flash_attention(torch.zeros(3, 64, 8), torch.zeros(2, 4, 1, 8),
                                                      torch.zeros(2, 4, 1, 8), table, qsl[:2], qsl[1:2], 1.0,
                                                      block_m=32))):
    try:
        call()
    except ValueError as error:
        refused.append(label in str(error))
verdict(shape == ((2, 4, 2), 8) and refused == [True, True, True],
        f"launch shape {shape} (2 query tiles x 4 sequences x 2 KV heads, 4 rows x 2 heads per block); "
        f"bad shapes refused with a message: {refused}")

# the table chapter 10 prints: both kernels' rows and the K/V ratio, from the same measurement
from minillm.kernels.io_measured import io_report  # noqa: E402

lines = io_report(seq_len=12, q_heads=2, kv_heads=1, head_dim=4, block_m=4, block_n=4)
rows = {line.split()[0]: line for line in lines[2:4]}
ratio = float(lines[4].split("untiled / tiled: ")[1].split("x")[0])
verdict(set(rows) == {"prefill_attention", "flash_attention"} and 1 < ratio <= 8,
        f"io_report: {lines[4][:60]}")
