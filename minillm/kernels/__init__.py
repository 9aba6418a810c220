"""numba.cuda kernels, each beside its torch reference (chapter 10).

The kernel sources live in the repository's top-level `kernels/` directory (the course's layout);
this package only points its search path there, so they import as `minillm.kernels.<name>`.
`kernels/` itself has no `__init__.py` on purpose: see kernels/README.md. Importing this package
imports neither numba nor CUDA; each kernel module does that itself.
"""

from pathlib import Path

__path__.append(str(Path(__file__).resolve().parents[2] / "kernels"))  # noqa: F821 - a package's __path__
