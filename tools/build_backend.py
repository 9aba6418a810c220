"""minillm's build backend: setuptools', plus a wheel that carries kernels/*.py as minillm/kernels/<name>.py.

The course keeps its numba kernels in `kernels/` at the repository root (DESIGN.md's layout) and
`minillm/kernels/__init__.py` adds that directory to the package's search path in a source or
editable checkout. An installed wheel has no repository root, so this `build_py` copies the kernel
modules into the package itself; `kernels/` never becomes a top-level package (transformers would
mistake it for the PyPI `kernels` distribution, see kernels/README.md). pyproject.toml names this
module as the build backend (in-tree, `backend-path = ["tools"]`: a backend-path must hold the
backend itself, so this module re-exports setuptools.build_meta's hooks) and its class in
`[tool.setuptools.cmdclass]`. tests/test_wheel_kernels.py builds a wheel and imports from it.
"""

from __future__ import annotations

from pathlib import Path

from setuptools.build_meta import *  # noqa: F403 - the PEP 517/660 hooks, unchanged
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads kernels/ from the checkout itself
            return
        target = Path(self.build_lib, "minillm", "kernels")
        for source in sorted(Path("kernels").glob("*.py")):
            self.copy_file(str(source), str(target / source.name))
