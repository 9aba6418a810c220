"""Shared fixtures: tiny random HF models of each supported family, in float64."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see minillm/__init__.py
# numba.cuda picks the simulator only if this is set before numba is first imported; the CPU @njit
# kernels import numba early, so set it here, before any test module loads (a PTX compile runs in a
# child process without it: tests/test_kernels.py, minillm/grading/ex10.py).
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_bench(name: str) -> ModuleType:
    """bench/NAME.py as a fresh module (bench/ is not a package; its scripts import `_machine` beside them)."""
    bench = REPO_ROOT / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", bench / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(bench))


def load_build_exercises() -> ModuleType:
    """tools/build_exercises.py as a module (tools/ is not a package), loaded once."""
    if "build_exercises" in sys.modules:
        return sys.modules["build_exercises"]
    spec = importlib.util.spec_from_file_location("build_exercises", REPO_ROOT / "tools" / "build_exercises.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)

TINY_CONFIGS = {
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa": ("llama", dict(num_key_value_heads=2)),
    "llama3-rope": ("llama", dict(num_key_value_heads=2, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen2-bias-tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, sliding_window=24)),
}


def make_tiny_hf_model(name: str, seed: int = 0):
    """A random HF *ForCausalLM in float64 (near-ties in fp32 logits would make parity unfair)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    family, extra = TINY_CONFIGS[name]
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "mistral": (MistralConfig, MistralForCausalLM)}[family]
    torch.manual_seed(seed)
    config = config_cls(**TINY, **extra)
    config._attn_implementation = "sdpa"
    model = model_cls(config).to(torch.float64).eval()
    with torch.no_grad():  # random init is small; widen it so logits are not all near-equal
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_hf_model(request):
    return request.param, make_tiny_hf_model(request.param)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """Reference: HF transformers `generate`, one prompt at a time (no padding involved)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # An explicit mask: HF would otherwise infer one from pad_token_id, which may equal BOS.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=model.config.eos_token_id if stop_at_eos else None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def varied_prompts(n: int, vocab: int, seed: int = 1, lo: int = 1, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(lo, hi, n).round().int().tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def run_numba_script(args: list[str], simulator: bool) -> subprocess.CompletedProcess:
    """Run `python args...` from the repository root in a child process, on numba's CUDA simulator
    (NUMBA_ENABLE_CUDASIM=1) or without it (what a PTX compile needs: the simulator has no compiler)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def wait_until_healthy(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    """Poll a `minillm serve` process's /health until it answers 200; fail with its output if it
    exits first, or after `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:  # one for every poll: httpx.get() builds one, TLS context and all, per call
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
