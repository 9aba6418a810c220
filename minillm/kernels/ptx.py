"""Compile every kernel to PTX for a compute capability, without a GPU (chapter 10).

    python -m minillm.kernels.ptx --cc 90     (also --cc 80, and --dtype float16)

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


def signatures(dtype: str = "float32") -> dict[str, tuple]:
    """numba signatures of every kernel, with K/V, activations and weights in `dtype`."""
    t = getattr(types, dtype)
    x_3, x_4, x_2, x_1 = (types.Array(t, n, "C") for n in (3, 4, 2, 1))
    i32_2 = types.Array(types.int32, 2, "C")
    i32_1 = types.Array(types.int32, 1, "C")
    i64_1 = types.Array(types.int64, 1, "C")
    f32_2 = types.Array(types.float32, 2, "C")
    decode = (x_3, x_4, x_4, i32_2, i32_1, types.float32, x_3)
    # a quantized pool (chapter 14): bytes, the same bytes seen as float32 (the scales), the 256-entry table
    u8_4, f32_4, f32_1 = types.Array(types.uint8, 4, "C"), types.Array(types.float32, 4, "C"), types.Array(types.float32, 1, "C")
    codes = (u8_4, u8_4, f32_4, f32_4)
    return {
        "reshape_and_cache": (x_3, x_3, x_4, x_4, i64_1),
        "paged_attention_decode": decode,
        "paged_attention_decode_warp": decode,
        "prefill_attention": (x_3, x_4, x_4, i32_2, i32_1, i32_1, types.float32, x_3),
        "rms_norm": (x_2, x_1, types.float32, x_2),
        "rotary_embedding": (i64_1, x_3, x_3, f32_2, types.boolean),
        "flash_attention": (x_3, x_4, x_4, i32_2, i32_1, i32_1, types.float32, x_3),
        "reshape_and_cache_quantized": (x_3, x_3, u8_4, u8_4, f32_2, f32_2, i64_1, types.boolean, types.boolean),
        "paged_attention_decode_quantized": (x_3, *codes, f32_1, types.boolean, i32_2, i32_1, types.float32, x_3),
        "prefill_attention_quantized": (x_3, *codes, f32_1, types.boolean, i32_2, i32_1, i32_1, types.float32, x_3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cc", type=int, default=90, help="compute capability, e.g. 80 (A100) or 90 (H100/H200)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                        help="element type of K/V and activations (numba has no bfloat16 arrays)")
    parser.add_argument("--only", nargs="+", metavar="KERNEL", help="compile just these kernels")
    args = parser.parse_args()
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("compile_ptx is unavailable under NUMBA_ENABLE_CUDASIM=1: run without it", file=sys.stderr)
        return 2
    from numba import cuda

    from minillm.kernels import KERNELS

    cc = (args.cc // 10, args.cc % 10)
    wanted = signatures(args.dtype)
    unknown = sorted(set(args.only or ()) - set(wanted))
    if unknown:
        print(f"unknown kernel(s) {unknown}; choose from {sorted(wanted)}", file=sys.stderr)
        return 2
    for name, sig in wanted.items():
        if args.only and name not in args.only:
            continue
        module = importlib.import_module(f"minillm.kernels.{KERNELS[name]}")
        # (a module with several kernels names them in `python_functions`)
        function = getattr(module, "python_functions", {}).get(name) or module.python_function
        ptx, _ = cuda.compile_ptx(function, sig, cc=cc)
        entries = ptx.count(".entry")
        shuffles = ptx.count("shfl.sync")
        print(f"{name:<28} sm_{args.cc} {args.dtype}: {len(ptx.splitlines()):5d} lines of PTX, {entries} entry, "
              f"{shuffles} warp shuffles, {'ok' if entries == 1 and '.target sm_' + str(args.cc) in ptx else 'UNEXPECTED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
