"""numba.cuda kernels (chapter 10), tested without a GPU: against their torch references on numba's
CUDA simulator (tests/kernel_checks.py, a fresh process with NUMBA_ENABLE_CUDASIM=1; the warp-shuffle
decode variant with shuffles emulated there), compiled for real to PTX for sm_80 and sm_90 in float32
and float16 (a process without the simulator: it has no compiler), and the CUDA-graph bucket logic."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO_ROOT, run_numba_script

from minillm.kernels import KERNELS, io_model
from minillm.kernels.cuda_graphs import DecodeGraphs, DecodeInputs, pad_decode_inputs, pick_bucket
from minillm.kernels.scenarios import paged_scenario

run = run_numba_script  # conftest: a child process on the simulator, or without it for PTX


@pytest.mark.slow
def test_kernels_match_their_references_in_the_simulator_and_the_engine_agrees():
    proc = run([str(REPO_ROOT / "tests" / "kernel_checks.py")], simulator=True)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum(line.startswith("PASS") for line in lines) == 9 and not any(line.startswith("FAIL") for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize(("cc", "dtype"), [(80, "float32"), (90, "float32"), (90, "float16")])
def test_every_kernel_compiles_to_ptx(cc, dtype):
    proc = run(["-m", "minillm.kernels.ptx", "--cc", str(cc), "--dtype", dtype], simulator=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(KERNELS)
    assert all(line.endswith("ok") and f"sm_{cc} {dtype}" in line for line in lines)
    shuffles = {line.split()[0]: int(line.split(" warp shuffles")[0].rsplit(" ", 1)[1]) for line in lines}
    assert shuffles["paged_attention_decode_warp"] > 0  # the fast variant really uses shfl.sync
    assert shuffles["paged_attention_decode"] == 0  # the simulatable one cannot


NO_SIMULATOR_SCRIPT = """
import pytest
from minillm import LLM
with pytest.raises(RuntimeError, match="NUMBA_ENABLE_CUDASIM=1"):  # at start-up: the warm-up runs a step
    LLM(max_num_seqs=2, attention_backend="numba")
with pytest.raises(ValueError, match="attention_backend"):
    LLM(attention_backend="triton")
