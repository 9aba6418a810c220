"""The simulator: hardware presets, model shapes, a roofline step-time model, and the engine on top.

Chapter 00 draws rooflines with it, chapter 01 sizes KV caches, chapter 04 checks its predicted
step times against measured ones. `SimExecutor` and `simulate()` drive the real scheduler and KV
manager on a simulated clock with these pieces (chapters 02-08). Chapter 12 adds links between
devices (`network`) and TP/PP/DP layouts (`parallel`; MoE experts: `expert_parallel`). Chapter 13
serves with several engines: prefill/decode disaggregation (`disagg`, `goodput`), a TP/PP layout
per instance and per phase (`instance_layout`, `phase_layouts`) and layer-wise KV streaming
(`kv_streaming`).
"""

from minillm.sim.cost_model import (
    StepCost,
    decode_step_time,
    max_batch_for_kv,
    prefill_time,
    step_time,
    weight_bytes_read_per_step,
)
from minillm.sim.executor import SimExecutor
from minillm.sim.hardware import (
    A100_80GB,
    H100_SXM,
    H200,
    PRESETS,
    Hardware,
    get_hardware,
    measure_this_cpu,
    roofline,
    roofline_points,
)
from minillm.sim.model_shapes import (
    LLAMA_7B,
    LLAMA_7B_GQA,
    LLAMA_70B,
    MODEL_PRESETS,
    ModelShape,
    from_hf_config,
    get_model_shape,
)
from minillm.sim.network import LINK_PRESETS, Link, get_link
from minillm.sim.parallel import layout_summary, memory_per_device, pp_decode, tp_decode_scaling
from minillm.sim.simulate import SimResult, kv_capacity_tokens, simulate

__all__ = [
    "A100_80GB",
    "H100_SXM",
    "H200",
    "LLAMA_7B",
    "LLAMA_7B_GQA",
    "LINK_PRESETS",
    "LLAMA_70B",
    "Link",
    "MODEL_PRESETS",
    "PRESETS",
    "Hardware",
    "ModelShape",
    "SimExecutor",
    "SimResult",
    "StepCost",
    "decode_step_time",
    "from_hf_config",
    "get_hardware",
    "get_link",
    "get_model_shape",
    "kv_capacity_tokens",
    "layout_summary",
    "max_batch_for_kv",
    "measure_this_cpu",
    "memory_per_device",
    "pp_decode",
    "prefill_time",
    "roofline",
    "roofline_points",
    "simulate",
    "step_time",
    "tp_decode_scaling",
    "weight_bytes_read_per_step",
]
