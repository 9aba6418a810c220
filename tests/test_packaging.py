"""Packaging: kernels/ imports as minillm.kernels, and transformers never mistakes it for its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_kernels_directory_is_not_a_regular_package():
    # An __init__.py would be executed by `import transformers` when Python runs from the repo root.
    assert not (REPO / "kernels" / "__init__.py").exists()


def test_kernels_are_minillm_kernels_and_invisible_to_transformers(tmp_path):
    """Run from the repo root, where a top-level `kernels` directory is on sys.path."""
    (REPO / "kernels" / "_packaging_probe.py").write_text("VALUE = 42\n")
    code = (
        "import sys, transformers\n"
        "from transformers.utils import is_kernels_available\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2))\n"
        "assert not is_kernels_available()\n"
        "k = sys.modules.get('kernels')\n"
        "assert k is None or getattr(k, '__file__', None) is None, 'our kernels/ ran as transformers kernels'\n"
        "assert 'minillm' not in sys.modules and 'numba' not in sys.modules\n"
        "import minillm\n"
        "from minillm.kernels import _packaging_probe\n"
        "assert _packaging_probe.VALUE == 42\n"
        "assert 'numba' not in sys.modules, 'importing minillm must not import numba'\n"
        "print('ok')\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        (REPO / "kernels" / "_packaging_probe.py").unlink()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
