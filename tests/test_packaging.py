"""Packaging: kernels/ imports as minillm.kernels (from the checkout and from an installed wheel), and
transformers never mistakes it for its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
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


def test_kernels_import_from_an_installed_wheel(tmp_path):
    """Build a wheel from a copy of the sources, install it into a scratch directory, and import the
    kernels from a process whose cwd and sys.path hold nothing of the checkout (about 20 s)."""
    src, site = tmp_path / "src", tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("minillm", "kernels", "tools"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("minillm-*.whl")
    install = subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    assert not (site / "kernels").exists()  # never a top-level package named kernels
    code = (
        "import importlib.util, os, sys, torch\n"
        f"site = {str(site)!r}\n"
        "others = [p for p in sys.path if p != site]  # '' (the cwd, a scratch dir), the venv's packages, stdlib\n"
        "assert not any(os.path.isdir(os.path.join(p or '.', d)) for p in others for d in ('minillm', 'kernels'))\n"
        "import minillm.kernels\n"
        "assert minillm.__file__.startswith(site) and list(minillm.kernels.__path__) == [site + '/minillm/kernels']\n"
        "from minillm.kernels import paged_attention_decode_cpu\n"
        "for name in ('decode_attention', 'varlen_attention', 'cache_write', 'rmsnorm', 'rope', '_launch'):\n"
        "    assert importlib.util.find_spec('minillm.kernels.' + name).origin.startswith(site), name\n"
        "q, k, v = torch.randn(2, 4, 8), torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)\n"
        "tables, lens = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32), torch.tensor([7, 2], dtype=torch.int32)\n"
        "out = paged_attention_decode_cpu(q, k, v, tables, lens, 0.35)\n"
        "keys, values = k[[1]].reshape(4, 2, 8)[:2], v[[1]].reshape(4, 2, 8)[:2]  # sequence 1: block 1, 2 keys\n"
        "want = torch.einsum('hn,nhd->hd', (torch.einsum('hd,nhd->hn', q[1], keys.repeat_interleave(2, 1)) * 0.35)"
        ".softmax(-1), values.repeat_interleave(2, 1))\n"
        "assert torch.allclose(out[1], want, atol=1e-5), (out[1], want)\n"
        "import transformers\n"
        "from transformers.utils import is_kernels_available\n"
        "assert not is_kernels_available() and importlib.util.find_spec('kernels') is None\n"
        "print('ok')\n"
    )
    # -S: no site-packages processing, so the editable install's import hook (a .pth) is not loaded;
    # the venv's packages (torch, numba, transformers) come in through PYTHONPATH, after the wheel.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
