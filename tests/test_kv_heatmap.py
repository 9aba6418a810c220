"""minillm.viz.kv_heatmap: every physical block classified right, drawn in its state's color, live."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from minillm.kv.block_manager import BlockManager  # noqa: E402
from minillm.kv.slab import SlabKVManager  # noqa: E402
from minillm.request import Request, SamplingParams  # noqa: E402
from minillm.viz import LiveView, block_states, plot_kv_blocks  # noqa: E402
from minillm.viz.kv_heatmap import (  # noqa: E402
    CACHED,
    FREE,
    RESERVED,
    SHARED,
    STATE_COLORS,
    block_fill,
    owner_color,
)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def admit(kv: BlockManager, rid: str, prompt: list[int]) -> Request:
    """What the scheduler does for a new request: attach its cached prefix, allocate the rest, and
    (as the step would) mark every prompt token computed."""
    req = Request(rid, prompt, SamplingParams(), arrival_time=0.0)
    req.num_computed_tokens = kv.get_computed_tokens(req)
    assert kv.allocate(req, req.num_tokens - req.num_computed_tokens)
    kv.commit_step()
    req.num_computed_tokens = req.num_tokens
    return req


@pytest.fixture
def pool():
    """10 blocks of 4 slots. a: 10 tokens in blocks 0,1,2; b shares a's first 8 tokens (0, 1) and adds 3
    in block 3; c took 4,5,6 and finished: its two full blocks stay cached, its partial one is freed."""
    kv = BlockManager(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=10, block_size=4,
                      enable_prefix_caching=True, allocate_pool=False, watermark=0.0)
    shared = list(range(10, 18))
    admit(kv, "a", shared + [30, 31])
    b = admit(kv, "b", shared + [40, 41, 42])
    assert b.num_computed_tokens == 11 and kv.num_hit_tokens == 8
    c = admit(kv, "c", [50 + i for i in range(9)])
    kv.free(c)
    return kv


EXPECTED = np.array([SHARED, SHARED, 0, 1, CACHED, CACHED, FREE, FREE, FREE, FREE])


def test_block_states_free_in_use_shared_cached(pool):
    grid, legend = block_states(pool)
    np.testing.assert_array_equal(grid, EXPECTED)
    assert legend[0] == "a" and legend[1] == "b" and 2 not in legend  # c holds no block any more
    assert legend[SHARED] == "shared" and legend[CACHED] == "cached" and legend[FREE] == "free"
    np.testing.assert_array_equal(block_fill(pool), [4, 4, 2, 3, 0, 0, 0, 0, 0, 0])


def test_block_states_after_everyone_leaves(pool):
    for rid in ("a", "b"):
        pool.free(Request(rid, [1], SamplingParams(), 0.0))
    grid, legend = block_states(pool)
    # every full block of a prompt stays cached; the two partial last blocks go back to the free list
    np.testing.assert_array_equal(grid, [CACHED, CACHED, FREE, FREE, CACHED, CACHED, FREE, FREE, FREE, FREE])
    assert not any(code >= 0 for code in legend)


def test_plot_image_is_the_states_in_their_colors(pool):
    ax = plot_kv_blocks(pool, ncols=4)
    image = ax.images[0]
    cells = image.get_array()
    assert cells.shape == (3, 4)
    np.testing.assert_array_equal(cells.compressed(), EXPECTED)  # row by row, block-id order
    assert cells.mask.ravel().tolist() == [False] * 10 + [True] * 2  # past the last block: nothing
    rgba = image.to_rgba(cells.filled(FREE)).reshape(-1, 4)[:10]  # what is rendered, cell by cell
    expected = [STATE_COLORS[c] if c < 0 else owner_color(c) for c in EXPECTED]
    np.testing.assert_allclose(rgba, [to_rgba(c) for c in expected], atol=1 / 255)
    assert owner_color(0) != owner_color(1)
    # a white × on each shared block (blocks 0 and 1: row 0, columns 0 and 1)
    marks = ax.collections[-1].get_offsets()
    np.testing.assert_allclose(marks, [[0.5, 0.5], [1.5, 0.5]])
    title = ax.get_title()
    assert "4/10 in use (2 shared), 2 cached, 4 free" in title
    assert "13 tokens / 16 reserved slots: 18.8% internal fragmentation (3 empty)" in title


def test_plot_shades_the_empty_tail_of_last_blocks(pool):
    ax = plot_kv_blocks(pool, ncols=4)
    tails = ax.collections[0]
    extents = sorted(tuple(np.round(p.get_extents().bounds, 6)) for p in tails.get_paths())
    # block 2 (row 0, col 2) holds 2 of 4 tokens, block 3 (row 0, col 3) 3 of 4: (x, y, width, height)
    assert extents == [(2.5, 0.0, 0.5, 1.0), (3.75, 0.0, 0.25, 1.0)]


def test_slab_rows_filled_then_reserved():
    kv = SlabKVManager(1, 1, 2, num_slabs=3, slab_len=8, allocate_pool=False)
    for rid, n in (("a", 5), ("b", 2)):
        assert kv.allocate(Request(rid, list(range(3, 3 + n)), SamplingParams(), 0.0), n)
    grid, legend = block_states(kv)
    R, F = RESERVED, FREE
    np.testing.assert_array_equal(grid, [[0] * 5 + [R] * 3, [1] * 2 + [R] * 6, [F] * 8])
    assert legend[0] == "a" and legend[1] == "b"
    ax = plot_kv_blocks(kv)
    np.testing.assert_array_equal(ax.images[0].get_array(), grid)
    assert "2/3 in use" in ax.get_title() and "7 tokens / 16 reserved slots: 56.2% reserved but empty (9)" in ax.get_title()


def test_block_states_rejects_other_managers():
    with pytest.raises(TypeError, match="BlockManager"):
        block_states(object())


# ---- live -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def test_live_kv_layout_draws_the_running_pool(tiny_model):
    from minillm import LLM

    llm = LLM(tiny_model, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=32, block_size=4,
              num_kv_blocks=24, enable_prefix_caching=True)
    engine = llm.engine
    shared = list(range(3, 15))  # three full blocks of shared prompt
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request({"prompt_token_ids": shared + [20, 21]}, params)
    with LiveView(llm, kind="kv", every=1, render=True, min_interval_s=0, max_overhead=None) as view:
        engine.step()  # the first request's prompt fills and caches 3 blocks
        engine.add_request({"prompt_token_ids": shared + [30]}, params)
        engine.step()  # the second attaches them
        heat, occupancy = view.figure.axes
        grid, _ = block_states(engine.kv)
        assert (grid == SHARED).sum() == 3
        np.testing.assert_array_equal(heat.images[0].get_array().compressed(), grid)
        assert [line.get_label() for line in occupancy.get_lines()] == ["used", "reserved", "total"]
        assert view.num_redraws == 2
        while engine.has_unfinished():
            engine.step()
    heat = view.figure.axes[0]
    final = heat.images[0].get_array().compressed()
    assert not (final >= 0).any() and (final == CACHED).sum() == 5  # the shared 3, and a 4th full block each
    assert "0/24 in use" in heat.get_title()


def test_live_kv_layout_on_slabs(tiny_model):
    from minillm import LLM

    llm = LLM(tiny_model, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=32, kv_layout="slab")
    view = LiveView(llm, kind="kv", render=True, min_interval_s=0, max_overhead=None).attach()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    heat, _ = view.close().axes
    assert heat.images[0].get_array().shape == (2, 32)
    assert "0/2 in use" in heat.get_title()
