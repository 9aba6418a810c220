"""One palette for every chapter's plots (chapters 02–07).

A learner compares figures across chapters, so "prefill" must be the same blue in chapter 02's
padding plot and chapter 08's chunked-prefill plot, and "static" the same color in every CDF.
Padding is drawn in a warning color: it is compute spent on nothing.
"""

from __future__ import annotations

from itertools import cycle

# Work done in a step: real tokens in calm colors, padding in a warning red.
COLORS: dict[str, str] = {
    "prefill": "#4C72B0",  # blue
    "decode": "#55A868",  # green
    "padding": "#D62728",  # warning red
    "running": "#4C72B0",
    "waiting": "#DD8452",  # orange: requests kept waiting
    "limit": "#555555",  # capacity lines (max_num_seqs, KV total)
    "kv_used": "#55A868",
    "kv_reserved": "#CCB974",  # reserved but empty: the slab layout's waste
    "kv_total": "#555555",
    "ttft": "#8172B3",
    "tpot": "#64B5CD",
    "itl": "#937860",
    "e2el": "#DA8BC3",
}

# The batching ladder keeps its colors wherever systems are compared side by side.
SYSTEM_COLORS: dict[str, str] = {
    "static": "#C44E52",
    "dynamic": "#DD8452",
    "continuous": "#4C72B0",
    "paged": "#55A868",
    "prefix": "#8172B3",
    "chunked": "#937860",
    "spec": "#DA8BC3",
}

_FALLBACK = ("#8C8C8C", "#64B5CD", "#CCB974", "#2CA02C", "#9467BD", "#17BECF", "#BCBD22")


def system_colors(labels: list[str]) -> dict[str, str]:
    """A color per label: the ladder's own color where a label names a rung, else a fallback cycle."""
    fallback = cycle(_FALLBACK)
    out = {}
    for label in labels:
        key = next((k for k in SYSTEM_COLORS if k in label.lower()), None)
        out[label] = SYSTEM_COLORS[key] if key is not None else next(fallback)
    return out
