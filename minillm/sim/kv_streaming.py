"""Layer-wise KV streaming: sending layer i's KV while layer i + 1 is prefilled (chapter 13).

Disaggregated serving moves a prompt's KV cache from the prefill instance to the decode instance.
Sent in one piece after the prefill (`disagg.kv_transfer_time_s`), the whole transfer adds to TTFT.
But a layer's KV is final as soon as that layer has run, so the prefill instance can send layer i
while it computes layer i + 1 (Splitwise's layer-wise transfer; Mooncake and vLLM's connectors
offer the same). Then only what the link has not caught up with by the end of the prefill shows:

    layer i done at            c_i = (i + 1) * prefill_s / L
    layer i sent from          s_i = max(c_i, f_{i-1})            (one message at a time on the link)
    layer i arrived at         f_i = s_i + alpha + kv_bytes / L / bandwidth
    TTFT's transfer part       f_{L-1} - prefill_s

If a layer's message is shorter than a layer's compute, the link keeps up and only the last layer's
message is left (alpha + bytes / L / bandwidth); if it is longer, the link falls behind and the
tail is the whole transfer minus what overlapped: about bytes / bandwidth - prefill_s + one layer's
compute, never less than sending it in one piece minus the prefill. The L messages each pay alpha,
so for tiny layers streaming can even cost more than one message. Layers are assumed equal
(a Llama decoder's are) and the prefill's time spread evenly over them.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm.sim.network import Link


@dataclass(frozen=True)
class StreamedTransfer:
    """A prompt's KV over one link after (`after_s`) or during (`streamed_s`) its prefill of `prefill_s`."""

    prefill_s: float
    num_layers: int
    kv_bytes: float
    after_s: float  # one message after the prefill: alpha + bytes / bandwidth
    streamed_s: float  # what is left after the prefill when layer i is sent during layer i + 1

    @property
    def ttft_after_s(self) -> float:
        """Prefill, then the whole transfer (queueing aside)."""
        return self.prefill_s + self.after_s

    @property
    def ttft_streamed_s(self) -> float:
        return self.prefill_s + self.streamed_s

    @property
    def hidden_share(self) -> float:
        """Share of the one-piece transfer that streaming hid behind the prefill (negative: it cost more)."""
        return 1 - self.streamed_s / self.after_s if self.after_s else 0.0


def stream_kv_by_layer(prefill_s: float, num_layers: int, kv_bytes: float, link: Link) -> StreamedTransfer:
    """The transfer's share of TTFT with and without layer-wise streaming (the module's recurrence)."""
    if not prefill_s >= 0 or num_layers < 1 or not kv_bytes >= 0:
        raise ValueError(f"need prefill_s >= 0, num_layers >= 1 and kv_bytes >= 0, got {prefill_s!r}, "
                         f"{num_layers!r}, {kv_bytes!r}")
    per_layer_s = link.message_time_s(kv_bytes / num_layers)
    finished = 0.0
    for i in range(num_layers):
        done = (i + 1) * prefill_s / num_layers
        finished = max(done, finished) + per_layer_s
    return StreamedTransfer(prefill_s, num_layers, kv_bytes, link.message_time_s(kv_bytes), finished - prefill_s)
