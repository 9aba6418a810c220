"""The fused small ops (kernels/cpu_fused_ops.py) against their torch references, and the one forward
run with them (minillm/model/fused.py's FusedOps, float32) against the same forward run with the torch
ops (TorchOps)."""

from __future__ import annotations

import torch

from minillm import LLM, SamplingParams
from minillm.kernels import cpu_fused_ops as ops
from minillm.model import fused
from minillm.model.rope import RotaryTable
from minillm.single_sequence import full_logits, incremental_logits


def test_add_rms_norm_and_rms_norm():
    g = torch.Generator().manual_seed(0)
    h, delta, weight = (torch.randn(shape, generator=g) for shape in ((5, 48), (5, 48), (48,)))
    want_h, want = ops.add_rms_norm_reference(h, delta, weight, 1e-5)
    out = torch.empty_like(h)
    ops.add_rms_norm(h.numpy(), delta.numpy(), weight.numpy(), 1e-5, out.numpy())
    torch.testing.assert_close(h, want_h, rtol=1e-6, atol=1e-6)  # the residual stream, updated in place
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    ops.rms_norm(want_h.numpy(), weight.numpy(), 1e-5, out.numpy())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_rotary_in_place_matches_rope():
    g = torch.Generator().manual_seed(1)
    table = RotaryTable(16, 10000.0, 64, torch.float32)
    x = torch.randn(6, 5, 16, generator=g)  # 3 query + 1 key heads rotated, the last (a value head) not
    positions = torch.tensor([0, 1, 7, 30, 63, 2])
    want = x.clone()
    ops.rotary_reference(want, 4, positions, table.cos, table.sin)
    ops.rotary(x.numpy(), 4, positions.numpy(), table.cos.numpy(), table.sin.numpy())
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(x[:, 0], want[:, 4])  # rotation really happened on what it should


def test_fused_forward_equals_torch_forward_on_the_bundled_model():
    llm = LLM(max_num_seqs=4)
    model = llm.model
    assert model.fused_ops  # float32 on a CPU with numba: what chapters and the ladder run
    tokens = llm.tokenizer("And it came to pass, when the people heard the sound of the trumpet").input_ids
    model.fused_ops = False
    want_full, want_incremental = full_logits(model, tokens), incremental_logits(model, tokens, 5)
    model.fused_ops = True
    torch.testing.assert_close(full_logits(model, tokens), want_full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(incremental_logits(model, tokens, 5), want_incremental, rtol=1e-4, atol=1e-4)
    assert len(model.ops.packed) == 17 and all(e[2] is not None for e in model.ops.packed.values())
    texts = ["In the beginning", "Blessed are they", "And the king said unto", "Thus saith the LORD"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    fused = [o.outputs[0].token_ids for o in llm.generate(texts, greedy, use_tqdm=False)]
    model.fused_ops = False
    assert [o.outputs[0].token_ids for o in llm.generate(texts, greedy, use_tqdm=False)] == fused


def test_onednn_linear_equals_f_linear_at_every_row_count(monkeypatch):
    """fused.linear: oneDNN on a packed weight from ONEDNN_MIN_ROWS rows, F.linear below; both the
    same matmul up to float32 rounding, with and without a bias, on a column-major weight as
    LlamaModel keeps them."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 40, generator=g).t().contiguous().t()
    bias = torch.randn(96, generator=g)
    packed = {}
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(fused.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 2, 3, 16, 17, 300):
        x = torch.randn(rows, 40, generator=g)
        for b in (None, bias):
            want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            torch.testing.assert_close(fused.linear(x, w, b, packed).double(), want, rtol=1e-5, atol=1e-4)
    assert sorted(set(calls)) == [r for r in (1, 2, 3, 16, 17, 300) if r >= fused.ONEDNN_MIN_ROWS]
    assert packed[id(w)][0] is w and packed[id(w)][2].is_mkldnn  # packed once, on first use


def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    llm = LLM(max_num_seqs=4)
    model = llm.model
    tokens = llm.tokenizer("In the beginning God created the heaven and the earth").input_ids
    full_logits(model, tokens)  # packs every weight
    with torch.no_grad():
        model.layers[0].gate_up.weight.mul_(0.5)
    model.layers[1].qkv.weight = model.layers[1].qkv.weight * 1.5
    got = full_logits(model, tokens)
    model.fused_ops = False
    torch.testing.assert_close(got, full_logits(model, tokens), rtol=1e-4, atol=1e-4)


def test_float64_models_keep_the_torch_ops():
    assert not LLM(max_num_seqs=2, dtype="float64").model.fused_ops
