"""numba.cuda kernels, each beside its torch reference, and the CPU decode kernel (chapter 10).

The kernel sources live in the repository's top-level `kernels/` directory (the course's layout);
in a source or editable checkout this package points its search path there, so they import as
`minillm.kernels.<name>`. A wheel carries them inside this package instead (tools/build_backend.py
copies them at build time), so the same imports work from an installed minillm.
`kernels/` itself has no `__init__.py` on purpose: see kernels/README.md. Importing this package
imports neither numba nor CUDA; the launchers below import their kernel module (and numba) on
first use. On a CPU the CUDA kernels run only under numba's simulator (NUMBA_ENABLE_CUDASIM=1, set
before numba is imported); the CPU kernel is plain numba @njit.

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)            # in place
    paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale) -> out
    paged_attention_decode_warp(...same...) -> out    # one warp per (sequence, head), shuffles: GPU only
    prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale) -> out
    reshape_and_cache_quantized(key, value, k_codes, v_codes, slot_mapping, kv_cache_dtype)    # chapter 14:
    paged_attention_decode_quantized(query, k_codes, v_codes, ..., kv_cache_dtype) -> out     # a pool of bytes
    prefill_attention_quantized(query, k_codes, v_codes, ..., kv_cache_dtype) -> out         # (minillm.kv.quant)
    rms_norm(x, weight, eps) -> out
    rotary_embedding(positions, query, key, cos_sin_cache, is_neox=True)          # in place
    paged_attention_decode_cpu(query, key_cache, value_cache, block_tables, seq_lens, scale, window=None)
    paged_attention_decode_cpu_quantized(query, k_codes, v_codes, block_tables, seq_lens, scale, kv_cache_dtype)
"""

import importlib
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_CHECKOUT_KERNELS = _HERE.parents[1] / "kernels"  # the repository's kernels/, beside minillm/
if not (_HERE / "decode_attention.py").is_file() and (_CHECKOUT_KERNELS / "decode_attention.py").is_file():
    __path__.append(str(_CHECKOUT_KERNELS))  # noqa: F821 - a package's __path__

# launcher -> the module (one file per kernel, in kernels/) that defines it beside its reference
KERNELS = {"reshape_and_cache": "cache_write", "paged_attention_decode": "decode_attention",
           "paged_attention_decode_warp": "decode_attention_warp",
           "prefill_attention": "varlen_attention", "rms_norm": "rmsnorm", "rotary_embedding": "rope",
           "flash_attention": "tiled_attention", "reshape_and_cache_quantized": "quantized_kv",
           "paged_attention_decode_quantized": "quantized_kv", "prefill_attention_quantized": "quantized_kv"}
CPU_KERNELS = {"paged_attention_decode_cpu": "cpu_decode_attention",  # @njit, not CUDA: no PTX
               "paged_attention_decode_cpu_quantized": "cpu_quantized_decode"}
__all__ = [*KERNELS, *CPU_KERNELS]


def __getattr__(name: str):
    module = KERNELS.get(name) or CPU_KERNELS.get(name)
    if module is not None:
        return getattr(importlib.import_module(f"minillm.kernels.{module}"), name)
    raise AttributeError(f"module 'minillm.kernels' has no attribute {name!r}")
