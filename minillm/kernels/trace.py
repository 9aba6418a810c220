"""What every simulated thread touched: a kernel run on numba's CUDA simulator, traced (chapter 10).

`trace_launch(kernel, grid, block, args)` runs a kernel under NUMBA_ENABLE_CUDASIM=1 with each array
argument (and each `cuda.shared.array` the kernel allocates) replaced by a `Traced` view that
records which thread read or wrote which element, and with each thread counting the barriers
(`cuda.syncthreads()`) it has passed. From that record a `KernelTrace` answers:

- **HBM bytes**, `hbm_bytes()`: for every global array, the distinct elements each thread read
  (and wrote), summed over threads, times the element size. A thread that reads the same number
  twice is counted once (a register or its L1 would keep it); two threads that read the same number
  are counted twice, because on a GPU sharing between threads goes through shared memory or not at
  all. That is the accounting of FlashAttention's I/O argument (io_model.py), measured on a run.
- **Races**, `races()`: two threads of one block touching the same shared-memory element between
  the same two barriers, at least one of them writing. Found from the record, not from timing, so
  a missing `cuda.syncthreads()` is caught on every run, not only when the simulator's threads
  happen to interleave badly.
- **Pictures**: `touched(name, "r" | "w")` is an array of the array's shape saying which thread
  block (or thread) touched each element; minillm.kernels.ladder draws them.

Only for the simulator (it needs Python threads to ask who is running). Slower than a plain
simulated launch by a small factor: for small grids.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np


def _thread_key() -> tuple[tuple[int, ...], tuple[int, ...]]:
    me = threading.current_thread()
    return tuple(me.blockIdx), tuple(me.threadIdx)


def _normalize(index, shape: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
    """(element index, whether a negative index wrapped around as numpy does and a GPU would not)."""
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) != len(shape) or not all(isinstance(i, (int, np.integer)) for i in index):
        raise TypeError(f"index {index!r} of an array of shape {shape}: a kernel indexes one element at a time "
                        "with as many integers as the array has dimensions")
    wrapped = any(int(i) < 0 for i in index)
    return tuple(int(i) % n if int(i) < 0 and -n <= int(i) else int(i) for i, n in zip(index, shape)), wrapped


class Traced:
    """An array handed to a simulated kernel: reads and writes go to `array` and are recorded."""

    def __init__(self, name: str, array: np.ndarray, trace: KernelTrace, kind: str = "global") -> None:
        self._array, self._name, self._trace, self._kind = array, name, trace, kind
        self.shape, self.size, self.ndim, self.dtype = array.shape, array.size, array.ndim, array.dtype

    def __len__(self) -> int:
        return len(self._array)

    def __getitem__(self, index):
        element, wrapped = _normalize(index, self.shape)
        value = self._array[index]
        self._trace.record(self._name, self._kind, element, "r", wrapped)
        return value

    def __setitem__(self, index, value) -> None:
        element, wrapped = _normalize(index, self.shape)
        self._array[index] = value
        self._trace.record(self._name, self._kind, element, "w", wrapped)


@dataclass
class KernelTrace:
    """Who touched what in one traced launch (see the module docstring)."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # name -> the underlying array
    kinds: dict[str, str] = field(default_factory=dict)  # name -> "global" | "shared"
    # (name, "r"|"w") -> {thread key: {element: count}}
    accesses: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(int))))
    # shared name -> {(block, element, epoch): {thread key: kinds}}
    epochs: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(dict)))
    wrapped: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # negative indices seen
    barriers: dict = field(default_factory=lambda: defaultdict(int))  # thread key -> barriers passed
    order: dict = field(default_factory=lambda: defaultdict(list))  # (name, thread key) -> elements read, in order
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, name: str, kind: str, element: tuple[int, ...], how: str, wrapped: bool) -> None:
        key = _thread_key()
        with self._lock:
            self.accesses[name, how][key][element] += 1
            if how == "r":
                self.order[name, key].append(element)
            if wrapped:
                self.wrapped.append((name, element))
            if kind == "shared":
                seen = self.epochs[name][key[0], element, self.barriers[key]]
                seen[key[1]] = seen.get(key[1], "") + how

    # --- what the record says -------------------------------------------------------------------

    def threads(self) -> set:
        return {key for per_array in self.accesses.values() for key in per_array}

    def reads_per_thread(self, name: str) -> dict:
        """{thread key: {element: times read}} of one array."""
        return {k: dict(v) for k, v in self.accesses[name, "r"].items()}

    def hbm_bytes(self) -> dict[str, dict[str, int]]:
        """{global array: {"read": bytes, "written": bytes}}: distinct elements per thread, summed."""
        out: dict[str, dict[str, int]] = {}
        for name, kind in self.kinds.items():
            if kind != "global":
                continue
            size = self.arrays[name].itemsize
            out[name] = {label: size * sum(len(elements) for elements in self.accesses[name, how].values())
                         for label, how in (("read", "r"), ("written", "w"))}
        return out

    def total_hbm_bytes(self) -> tuple[int, int]:
        moved = self.hbm_bytes().values()
        return sum(m["read"] for m in moved), sum(m["written"] for m in moved)

    def races(self) -> list[str]:
        """Shared-memory elements that two threads of a block touched between the same two barriers,
        at least one of them writing: each as a sentence."""
        found = []
        for name, slots in self.epochs.items():
            for (block, element, epoch), who in sorted(slots.items()):
                writers = [t for t, how in who.items() if "w" in how]
                if writers and len(who) > 1:
                    other = next(t for t in who if t != writers[0])
                    found.append(f"{name}{list(element)} in block {list(block)}: thread {list(writers[0])} writes it "
                                 f"and thread {list(other)} {'writes' if 'w' in who[other] else 'reads'} it with no "
                                 f"cuda.syncthreads() between (after barrier {epoch})")
        return found

    def touched(self, name: str, how: str = "r", by: str = "block") -> np.ndarray:
        """An array of `name`'s shape: -1 where no thread touched an element (`how` "r" or "w"), else the
        linear index of the thread block (by="block") or global thread (by="thread") that touched it last
        in the record (several: the largest)."""
        grid = np.full(self.arrays[name].shape, -1, dtype=np.int64)
        for (block, thread), elements in self.accesses[name, how].items():
            who = block[0] + 1000 * block[1] + 1000000 * block[2] if by == "block" else thread[0] + 1024 * block[0]
            for element in elements:
                grid[element] = max(grid[element], who)
        return grid


