"""Known-wrong answers to exercise 14 (int8 KV per token and head, StreamingLLM's keep-set, both in the engine):
see tests/known_wrong/__init__.py.

The bug classes: a scale over too much (the whole tensor, a token's heads together), a scale of zero for a
head of zeros, truncation instead of rounding, the signed max instead of the magnitude, an input changed in
place; a dequantize that forgets the scale or the dtype; a keep-set that loses the sinks, is one off at the
window's edge or evicts before the budget is reached; a round trip that skips quantizing or cannot take the
engine's non-contiguous K; and delegating to the library (`round_trip`, `streaming_keep_positions`)."""

from known_wrong import Mutant, code_reused, reads_the_checks_frame, source_reexecuted

AMAX = "largest = x.abs().amax(dim=-1, keepdim=True)"
SCALES = "scales = torch.where(largest == 0, torch.ones_like(largest), largest / 127.0)"
CODES = "codes = (x / scales).round().clamp(min=-127, max=127).to(torch.int8)"
WINDOW = "window_start = seq_len - (budget - num_sinks)"

KNOWN_WRONG = [
    # task 1: quantize
    Mutant(1, "one scale for the whole tensor", edits=((AMAX, "largest = x.abs().amax().expand(*x.shape[:2], 1)"),),
           expect="one scale per token and head"),
    Mutant(1, "one scale per token, over all its heads",
           edits=((AMAX, "largest = x.abs().amax(dim=(-2, -1), keepdim=True).expand(*x.shape[:2], 1)"),),
           expect="from that head's own values"),
    Mutant(1, "a head of zeros gets scale 0 (and 0/0 codes)", edits=((SCALES, "scales = largest / 127.0"),),
           expect="divided by zero"),
    Mutant(1, "truncates instead of rounding", edits=((CODES, "codes = (x / scales).clamp(min=-127, max=127).to(torch.int8)"),),
           expect="round to the nearest"),
    Mutant(1, "the signed max, not the largest magnitude", edits=((AMAX, "largest = x.amax(dim=-1, keepdim=True).clamp(min=0)"),),
           expect="scale"),
    Mutant(1, "scale = largest / 128 (as if codes went to 128)",
           edits=((SCALES, "scales = torch.where(largest == 0, torch.ones_like(largest), largest / 128.0)"),),
           expect="maps it to ±127"),
    Mutant(1, "divides x in place", edits=((CODES, "codes = x.div_(scales).round().clamp(min=-127, max=127).to(torch.int8)"),),
           expect="changed its input"),
    Mutant(1, "scales without the trailing axis", edits=(("    return codes, scales\n", "    return codes, scales[..., 0]\n"),),
           expect="keepdim"),
    Mutant(1, "delegates to the simulated quantizer (round_trip) and recovers the codes", code=(
        "from minillm.kv.simulated_quant import round_trip as _rt\n"
        "def quantize_int8(x):\n"
        "    scales = x.abs().amax(dim=-1, keepdim=True) / 127\n"
        "    scales = torch.where(scales == 0, torch.ones_like(scales), scales)\n"
        "    return (_rt(x, 'int8') / scales).round().to(torch.int8), scales\n"), expect="reference"),
    Mutant(1, "delegates to the engine's int8 pool code (minillm.kv.quant.quantize_int8)", code=(
        "from minillm.kv.quant import quantize_int8 as _q\n"
        "def quantize_int8(x):\n    codes, scales = _q(x)\n    return codes, scales[..., None]\n"), expect="reference"),
    reads_the_checks_frame(1, "def quantize_int8(x):\n    return _expected()\n", var="got"),
    # task 2: dequantize
    Mutant(2, "forgets the scale", edits=(("return codes.to(dtype) * scales.to(dtype)", "return codes.to(dtype)"),),
           expect="expected code x scale"),
    Mutant(2, "divides by the scale", edits=(("return codes.to(dtype) * scales.to(dtype)", "return codes.to(dtype) / scales.to(dtype)"),),
           expect="expected code x scale"),
    Mutant(2, "ignores the dtype asked for", edits=(("return codes.to(dtype) * scales.to(dtype)", "return codes * scales"),),
           expect="the dtype"),
    Mutant(2, "the first token's scales for every token",
           edits=(("return codes.to(dtype) * scales.to(dtype)", "return codes.to(dtype) * scales[:1].to(dtype)"),),
           expect="expected code x scale"),
    Mutant(2, "delegates to minillm.kv.quant.dequantize_int8", code=(
        "from minillm.kv.quant import dequantize_int8 as _d\n"
        "def dequantize_int8(codes, scales, dtype=torch.float32):\n    return _d(codes, scales[..., 0]).to(dtype)\n"),
        expect="reference"),
    # task 3: the keep-set
    Mutant(3, "no sinks: the recent window only", edits=(("if p < num_sinks or p >= window_start", "if p >= window_start"),),
           expect="kept"),
    Mutant(3, "the window one too wide", edits=((WINDOW, "window_start = seq_len - (budget - num_sinks) - 1"),),
           expect="kept"),
    Mutant(3, "the window as wide as the whole budget (the sinks on top)", edits=((WINDOW, "window_start = seq_len - budget"),),
           expect="kept"),
    Mutant(3, "the newest token left out (the window ends one early)",
           edits=(("if p < num_sinks or p >= window_start", "if p < num_sinks or window_start - 1 <= p < seq_len - 1"),),
           expect="missing"),
    Mutant(3, "the window listed before the sinks", code=(
        "def streaming_keep_set(seq_len, budget, num_sinks):\n"
        "    if seq_len <= budget:\n        return list(range(seq_len))\n"
        "    return list(range(seq_len - budget + num_sinks, seq_len)) + list(range(num_sinks))\n"),
        expect="increasing order"),
    Mutant(3, "the window's positions counted from the budget, not the end",
           edits=((WINDOW, "window_start = budget - num_sinks"),), expect="kept"),
    Mutant(3, "delegates to minillm's streaming_keep_positions", code=(
        "from minillm.kv.eviction import streaming_keep_positions as _ref\n"
        "def streaming_keep_set(seq_len, budget, num_sinks):\n    return list(_ref(seq_len, budget, num_sinks))\n"),
        expect="reference"),
    code_reused(3, "streaming_keep_set", "minillm.kv.eviction", "streaming_keep_positions"),
    source_reexecuted(3, "streaming_keep_set", "minillm.kv.eviction", "streaming_keep_positions"),
    Mutant(3, "the library's answer under another name: streaming_keep_positions handed in as it is",
           code="from minillm.kv.eviction import streaming_keep_positions as streaming_keep_set\n"),
    reads_the_checks_frame(3, "def streaming_keep_set(seq_len, budget, num_sinks):\n    return _expected()\n", var="want"),
    # task 4: both in the engine
    Mutant(4, "a round trip that does not quantize", code="def kv_round_trip(x):\n    return x.clone()\n",
           expect="int8 grid"),
    Mutant(4, "a round trip that views its input flat (the engine's K is a slice: not contiguous)", code=(
        "def kv_round_trip(x):\n"
        "    flat = x.view(-1, x.shape[-1])[:, None]\n"
        "    codes, scales = quantize_int8(flat)\n"
        "    return dequantize_int8(codes, scales, x.dtype).view(x.shape)\n"), expect="view"),
    Mutant(4, "a round trip in float32 inside a float64 engine",
           edits=(("    return dequantize_int8(codes, scales, x.dtype)\n", "    return dequantize_int8(codes, scales)\n"),),
           expect="Float"),
    Mutant(4, "delegates to the simulated quantizer", code=(
        "from minillm.kv.simulated_quant import round_trip as _rt\n"
        "def kv_round_trip(x):\n    return _rt(x, 'int8')\n"), expect="reference"),
]