print("ok")
"""


@pytest.mark.slow
def test_the_numba_backend_on_a_cpu_without_the_simulator_says_what_to_do():
    # A fresh process: this one may have imported numba under the simulator (exercise 10 does).
    proc = run(["-c", NO_SIMULATOR_SCRIPT], simulator=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def _decode_inputs(lens: list[int], width: int) -> DecodeInputs:
    b = len(lens)
    tables = torch.full((b, width), -1, dtype=torch.int32)
    for i, n in enumerate(lens):
        tables[i, : -(-n // 4)] = torch.arange(10 * i, 10 * i + -(-n // 4), dtype=torch.int32)
    return DecodeInputs(torch.arange(100, 100 + b), torch.tensor(lens) - 1,
                        torch.tensor([int(tables[i, (n - 1) // 4]) * 4 + (n - 1) % 4 for i, n in enumerate(lens)]),
                        tables, torch.tensor(lens, dtype=torch.int32))


def test_cuda_graph_buckets_pick_the_smallest_that_fits():
    assert [pick_bucket(b, (1, 2, 4, 8)) for b in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert pick_bucket(3, (8, 4, 2)) == 4  # order of the buckets does not matter
    with pytest.raises(ValueError, match="largest captured bucket 8"):
        pick_bucket(9, (1, 2, 4, 8))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        pick_bucket(0)


def test_padding_a_decode_step_to_a_bucket_keeps_real_rows_and_makes_padding_inert():
    real = _decode_inputs([5, 1, 9], width=3)
    padded = pad_decode_inputs(real, bucket=8, table_width=6, null_block=77)
    assert padded.batch_size == 8 and padded.block_tables.shape == (8, 6)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(padded, name)[:3], getattr(real, name)), name
    assert torch.equal(padded.block_tables[:3, :3], real.block_tables)
    assert (padded.block_tables[:3, 3:] == -1).all()  # wider table: -1, never read (seq_lens unchanged)
    # padding rows: token 0 at position 0, nothing written, one key read from the null block
    assert padded.input_ids[3:].tolist() == [0] * 5 and padded.positions[3:].tolist() == [0] * 5
    assert padded.slot_mapping[3:].tolist() == [-1] * 5 and padded.seq_lens[3:].tolist() == [1] * 5
    assert padded.block_tables[3:, 0].tolist() == [77] * 5 and (padded.block_tables[3:, 1:] == -1).all()
    assert padded.seq_lens.dtype == torch.int32 and padded.block_tables.dtype == torch.int32
    with pytest.raises(ValueError, match="captured width 2"):
        pad_decode_inputs(real, bucket=8, table_width=2, null_block=77)
    with pytest.raises(ValueError, match="do not fit a bucket of 2"):
        pad_decode_inputs(real, bucket=2, table_width=6, null_block=77)


def test_decode_graphs_refuse_a_cpu_pool():
    with pytest.raises(RuntimeError, match="CUDA device"):
        DecodeGraphs(model=None, k_pool=torch.zeros(1), v_pool=torch.zeros(1), block_size=4, null_block=0,
                     max_blocks_per_seq=4)


def test_flash_attention_io_count():
    n, d, heads = 4096, 128, 32
    assert io_model.tile_rows(d, 100 * 1024, 2) == 100  # M = 51200 fp16 numbers, / (4 * 128)
    standard = io_model.attention_hbm_bytes(n, d, heads, 2, "standard")
    assert standard == (4 * n * n + 4 * n * d) * heads * 2
    tiled = io_model.attention_hbm_bytes(n, d, heads, 2, "tiled", block_rows=100)
    assert tiled == (2 * n * d + 2 * n * d * 41) * heads * 2  # K and V re-read once per 100-row query tile
    assert io_model.attention_hbm_bytes(n, d, heads, 2, "eager") > standard > tiled
    assert io_model.score_matrix_bytes(16384, 32, 2) == 16384**2 * 64
    with pytest.raises(ValueError, match="variant must be"):
        io_model.attention_hbm_bytes(n, d, heads, 2, "flash")
    with pytest.raises(ValueError, match="block_rows"):
        io_model.attention_hbm_bytes(n, d, heads, 2, "tiled")


def test_paged_scenarios_are_ragged_scattered_and_poisoned():
    s = paged_scenario([1, 4, 5, 13], block_size=4, num_blocks=12, kv_heads=2, q_heads=4, head_dim=8, seed=3)
    used = [int(x) for row in s.block_tables for x in row if x >= 0]
    assert len(used) == 1 + 1 + 2 + 4 == len(set(used)) and 11 not in used  # the last block stays free
    assert (s.block_tables[:, -1] == -1).all()  # one extra -1 column
    assert s.key_cache[11].isnan().all() and s.key_cache[s.block_tables[2, 1], 1:].isnan().all()
    assert not s.key_cache[s.block_tables[2, 1], 0].isnan().any()  # position 4 of the 5-token sequence
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_scenario([3], block_size=4, num_blocks=4, kv_heads=3, q_heads=4, head_dim=8, seed=0)
    with pytest.raises(ValueError, match="too small"):
        paged_scenario([16], block_size=4, num_blocks=4, kv_heads=1, q_heads=1, head_dim=8, seed=0)


def test_bfloat16_tensors_are_refused_with_what_to_use_instead():
    from minillm.kernels._launch import device_array

    with pytest.raises(TypeError, match="no bfloat16 arrays.*float16"):
        device_array(torch.zeros(4, dtype=torch.bfloat16))


@pytest.mark.slow
def test_the_gpu_benchmark_script_runs_its_kernel_checks_in_a_dry_run():
    # bench/gpu.py is meant for a GPU nobody here has: its kernel checks and bandwidth loop run on
    # the simulator at tiny sizes, so a GPU session does not find a broken script.
    proc = run([str(REPO_ROOT / "bench" / "gpu.py"), "--dry-run"], simulator=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("PASS") for line in lines) == 6 and lines[-1].startswith("dry run: ok")
