"""Every numba.cuda kernel against its torch reference, on numba's CUDA simulator (chapter 10).

Run by tests/test_kernels.py in a fresh process with NUMBA_ENABLE_CUDASIM=1 (the variable must be
set before numba is first imported). Shapes are small and ragged: scattered block tables, partial
last blocks, GQA, lengths 1 and block_size ± 1, -1 padding that must never be read. Also checks
that the engine on attention_backend="numba" generates the torch backend's greedy tokens, and that a
decode step padded to a CUDA-graph bucket (minillm.kernels.cuda_graphs) leaves the real rows as
they were.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run me with NUMBA_ENABLE_CUDASIM=1"
sys.setswitchinterval(1e-4)

import torch  # noqa: E402
from minillm.kernels.cache_write import reshape_and_cache_reference  # noqa: E402
from minillm.kernels.decode_attention import paged_attention_decode_reference  # noqa: E402
from minillm.kernels.rmsnorm import rms_norm_reference  # noqa: E402
from minillm.kernels.rope import rotary_embedding_reference  # noqa: E402
from minillm.kernels.varlen_attention import prefill_attention_reference  # noqa: E402

from minillm import kernels  # noqa: E402

g = torch.Generator().manual_seed(0)
BS, HKV, HQ, D, NB = 4, 2, 4, 8, 24


def scattered_tables(lens: list[int]) -> torch.Tensor:
    """Block tables over a shuffled pool, -1 after each sequence's last block; the pool's unused
    blocks are filled with NaN by the callers, so reading one would show."""
    order = torch.randperm(NB, generator=g).tolist()
    width = max(-(-n // BS) for n in lens)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        need = -(-n // BS)
        tables[b, :need] = torch.tensor([order.pop() for _ in range(need)], dtype=torch.int32)
    return tables


def pools(tables: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((NB, BS, HKV, D), float("nan"))
    v = torch.full((NB, BS, HKV, D), float("nan"))
    for b, n in enumerate(lens):
        for p in range(n):
            blk = int(tables[b, p // BS])
            k[blk, p % BS] = torch.randn(HKV, D, generator=g)
            v[blk, p % BS] = torch.randn(HKV, D, generator=g)
    return k, v


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item()
    ok = bool(torch.isfinite(got).all()) and err < 1e-5
    print(f"{'PASS' if ok else 'FAIL'} {name}: max |error| {err:.2e}")
    if not ok:
        sys.exit(1)


# reshape_and_cache: scattered slots, one skipped (-1)
key, value = torch.randn(6, HKV, D, generator=g), torch.randn(6, HKV, D, generator=g)
slots = torch.tensor([5, 0, 17, -1, 93, 42])
kc, vc = torch.zeros(NB, BS, HKV, D), torch.zeros(NB, BS, HKV, D)
rk, rv = kc.clone(), vc.clone()
kernels.reshape_and_cache(key, value, kc, vc, slots)
reshape_and_cache_reference(key, value, rk, rv, slots)
check("reshape_and_cache", torch.cat([kc, vc]), torch.cat([rk, rv]))

# paged_attention_decode: lengths 1, bs-1, bs, bs+1, a long one
lens = [1, BS - 1, BS, BS + 1, 13]
tables = scattered_tables(lens)
kp, vp = pools(tables, lens)
q = torch.randn(len(lens), HQ, D, generator=g)
seq_lens = torch.tensor(lens, dtype=torch.int32)
check("paged_attention_decode", kernels.paged_attention_decode(q, kp, vp, tables, seq_lens, D**-0.5),
      paged_attention_decode_reference(q, kp, vp, tables, seq_lens, D**-0.5))

# paged_attention_decode_warp: the simulator has no warp shuffles, so this check gives it one: a
# shfl_xor_sync that meets the warp's 32 threads at a barrier and hands each the value of lane ^ mask.
# The kernel's warp-level logic (lanes taking every 32nd key, the butterfly merge, lanes without
# keys) runs as written; what the GPU adds is speed, measured by bench/gpu.py.
import threading  # noqa: E402

from minillm.kernels._launch import device_array  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda.simulator import kernelapi  # noqa: E402

from minillm.kernels import decode_attention_warp  # noqa: E402
from minillm.kernels.scenarios import paged_scenario  # noqa: E402

_warps, _warps_lock = {}, threading.Lock()


def _shfl_xor_sync(self, mask, value, lane_mask):
    me = threading.current_thread()
    with _warps_lock:
        barrier, values = _warps.setdefault((tuple(me.blockIdx), me.thread_id // 32),
                                            (threading.Barrier(32), [None] * 32))
    values[me.thread_id % 32] = value
    barrier.wait()
    got = values[(me.thread_id % 32) ^ lane_mask]
    barrier.wait()
    return got


kernelapi.FakeCUDAModule.shfl_xor_sync = _shfl_xor_sync
warp_case = paged_scenario([1, 6, 40], block_size=4, num_blocks=16, kv_heads=1, q_heads=2, head_dim=8, seed=4,
                           logit_scale=3.0)
warp_out = torch.full_like(warp_case.query, float("nan"))
num_warps = warp_case.query.shape[0] * warp_case.query.shape[1]
cuda.jit(decode_attention_warp.python_function)[
    -(-num_warps // decode_attention_warp.WARPS_PER_BLOCK), 32 * decode_attention_warp.WARPS_PER_BLOCK](
    *[device_array(a) if isinstance(a, torch.Tensor) else a for a in warp_case.args()], device_array(warp_out))
check("paged_attention_decode_warp (shuffles emulated)", warp_out,
      paged_attention_decode_reference(*warp_case.args()))

# prefill_attention: a fresh prompt, a chunk after a cached prefix, a speculative row, one token
lens = [6, 11, 9, 1]
q_lens = [6, 3, 4, 1]
tables = scattered_tables(lens)
kp, vp = pools(tables, lens)
qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
q = torch.randn(sum(q_lens), HQ, D, generator=g)
seq_lens = torch.tensor(lens, dtype=torch.int32)
check("prefill_attention", kernels.prefill_attention(q, kp, vp, tables, qsl, seq_lens, D**-0.5),
      prefill_attention_reference(q, kp, vp, tables, qsl, seq_lens, D**-0.5))

# rms_norm
x, w = torch.randn(5, 24, generator=g), torch.randn(24, generator=g)
check("rms_norm", kernels.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))

# rotary_embedding, both conventions
angles = torch.arange(32)[:, None].float() * (1e4 ** (-torch.arange(0, D, 2).float() / D))[None, :]
cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
positions = torch.tensor([0, 3, 31, 7])
for neox in (True, False):
    qa, ka = torch.randn(4, HQ, D, generator=g), torch.randn(4, HKV, D, generator=g)
    qb, kb = qa.clone(), ka.clone()
    kernels.rotary_embedding(positions, qa, ka, cos_sin, is_neox=neox)
    rotary_embedding_reference(positions, qb, kb, cos_sin, is_neox=neox)
    check(f"rotary_embedding (is_neox={neox})", torch.cat([qa.flatten(), ka.flatten()]),
          torch.cat([qb.flatten(), kb.flatten()]))

# the engine on the kernels: same greedy tokens as the torch backend (bundled model, float32)
from minillm import LLM, SamplingParams  # noqa: E402

prompts = ["In the beginning", "And God said", "Blessed"]
params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
knobs = dict(max_num_seqs=3, block_size=8, num_kv_blocks=24, max_model_len=64)
torch_tokens = [o.outputs[0].token_ids for o in LLM(attention_backend="torch", **knobs).generate(prompts, params,
                                                                                                  use_tqdm=False)]
numba_tokens = [o.outputs[0].token_ids for o in LLM(attention_backend="numba", **knobs).generate(prompts, params,
                                                                                                  use_tqdm=False)]
same = numba_tokens == torch_tokens
print(f"{'PASS' if same else 'FAIL'} engine attention_backend='numba' == 'torch': {numba_tokens}")
if not same:
    sys.exit(1)

# CUDA-graph buckets (minillm.kernels.cuda_graphs): a decode step padded to a bucket and to a wider
# table gives the real rows the same logits and writes the same K/V (padding rows write nothing).
from minillm.kernels.cuda_graphs import DecodeInputs, decode_forward, pad_decode_inputs, pick_bucket  # noqa: E402

llm = LLM(attention_backend="numba", **knobs)
for text in prompts:
    llm.engine.add_request(text, params)
llm.engine.step()  # the prompts' prefill; the next plan is a decode step of 3 sequences
engine = llm.engine
input_ids, positions, meta, _ = engine.executor.prepare(engine.scheduler.schedule(engine.clock.now()))
assert meta.num_decode == len(prompts) == input_ids.shape[0], "expected a decode-only step"
decode = DecodeInputs(input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
model, kv = engine.executor.worker.model, engine.executor.worker  # the worker holds the pools
pools = kv.k_pool.clone(), kv.v_pool.clone()
want = decode_forward(model, kv.k_pool, kv.v_pool, decode, kv.block_size)
written = kv.k_pool.clone(), kv.v_pool.clone()
kv.k_pool.copy_(pools[0])
kv.v_pool.copy_(pools[1])
bucket = pick_bucket(decode.batch_size, (1, 2, 4, 8))
padded = pad_decode_inputs(decode, bucket, decode.block_tables.shape[1] + 2, kv.null_block)
got = decode_forward(model, kv.k_pool, kv.v_pool, padded, kv.block_size)
# (a matmul over 4 rows may round differently from one over 3: equal within float32 noise, not bitwise)
same_pool = all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip((kv.k_pool, kv.v_pool), written))
null = slice(kv.null_block * kv.block_size, (kv.null_block + 1) * kv.block_size)
null_untouched = not kv.k_pool[:, null].any() and not kv.v_pool[:, null].any()
err = (got[: decode.batch_size] - want).abs().max().item()
ok = (bucket == 4 and got.shape[0] == 4 and err < 1e-4 and same_pool and null_untouched
      and bool(torch.isfinite(got).all()))
print(f"{'PASS' if ok else 'FAIL'} decode step padded {decode.batch_size} -> bucket {bucket}, table width "
      f"{decode.block_tables.shape[1]} -> {padded.block_tables.shape[1]}: max |logit error| {err:.1e}, "
      f"same K/V written: {same_pool}, null block still zero: {null_untouched}")
sys.exit(0 if ok else 1)
