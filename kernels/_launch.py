"""How a kernel gets its arrays and its stream (chapter 10).

On a GPU, torch tensors are handed to numba zero-copy through `__cuda_array_interface__`
(`cuda.as_cuda_array`), and kernels are launched on torch's current stream
(`cuda.external_stream`): the interface carries no stream, so without this a kernel could run
before the torch op that produced its input. Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1,
on a CPU) the same kernels take numpy views of CPU tensors — also zero-copy, so writes land in the
torch tensor.
"""

from __future__ import annotations

import os
import sys

import torch

THREADS = 64  # threads per block for the one-thread-per-item kernels


def simulator() -> bool:
    """Whether numba runs kernels on its simulator: numba's own setting once it is imported (it reads
    NUMBA_ENABLE_CUDASIM once, at import), the variable before that."""
    if "numba" in sys.modules:
        from numba.core import config

        return bool(config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def device_array(t: torch.Tensor):
    """A zero-copy view numba can index: a device array on CUDA, a numpy view under the simulator."""
    if t.dtype == torch.bfloat16:
        raise TypeError("numba.cuda has no bfloat16 arrays: run the numba kernels in float32 or float16 "
                        "(LLM(dtype='float16')), or use attention_backend='torch'")
    if t.is_cuda:
        from numba import cuda

        return cuda.as_cuda_array(t.detach())
    if not simulator():
        raise RuntimeError("numba.cuda kernels need a CUDA tensor; on a CPU set NUMBA_ENABLE_CUDASIM=1 (before "
                           "numba is imported) to run them on numba's simulator, or use attention_backend='torch'")
    if not t.is_contiguous():
        raise ValueError("the simulator path needs contiguous tensors (a numpy view must alias the tensor)")
    return t.detach().numpy()


def launch(kernel, num_items: int, *args) -> None:
    """kernel[blocks, THREADS](*args) over `num_items` threads, on torch's current stream when on CUDA."""
    if num_items == 0:
        return
    blocks = -(-num_items // THREADS)
    first = next((a for a in args if hasattr(a, "__cuda_array_interface__")), None)
    if first is not None and not simulator():
        from numba import cuda

        stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        kernel[blocks, THREADS, stream](*args)
    else:
        kernel[blocks, THREADS](*args)
