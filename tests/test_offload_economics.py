"""The offload tier on the simulator (chapter 14; issue 30, item 4): its copies are charged to the host
link, and the economics printed from the runs are the runs' own numbers."""

from __future__ import annotations

import pytest

from minillm.sim.hardware import get_hardware
from minillm.sim.model_shapes import get_model_shape
from minillm.sim.offload_economics import format_offload_economics, offload_economics
from minillm.traces.tenant import make_tenant_trace


@pytest.fixture(scope="module")
def econ():
    """8 tenants of 1024-token system prompts against a pool of ~4.8k tokens (20 % of an A100 for llama-7b)."""
    trace = make_tenant_trace(40, num_tenants=8, system_prompt_len=1024, question_len=32, output_len=8,
                              zipf_s=0.0, seed=1, vocab_size=32000, rate_per_s=4.0)
    return offload_economics(trace, host_gib=8, kv_fraction=0.2)


def test_host_hits_replace_prefill_and_every_copy_is_charged_to_the_link(econ):
    none, device, tier = econ.runs
    assert econ.device_kv_tokens < 8 * 1024  # the prompts do not all fit: the device cache evicts
    assert tier.host_hit_tokens > 0 and tier.blocks_in * econ.block_size == tier.host_hit_tokens
    assert tier.prompt_tokens_computed < device.prompt_tokens_computed < none.prompt_tokens_computed
    assert none.transfer_s == device.transfer_s == 0.0
    hw, shape = get_hardware("A100-80GB"), get_model_shape("llama-7b")
    block_s = shape.kv_bytes_per_token(hw.dtype_bytes) * econ.block_size / hw.host_link_bytes_per_s
    assert tier.transfer_s == pytest.approx((tier.blocks_in + tier.blocks_out) * block_s)  # the PCIe link's price
    assert econ.transfer_in_s == pytest.approx(tier.blocks_in * block_s)


def test_the_printed_verdict_follows_the_numbers(econ):
    text = format_offload_economics(econ)
    saved, spent = econ.recompute_saved_s, econ.transfer_spent_s
    assert f"{saved:.3f} s of prefill compute" in text and f"{spent:.3f} s of copies" in text
    assert ("the tier pays on this trace" in text) == (saved > spent)
    assert econ.recompute_s_per_token > econ.transfer_s_per_token  # a 7B MHA token: recompute costs more than its copy


def test_offload_economics_needs_a_host_tier():
    trace = make_tenant_trace(2, num_tenants=1, system_prompt_len=16, vocab_size=32000)
    with pytest.raises(ValueError, match="host_gib must be > 0"):
        offload_economics(trace, host_gib=0)
