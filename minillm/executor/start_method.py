"""Fork or spawn: how the ranks' processes are started, and why (chapter 12; issue 28).

`fork` copies this process: nothing is re-imported and nothing of `__main__` runs again, so a script
without an `if __name__ == "__main__":` guard, a `python -c` and a notebook all work, and start-up is
quick. It is unsafe in two cases, which `choose_start_method` checks, in this order:

1. `torch.cuda.is_initialized()`: a CUDA context exists here, and a forked child cannot use CUDA
   ("Cannot re-initialize CUDA in forked subprocess").
2. A thread other than the main one that is not a daemon (`threading.enumerate()`): a worker thread of
   the program's own (an engine loop, a server) may hold a lock at the instant of the fork, and the
   child, which has only the forking thread, would wait on that lock forever. Daemon threads are helpers
   that hold no lock the ranks take: Jupyter's I/O and heartbeat threads, tqdm's monitor. They are
   named in the reason but do not force spawn (otherwise no notebook could fork).

Otherwise the ranks are forked, on Linux only (macOS and Windows spawn, as Python does by default
there). `spawn` starts a fresh interpreter: always safe for the parent, but it re-runs the main
script (as `__mp_main__`) in every child, so that script's top-level call of `LLM(...)` must sit
under the main guard. `check_main_guard` finds the `<module>` frame of the main script in the call
stack and, with `ast`, whether that line is inside `if __name__ == "__main__":`; if not, it raises
an error that names the fix before any process starts (instead of multiprocessing's bootstrapping
traceback in every rank). `python -c` and notebooks have no main file to re-run: nothing to check.

`MINILLM_WORKER_MULTIPROC_METHOD=fork|spawn` forces one (vLLM's knob is
`VLLM_WORKER_MULTIPROC_METHOD`); forcing fork with a CUDA context is refused. The choice and its
reason are logged on the "minillm.executor" logger (spawn as a warning, as vLLM does) and kept on
the executor (`MultiprocExecutor.start_method`).
"""

from __future__ import annotations

import ast
import logging
import multiprocessing
import os
import sys
import threading
from dataclasses import dataclass

logger = logging.getLogger("minillm.executor")

START_METHOD_ENV = "MINILLM_WORKER_MULTIPROC_METHOD"
START_METHODS = ("fork", "spawn")


@dataclass(frozen=True)
class StartMethod:
    name: str  # "fork" or "spawn"
    reason: str  # why, in words (what was checked)

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def _other_threads() -> tuple[list[str], list[str]]:
    """Names of the live threads besides the main one: (non-daemon, daemon)."""
    main = threading.main_thread()
    others = [t for t in threading.enumerate() if t is not main and t is not threading.current_thread()]
    if threading.current_thread() is not main:  # called from a thread: that thread forks, the main one is left
        others.append(main)
    return [t.name for t in others if not t.daemon], [t.name for t in others if t.daemon]


def _cuda_initialized() -> bool:
    import torch

    return torch.cuda.is_initialized()


def choose_start_method(forced: str | None = None) -> StartMethod:
    """The start method for rank processes and the reason; `forced` (or the environment variable)
    overrides the choice (fork is still refused when a CUDA context exists)."""
    forced = forced or os.environ.get(START_METHOD_ENV) or None
    if forced is not None and forced not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={forced!r}: choose one of {START_METHODS} (or leave it unset)")
    cuda = _cuda_initialized()
    if forced == "fork":
        if cuda:
            raise ValueError(f"{START_METHOD_ENV}=fork, but this process has a CUDA context "
                             "(torch.cuda.is_initialized()): a forked rank could not use CUDA; use spawn")
        return StartMethod("fork", f"forced by {START_METHOD_ENV}=fork")
    if forced == "spawn":
        return StartMethod("spawn", f"forced by {START_METHOD_ENV}=spawn")
    if sys.platform != "linux" or "fork" not in multiprocessing.get_all_start_methods():
        return StartMethod("spawn", f"fork is only used on Linux (this is {sys.platform})")
    if cuda:
        return StartMethod("spawn", "a CUDA context exists in this process (torch.cuda.is_initialized()), "
                                    "and a forked child cannot use CUDA")
    busy, helpers = _other_threads()
    if busy:
        return StartMethod("spawn", f"non-daemon thread(s) {busy} run here; one might hold a lock at the fork")
    helpers_said = f"; daemon helper thread(s) {helpers} ignored" if helpers else ""
    return StartMethod("fork", "no CUDA context (torch.cuda.is_initialized() is False) and no non-daemon thread "
                               f"besides the main one{helpers_said}")


def log_start_method(method: StartMethod, what: str) -> None:
    (logger.warning if method.name == "spawn" else logger.info)("%s: processes started with %s", what, method)


GUARD_FIX = ('put the code that builds the engine under `if __name__ == "__main__":` (spawned processes '
             "import the main script again; the guard keeps them from running it)")


def _guarded_lines(tree: ast.Module) -> list[tuple[int, int]]:
    """Line ranges of the bodies of top-level `if __name__ == "__main__":` blocks."""
    ranges = []
    for node in tree.body:
        if not isinstance(node, ast.If):
            continue
        test = node.test
        if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
                and {ast.unparse(test.left), ast.unparse(test.comparators[0])} in
                ({"__name__", "'__main__'"}, {"__name__", '"__main__"'})):
            ranges.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
    return ranges


def unguarded_main_call() -> tuple[str, int] | None:
    """(script path, line) when the main script calls us from its top level outside the main guard —
    the line a spawned child would run again; None when there is no main script (`python -c`, a
    notebook, the REPL), the main module is a package's `__main__` (which spawn does not re-run), or the
    call is guarded. (`python -m mod` is re-run too: children import `mod` by name as `__mp_main__`.)"""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if main is None or path is None or spec_name == "__main__" or spec_name.endswith(".__main__"):
        return None
    frame, line = sys._getframe(1), None
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
        frame = frame.f_back
    if line is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None  # nothing to read: let multiprocessing say what it says
    if any(start <= line <= end for start, end in _guarded_lines(tree)):
        return None
    return path, line


class MainGuardError(RuntimeError):
    """Spawned ranks would re-run the main script's unguarded call of the engine."""


def check_main_guard(method: StartMethod) -> None:
    """Refuse, naming the fix, to spawn ranks that would re-run the main script's engine call;
    and, inside a child that is still bootstrapping (the script re-run there), say the same
    instead of multiprocessing's traceback."""
    if method.name != "spawn":
        return
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise MainGuardError(f"this spawned process re-ran the main script, which starts an engine again: {GUARD_FIX}")
    found = unguarded_main_call()
    if found is not None:
        path, line = found
        unforce = f", or unset {START_METHOD_ENV} to let minillm fork" if "forced" in method.reason else ""
        raise MainGuardError(f"ranks are started with {method}; spawn re-runs {path} in every rank, and its line "
                             f"{line} starts the engine outside the main guard: {GUARD_FIX}{unforce}")