@contextlib.contextmanager
def _instrumented(trace: KernelTrace):
    """Shared arrays come back traced and barriers are counted, while the block is open. The shared
    arrays themselves come from `simulated_launch` (kernels/_launch.py: one per kernel line, made
    under a lock), zeroed so that a trace of a wrong kernel reads the same numbers every run."""
    from numba.cuda.simulator import kernel as sim_kernel

    from minillm.kernels._launch import simulated_launch

    names: dict[tuple, str] = {}

    def traced(site, shared):
        with trace._lock:
            name = names.setdefault(site, f"shared{len(names)}")
            trace.arrays.setdefault(name, shared)
            trace.kinds[name] = "shared"
        return Traced(name, shared, trace, kind="shared")

    with simulated_launch(wrap=traced, zeroed=True):
        original_sync = sim_kernel.BlockThread.syncthreads

        def syncthreads(self):
            original_sync(self)
            with trace._lock:
                trace.barriers[tuple(self.blockIdx), tuple(self.threadIdx)] += 1

        sim_kernel.BlockThread.syncthreads = syncthreads
        try:
            yield
        finally:
            sim_kernel.BlockThread.syncthreads = original_sync


def trace_launch(kernel, grid, block, args: list, names: list[str] | None = None) -> KernelTrace:
    """Run `kernel[grid, block](*args)` on the simulator with its arrays traced; returns the trace.

    `kernel` is a cuda.jit kernel or its Python function; array arguments may be numpy arrays or CPU
    torch tensors (written in place); `names` labels them (default: the function's parameter names).
    """
    from numba import cuda
    from numba.core import config

    if not config.ENABLE_CUDASIM:
        raise RuntimeError("trace_launch runs kernels on numba's simulator: set NUMBA_ENABLE_CUDASIM=1 before "
                           "numba is imported")
    function = getattr(kernel, "py_func", kernel)
    names = names or list(function.__code__.co_varnames[: function.__code__.co_argcount])
    trace = KernelTrace()
    wrapped = []
    for name, arg in zip(names, args):
        if hasattr(arg, "numpy") and hasattr(arg, "is_cuda"):  # a CPU torch tensor: its numpy view
            arg = arg.detach().numpy()
        if isinstance(arg, np.ndarray):
            trace.arrays[name], trace.kinds[name] = arg, "global"
            arg = Traced(name, arg, trace)
        wrapped.append(arg)
    compiled = kernel if hasattr(kernel, "py_func") else cuda.jit(function)
    with _instrumented(trace):
        compiled[grid, block](*wrapped)
    return trace
