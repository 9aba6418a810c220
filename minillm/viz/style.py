"""One palette and one provenance label for every chapter's plots (chapters 00–11).

A learner compares figures across chapters, so "continuous" must be the same blue in chapter 03's
TTFT sweep and chapter 08's ladder, and "static" the same red in every CDF. Two rules:

- **one colour per system** (`SYSTEM_COLORS`, looked up with `system_color` / `system_colors`):
  the batching ladder, the KV layouts, the named peer (HF transformers) and the simulator's
  reference lines (physical floor, the seeds' "in practice" range, published measurements);
- **every panel says where its numbers come from** (`label_measured`, `label_simulated`): a
  measurement on this CPU with the tiny bundled model and a simulated 7B on an A100 look alike
  on a chart and are not comparable.

    from minillm.viz.style import SYSTEM_COLORS, label_measured, label_simulated, system_color
    ax.plot(x, y, color=system_color("dynamic"), label="dynamic 100 ms")
    label_simulated(ax)                  # "simulated: 7B on A100-80GB"
    label_measured(ax)                   # "measured: this CPU, tiny model"

Work inside a step keeps calm colours for real tokens and a warning red for padding (`COLORS`).
"""

from __future__ import annotations

import re
from itertools import cycle

from matplotlib import rcParams
from matplotlib.axes import Axes
from matplotlib.text import Text

# Work done in a step: real tokens in calm colors, padding in a warning red.
COLORS: dict[str, str] = {
    "prefill": "#4C72B0",  # blue
    "decode": "#55A868",  # green
    "padding": "#D62728",  # warning red
    "finished_row": "#F2B8B8",  # a finished row still computed: pale red, waste of the output side
    "held": "#E8C4A0",  # a finished result held back until its batch ends (Orca's second waste)
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

# One color per system, wherever systems are compared side by side. The keys are the names the
# chapters use; `SYSTEM_ALIASES` maps other spellings onto them.
SYSTEM_COLORS: dict[str, str] = {
    "static": "#C44E52",  # red
    "dynamic": "#DD8452",  # orange
    "continuous": "#4C72B0",  # blue
    "slab": "#CCB974",  # khaki: the max-length reservation of chapter 05
    "paged": "#55A868",  # green
    "prefix": "#8172B3",  # purple: prefix-cached
    "chunked": "#937860",  # brown
    "spec": "#DA8BC3",  # pink: speculative decoding
    "hf": "#8C8C8C",  # grey: the named peer, HF transformers' generate()
    "floor": "#000000",  # black: the roofline's physical floor (simulated, no overhead)
    "practice": "#BBBBBB",  # light grey band: the seeds' illustrative "in practice" ranges
    "published": "#17BECF",  # cyan: a real engine's published measurement
}

SYSTEM_ALIASES: dict[str, str] = {
    "prefix-cached": "prefix", "prefix cache": "prefix", "radix": "prefix", "hash": "prefix",
    "speculative": "spec", "ngram": "spec", "draft": "spec",
    "transformers": "hf", "hugging face": "hf", "huggingface": "hf",
    "physical floor": "floor", "roofline": "floor", "in practice": "practice",
    "vllm (published)": "published", "reported": "published",
}

# The ladder in the order the course climbs it: a label naming several rungs ("continuous + paged")
# takes the color of the most advanced one, the feature it adds.
LADDER = ("static", "dynamic", "continuous", "slab", "paged", "prefix", "chunked", "spec")

_FALLBACK = ("#2CA02C", "#9467BD", "#BCBD22", "#E377C2", "#7F7F7F", "#1F77B4", "#FF7F0E")


def _names(text: str, name: str) -> bool:
    # A name counts where a word starts with it: "speculative" names spec, "shift" does not name hf.
    return re.search(rf"(?<![a-z0-9]){re.escape(name)}", text) is not None


def _system_key(label: str) -> str | None:
    text = label.lower()
    named = {k for k in SYSTEM_COLORS if _names(text, k)}
    named |= {v for alias, v in SYSTEM_ALIASES.items() if _names(text, alias)}
    if not named:
        return None
    rungs = [k for k in LADDER if k in named]
    return rungs[-1] if rungs else sorted(named)[0]


def system_color(label: str) -> str:
    """The color of the system a label names ("dynamic 100 ms" → dynamic's orange).

    Raises KeyError naming the known systems when the label names none of them.
    """
    key = _system_key(label)
    if key is None:
        raise KeyError(f"{label!r} names no known system; known: {sorted(SYSTEM_COLORS)} "
                       f"(or aliases {sorted(SYSTEM_ALIASES)})")
    return SYSTEM_COLORS[key]


def system_colors(labels: list[str]) -> dict[str, str]:
    """A color per label: the system's own color where a label names one, else a fallback cycle."""
    fallback = cycle(_FALLBACK)
    out = {}
    for label in labels:
        key = _system_key(label)
        out[label] = SYSTEM_COLORS[key] if key is not None else next(fallback)
    return out


# ---- where a panel's numbers come from ---------------------------------------------------------
PROVENANCE_GID = "minillm-provenance"
PROVENANCE_KINDS = ("measured", "simulated")
_LABEL_PAD_PT = 9  # the label's line height at x-small, in points


def label_provenance(ax: Axes, kind: str, what: str) -> Text:
    """Write "<kind>: <what>" in small grey type above the panel's top-right corner.

    The panel's title moves up a line to make room, so call this after `set_title`.

    `kind` is "measured" (a wall clock on the machine running the notebook) or "simulated"
    (minillm.sim's cost model). Calling it again on the same panel replaces the label.
    """
    if kind not in PROVENANCE_KINDS:
        raise ValueError(f"kind={kind!r}; choose one of {PROVENANCE_KINDS}")
    if not what or not what.strip():
        raise ValueError("say what was measured or simulated, e.g. 'this CPU, tiny model'")
    for old in [t for t in ax.texts if t.get_gid() == PROVENANCE_GID]:
        old.remove()
    text = ax.text(1.0, 1.005, f"{kind}: {what}", transform=ax.transAxes, ha="right", va="bottom",
                   fontsize="x-small", color="#555555", style="italic", gid=PROVENANCE_GID)
    # Lift the title one small line, above the label (label after set_title). A panel may carry a
    # centre, a left and a right title (`set_title(loc=...)`); each is lifted.
    titles = {"center": ax.title, "left": getattr(ax, "_left_title", None), "right": getattr(ax, "_right_title", None)}
    for loc, title in titles.items():
        if title is not None and title.get_text():
            ax.set_title(title.get_text(), loc=loc, fontsize=title.get_fontsize(),
                         fontweight=title.get_fontweight(), pad=rcParams["axes.titlepad"] + _LABEL_PAD_PT)
    return text


def label_measured(ax: Axes, what: str = "this CPU, tiny model") -> Text:
    """Label a panel "measured: this CPU, tiny model" (or another `what`, e.g. "this GPU, tiny model")."""
    return label_provenance(ax, "measured", what)


def label_simulated(ax: Axes, model: str = "7B", hardware: str = "A100-80GB") -> Text:
    """Label a panel "simulated: 7B on A100-80GB" (or another model / hardware preset)."""
    return label_provenance(ax, "simulated", f"{model} on {hardware}")


def provenance(ax: Axes) -> str | None:
    """The provenance label of a panel, or None if it has none (tests check every panel has one)."""
    labels = [t.get_text() for t in ax.texts if t.get_gid() == PROVENANCE_GID]
    return labels[0] if labels else None
