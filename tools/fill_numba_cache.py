"""Fill numba's on-disk cache once, at install time (`make install`), so no chapter pays the compile.

Building `LLM()` warms the engine up (minillm/worker/warm_up.py): numba compiles every kernel a step
runs and, with `cache=True`, writes it to its cache beside the sources; a draft-model proposer compiles
its decode loop (minillm/spec/draft_kernel.py) when it is built. Once per CPU dtype the chapters use,
and once with a quantized KV cache (chapter 14: its own decode kernel)."""

from __future__ import annotations

import logging
import time

from minillm.llm import LLM


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for dtype in ("float32", "float64"):
        start = time.perf_counter()
        LLM(dtype=dtype)
        LLM(dtype=dtype, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})  # the draft's loop
        print(f"numba cache filled for {dtype} in {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    LLM(kv_cache_dtype="int8")  # (one kernel serves int8 and fp8: the byte table is an argument)
    print(f"numba cache filled for a quantized KV cache in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
