"""Plots of the engine's metrics and live views fed by its observers (chapters 02–07).

Static figures (`plots`) take `StepRecord`s, `RequestMetrics` and `Summary`s; `kv_heatmap` draws
the KV pool's blocks from a live KV manager; `LiveView` (`live`) redraws the same figures while the
engine runs. Colors are shared by every chapter (`style`).
"""

from minillm.viz.kv_heatmap import block_states, plot_kv_blocks, slab_states
from minillm.viz.live import LAYOUTS, Layout, LiveView, in_notebook, register_layout
from minillm.viz.plots import (
    cumulative_padding_waste,
    dashboard,
    draw_dashboard,
    latency_values_ms,
    plot_batch_occupancy,
    plot_kv_occupancy,
    plot_latency_cdfs,
    plot_padding_waste,
    plot_request_latency_cdfs,
    plot_summary_bars,
    plot_tokens_per_step,
    summary_metric,
)
from minillm.viz.style import COLORS, SYSTEM_COLORS, system_colors

__all__ = [
    "COLORS", "LAYOUTS", "SYSTEM_COLORS", "Layout", "LiveView", "block_states", "cumulative_padding_waste",
    "dashboard", "draw_dashboard", "in_notebook", "latency_values_ms", "plot_batch_occupancy", "plot_kv_blocks",
    "plot_kv_occupancy", "plot_latency_cdfs", "plot_padding_waste", "plot_request_latency_cdfs",
    "plot_summary_bars", "plot_tokens_per_step", "register_layout", "slab_states", "summary_metric",
    "system_colors",
]
