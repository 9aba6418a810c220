"""Compile every kernel to PTX for a compute capability, without a GPU (chapter 10).

    python -m minillm.kernels.ptx --cc 90     (also --cc 80)

numba-cuda ships NVRTC, so `cuda.compile_ptx` really compiles on a CPU machine: this checks that
each kernel types and lowers for the GPU, not just that it runs in the simulator. It cannot run
under NUMBA_ENABLE_CUDASIM (the simulator has no compiler). Prints one line per kernel.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from numba import types


def signatures() -> dict[str, tuple]:
    f32_3 = types.Array(types.float32, 3, "C")
    f32_4 = types.Array(types.float32, 4, "C")
    f32_2 = types.Array(types.float32, 2, "C")
    f32_1 = types.Array(types.float32, 1, "C")
    i32_2 = types.Array(types.int32, 2, "C")
    i32_1 = types.Array(types.int32, 1, "C")
    i64_1 = types.Array(types.int64, 1, "C")
    return {
        "reshape_and_cache": (f32_3, f32_3, f32_4, f32_4, i64_1),
        "paged_attention_decode": (f32_3, f32_4, f32_4, i32_2, i32_1, types.float32, f32_3),
        "prefill_attention": (f32_3, f32_4, f32_4, i32_2, i32_1, i32_1, types.float32, f32_3),
        "rms_norm": (f32_2, f32_1, types.float32, f32_2),
        "rotary_embedding": (i64_1, f32_3, f32_3, f32_2, types.boolean),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cc", type=int, default=90, help="compute capability, e.g. 80 (A100) or 90 (H100/H200)")
    args = parser.parse_args()
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("compile_ptx is unavailable under NUMBA_ENABLE_CUDASIM=1: run without it", file=sys.stderr)
        return 2
    from numba import cuda

    from minillm.kernels import KERNELS

    cc = (args.cc // 10, args.cc % 10)
    for name, sig in signatures().items():
        module = importlib.import_module(f"minillm.kernels.{KERNELS[name]}")
        ptx, _ = cuda.compile_ptx(module.python_function, sig, cc=cc)
        entries = ptx.count(".entry")
        print(f"{name:<24} sm_{args.cc}: {len(ptx.splitlines()):5d} lines of PTX, {entries} entry, "
              f"{'ok' if entries == 1 and '.target sm_' + str(args.cc) in ptx else 'UNEXPECTED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
