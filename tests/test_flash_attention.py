"""The tiled attention kernel (chapter 10): against its reference on the simulator, on ragged
varlen batches, with its HBM bytes measured by tracing (tests/flash_checks.py, a fresh process
with NUMBA_ENABLE_CUDASIM=1), and compiled to PTX for sm_90 in a process without the simulator,
where its shared-memory tiles and barriers must be real. Cost on this CPU: ~10-16 s and ~15-20 s (under load)."""

from __future__ import annotations

import pytest
from conftest import REPO_ROOT, run_numba_script

run = run_numba_script  # conftest: a child process on the simulator, or without it for PTX


@pytest.mark.slow
def test_flash_attention_matches_its_reference_on_ragged_batches_in_the_simulator():
    proc = run([str(REPO_ROOT / "tests" / "flash_checks.py")], simulator=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("PASS") for line in lines) == 9 and not any(line.startswith("FAIL") for line in lines)


PTX_SCRIPT = """
from numba import cuda, types
from minillm.kernels import tiled_attention as fa
for dtype in ("float32",):  # float16: tests/test_kernels.py compiles every kernel in it too
    t = getattr(types, dtype)
    x3, x4 = types.Array(t, 3, "C"), types.Array(t, 4, "C")
    i2, i1 = types.Array(types.int32, 2, "C"), types.Array(types.int32, 1, "C")
    ptx, _ = cuda.compile_ptx(fa.python_function, (x3, x4, x4, i2, i1, i1, types.float32, x3), cc=(9, 0))
    print(dtype, ptx.count(".entry"), ".target sm_90" in ptx, ptx.count("bar.sync"), ".shared" in ptx)
"""


@pytest.mark.slow
def test_flash_attention_compiles_to_ptx_for_sm90_with_shared_tiles_and_barriers():
    # test_kernels.py compiles it with the others (sm_80/sm_90, float32/float16); this checks the tiles are real
    proc = run(["-c", PTX_SCRIPT], simulator=False)
    assert proc.returncode == 0, proc.stderr
    for line, dtype in zip(proc.stdout.splitlines(), ("float32",), strict=True):
        name, entries, target, barriers, shared = line.split()
        assert (name, entries, target, shared) == (dtype, "1", "True", "True") and int(barriers) >= 2, line



def test_tile_picture_hatches_the_keys_a_band_loads_but_a_row_masks():
    import matplotlib

    matplotlib.use("Agg")
    from minillm.kernels.pictures import plot_tile_loads

    ax = plot_tile_loads(q_len=12, seq_len=16, block_m=4, block_n=4)
    # each band of 4 rows loads keys up to its last row: its rows mask 3, 2, 1, 0 of them
    assert len(ax.patches) == 3 * (3 + 2 + 1)
    ax = plot_tile_loads(q_len=5, seq_len=5, block_m=8, block_n=2)  # one band, a fresh prompt
    assert len(ax.patches) == 4 + 3 + 2 + 1
