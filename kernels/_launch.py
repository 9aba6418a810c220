"""How a kernel gets its arrays and its stream (chapter 10).

On a GPU, torch tensors are handed to numba zero-copy through `__cuda_array_interface__`
(`cuda.as_cuda_array`), and kernels are launched on torch's current stream
(`cuda.external_stream`): the interface carries no stream, so without this a kernel could run
before the torch op that produced its input. Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1,
on a CPU) the same kernels take numpy views of CPU tensors — also zero-copy, so writes land in the
torch tensor.

minillm's simulated launches go through `simulated_launch()`: `launch()` below, `flash_attention`
(tiled_attention.py, its own grid) and `trace_launch` (minillm/kernels/trace.py, which adds its
recording on top). See that function for why. A kernel launched directly with `kernel[grid, block]`
on the simulator (chapter 10's small teaching kernels, a learner's own) does not: it keeps
numba's own allocator.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import numpy as np
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


_SIMULATED_LAUNCHES = threading.RLock()  # one simulated launch at a time holds the patched allocator


@contextlib.contextmanager
def simulated_launch(wrap=None, zeroed: bool = False):
    """Simulator only: for the length of one launch, every thread of a block gets the same array from
    a `cuda.shared.array` line, as on a GPU.

    Regression note (a flaky FAIL, "MQA 6:1 ... logits x30: max |error| 2.0e+00" from
    `flash_attention`, seen once under pytest-xdist on a loaded CPU; fixed there first in 9ccba5b,
    here for every simulated launch). The kernel's barriers were complete (tile loaded -> barrier ->
    read; read -> barrier -> next overwrite). What raced was numba's simulator: its
    `FakeCUDAShared.array` (numba_cuda .../cuda/simulator/kernelapi.py) keys a launch's shared
    arrays by the calling (file, line) in a dict and, if the key is absent, makes and stores a new
    array: check, then insert, without a lock. The simulator runs a block's threads as Python
    threads, so threads of a launch's *first* block that reach that line together can each make
    their own array (later blocks find it stored) and see only what they wrote themselves: a rare
    wrong result under CPU load, in any kernel with a shared array. On a GPU a shared array is one
    per block by construction.

    Here the same lookup, keyed the same way, runs under a lock; a new array is `np.empty`
    (uninitialised, as on a GPU) unless `zeroed`. Dynamic shared memory (shape 0: one buffer, no
    race) and `alignment` (unsupported by the simulator) go to numba's own. `wrap(site, array)`, if
    given, is what the kernel gets instead of the array (trace.py returns a recording view).
    The allocator is swapped on numba's class, so launches through here are serialised (a
    re-entrant lock) and the swap is undone cleanly. The GPU never comes here.
    """
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    lock = threading.Lock()

    with _SIMULATED_LAUNCHES:
        original = kernelapi.FakeCUDAShared.array

        def array(self, shape, dtype, alignment=None):
            if shape == 0 or alignment is not None:
                return original(self, shape, dtype, alignment)
            caller = sys._getframe(1)  # the kernel line that called cuda.shared.array: numba's own key
            site = (caller.f_code.co_filename, caller.f_lineno)
            with lock:
                shared = self._allocations.get(site)
                if shared is None:
                    dt = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
                    shared = self._allocations[site] = (np.zeros if zeroed else np.empty)(shape, dt)
            return shared if wrap is None else wrap(site, shared)

        kernelapi.FakeCUDAShared.array = array
        try:
            yield
        finally:
            kernelapi.FakeCUDAShared.array = original


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
    elif simulator():
        with simulated_launch():
            kernel[blocks, THREADS](*args)
    else:
        kernel[blocks, THREADS](*args)
