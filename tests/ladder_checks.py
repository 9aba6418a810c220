"""The ladder's checkers (minillm.kernels.ladder) on numba's CUDA simulator: a right kernel per rung
passes, and wrong ones fail, each for its own reason (a missing guard, a missing barrier found as
a race whatever the timing, no shared memory, a serial reduction, 0 as a max's padding, no running
max, two passes). Run by tests/test_ladder.py with NUMBA_ENABLE_CUDASIM=1; prints PASS/FAIL lines."""

from __future__ import annotations

import math
import os
import sys

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run me with NUMBA_ENABLE_CUDASIM=1"
sys.setswitchinterval(1e-4)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
from numba import cuda, float32  # noqa: E402

from minillm.kernels import ladder  # noqa: E402
from minillm.kernels.ladder import HALO, TPB  # noqa: E402


def broadcast_add(a, b, out):
    i, j = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        out[i, j] = a[i] + b[j]


def broadcast_add_unguarded(a, b, out):
    i, j = cuda.grid(2)
    out[i, j] = a[i] + b[j]


def window_sum(a, out):
    tile = cuda.shared.array(TPB + HALO, float32)
    i = cuda.grid(1)
    local = cuda.threadIdx.x
    tile[local + HALO] = a[i] if i < a.size else 0.0
    if local < HALO:
        tile[local] = a[i - HALO] if i >= HALO else 0.0
    cuda.syncthreads()
    if i < a.size:
        out[i] = tile[local] + tile[local + 1] + tile[local + 2]


def window_sum_no_barrier(a, out):
    tile = cuda.shared.array(TPB + HALO, float32)
    i = cuda.grid(1)
    local = cuda.threadIdx.x
    tile[local + HALO] = a[i] if i < a.size else 0.0
    if local < HALO:
        tile[local] = a[i - HALO] if i >= HALO else 0.0
    if i < a.size:
        out[i] = tile[local] + tile[local + 1] + tile[local + 2]


def window_sum_global(a, out):
    i = cuda.grid(1)
    if i < a.size:
        out[i] = a[i] + (a[i - 1] if i >= 1 else 0.0) + (a[i - 2] if i >= 2 else 0.0)


def block_max(a, out):
    tile = cuda.shared.array(TPB, float32)
    i = cuda.grid(1)
    local = cuda.threadIdx.x
    tile[local] = a[i] if i < a.size else -math.inf
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if local < stride:
            tile[local] = max(tile[local], tile[local + stride])
        cuda.syncthreads()
        stride //= 2
    if local == 0:
        out[cuda.blockIdx.x] = tile[0]


def block_max_serial(a, out):
    tile = cuda.shared.array(TPB, float32)
    i = cuda.grid(1)
    local = cuda.threadIdx.x
    tile[local] = a[i] if i < a.size else -math.inf
    cuda.syncthreads()
    if local == 0:
        best = tile[0]
        for k in range(1, TPB):
            best = max(best, tile[k])
        out[cuda.blockIdx.x] = best


def block_max_zero_padding(a, out):
    tile = cuda.shared.array(TPB, float32)
    i = cuda.grid(1)
    local = cuda.threadIdx.x
    tile[local] = a[i] if i < a.size else 0.0
    cuda.syncthreads()
    stride = TPB // 2
    while stride > 0:
        if local < stride:
            tile[local] = max(tile[local], tile[local + stride])
        cuda.syncthreads()
        stride //= 2
    if local == 0:
        out[cuda.blockIdx.x] = tile[0]


def online_softmax(scores, values, lengths, out):
    r = cuda.grid(1)
    if r >= lengths.size:
        return
    m, total, acc = -math.inf, 0.0, 0.0
    for j in range(lengths[r]):
        new_m = max(m, scores[r, j])
        c, w = math.exp(m - new_m), math.exp(scores[r, j] - new_m)
        total, acc, m = total * c + w, acc * c + w * values[r, j], new_m
    out[r] = acc / total


def two_pass_softmax(scores, values, lengths, out):
    r = cuda.grid(1)
    if r >= lengths.size:
        return
    m = -math.inf
    for j in range(lengths[r]):
        m = max(m, scores[r, j])
    total, acc = 0.0, 0.0
    for j in range(lengths[r]):
        w = math.exp(scores[r, j] - m)
        total += w
        acc += w * values[r, j]
    out[r] = acc / total


def softmax_without_max(scores, values, lengths, out):
    r = cuda.grid(1)
    if r >= lengths.size:
        return
    total, acc = 0.0, 0.0
    for j in range(lengths[r]):
        w = math.exp(scores[r, j])
        total += w
        acc += w * values[r, j]
    out[r] = acc / total


EXPECT = [  # rung, kernel, None (passes) or what the failure must say
    ("map", broadcast_add, None),
    ("map", broadcast_add_unguarded, "IndexError"),
    ("shared memory", window_sum, None),
    ("shared memory", window_sum_no_barrier, "a race"),
    ("shared memory", window_sum_global, "no cuda.shared.array"),
    ("reduction", block_max, None),
    ("reduction", block_max_serial, "a tree reads at most 2 per round"),
    ("reduction", block_max_zero_padding, "the spec says"),
    ("online softmax", online_softmax, None),
    ("online softmax", two_pass_softmax, "passes (column"),
    ("online softmax", softmax_without_max, "OverflowError"),
]
bad = 0
for rung, kernel, expect in EXPECT:
    result = ladder.check(rung, kernel)
    ok = result.passed if expect is None else (not result.passed and expect in result.lines[0])
    bad += not ok
    print(f"{'PASS' if ok else 'FAIL'} {rung} / {kernel.__name__}: {result.lines[0][:150]}")
fig = ladder.check("shared memory", window_sum).picture()
panels = [ax.get_ylabel().split()[0] for ax in fig.axes]
print(f"{'PASS' if panels == ['a', 'out'] else 'FAIL'} picture panels {panels}")
sys.exit(1 if bad or panels != ["a", "out"] else 0)
