"""minillm/worker/step_layout.py (the step's flat layout, one numba pass) against a plain-Python
statement of the same rules, on random steps: decode rows and multi-token rows mixed, ties in
length, speculative rows (1+k logits rows), prefill chunks that sample nothing, several block
sizes, buffers wider than the step needs; and a plan out of step is refused, not read past."""

from __future__ import annotations

import random

import numpy as np
import pytest

from minillm.worker.step_layout import layout_step


def python_layout(counts, starts, is_decode, widths, rows, table, tokens, bs):
    n = len(counts)
    lens = [s + c for s, c in zip(starts, counts)]
    order = sorted(range(n), key=lambda p: (not is_decode[p], -lens[p], p))
    width = max([1] + [-(-lens[p] // bs) for p in order])
    query_start, positions, token_ids, slots, tables = [0], [], [], [], []
    for p in order:
        query_start.append(query_start[-1] + counts[p])
        tables.append(list(table[rows[p], :width]))
        for pos in range(starts[p], lens[p]):
            positions.append(pos)
            token_ids.append(tokens[rows[p], pos])
            slots.append(table[rows[p], pos // bs] * bs + pos % bs)
    logits = []
    for p in range(n):
        end = query_start[order.index(p) + 1]
        logits += list(range(end - widths[p], end))
    return order, [lens[p] for p in order], query_start, positions, token_ids, slots, tables, logits


@pytest.mark.parametrize("seed", range(40))
def test_layout_step_follows_the_rules(seed):
    rng = random.Random(seed)
    bs, num_rows, batch_rows, max_blocks = rng.choice([1, 2, 4, 16]), rng.randint(1, 9), 12, 80
    table = np.full((batch_rows, max_blocks), -1, dtype=np.int32)
    tokens = np.array([[rng.randrange(4096) for _ in range(bs * max_blocks)] for _ in range(batch_rows)])
    rows = rng.sample(range(batch_rows), num_rows)
    counts, starts, is_decode, widths = [], [], [], []
    free = iter(rng.sample(range(2000), batch_rows * max_blocks))
    for r in rows:
        kind = rng.choice(["decode", "decode", "prefill", "chunk", "spec"])
        start = 0 if kind == "prefill" else rng.choice([1, 5, 16, 17, 30])  # equal lengths make ties
        count = {"decode": 1, "prefill": rng.randint(2, 40), "chunk": rng.randint(1, 20), "spec": rng.randint(2, 5)}[kind]
        counts.append(count)
        starts.append(start)
        is_decode.append(kind == "decode")
        widths.append({"decode": 1, "prefill": 1, "chunk": rng.choice([0, 1]), "spec": count}[kind])
        for b in range(-(-(start + count) // bs)):
            table[r, b] = next(free)
    args = (np.array(counts, dtype=np.int64), np.array(starts, dtype=np.int64), np.array(is_decode),
            np.array(widths, dtype=np.int64), np.array(rows, dtype=np.int64), table, tokens, bs)
    got = layout_step(*args)
    want = python_layout(counts, starts, is_decode, widths, rows, table, tokens, bs)
    for name, g, w in zip(("order", "seq_lens", "query_start", "positions", "token_ids", "slot_mapping", "tables",
                           "logits_rows"), got, want):
        assert g.tolist() == [list(map(int, x)) for x in w] if name == "tables" else g.tolist() == list(map(int, w)), name
    assert got[1].dtype == got[2].dtype == np.int32 and got[5].dtype == np.int64


def test_a_row_longer_than_the_input_batch_is_refused():
    table = np.array([[3, -1]], dtype=np.int32)
    tokens = np.zeros((1, 8), dtype=np.int64)
    args = [np.array([1]), np.array([8]), np.array([True]), np.array([1]), np.array([0]), table, tokens, 4]
    with pytest.raises(ValueError, match="more blocks or tokens than the input batch holds"):
        layout_step(*args)
