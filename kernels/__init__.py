"""numba.cuda kernels, each beside its torch reference (chapter 10).

Installed as `minillm.kernels` (see pyproject.toml), never as a top-level `kernels` package:
transformers probes for a PyPI package named `kernels` and would import ours by mistake.
Importing this package imports neither numba nor CUDA; each kernel module does so itself.
"""
