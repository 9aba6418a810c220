"""The network in the simulator: links between devices and what collectives cost on them (chapter 12).

Each collective is costed alpha-beta style (Hockney's model): a message of `b` bytes over one link
takes `alpha + b / bandwidth` — a fixed latency per message (launch, synchronisation, the hop) plus
the bytes at the link's speed. A collective over `n` devices is a sequence of such steps; on a ring
(NCCL's default for large messages) each device talks only to its neighbours:

    all-reduce (ring)     2 (n-1) steps of b/n bytes:   2 (n-1) alpha + 2 (n-1)/n * b / bw
                          (a reduce-scatter, then an all-gather of the reduced pieces)
    all-gather            (n-1) steps of b/n bytes:      (n-1) alpha +   (n-1)/n * b / bw
    reduce-scatter        the same as all-gather
    all-to-all            each device sends b/n to each of the n-1 others over a switched fabric
                          (NVSwitch, a fat tree) in n-1 rounds: (n-1) alpha + (n-1)/n * b / bw
    send/recv             one message:                   alpha + b / bw

`b` is the size of the whole tensor one device holds (for all-gather: the gathered output), as
nccl-tests reports "size"; its "bus bandwidth" is b / time times the same factor (2(n-1)/n for
all-reduce), so a link's bandwidth here is what nccl-tests would print as busbw at large sizes.
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)

Small messages (a decode step's all-reduce is batch x hidden x 2 bytes: 16 KiB for one 70B token)
pay almost only the alpha terms; large ones (a prefill's) pay the bandwidth. Real libraries switch
algorithm by size (trees, one-shot all-reduce for small messages) and overlap some of it with
compute; this model does neither, which makes it a simple upper bound to reason with.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A device's connection to its peers, one direction: what it can send while it receives as much.

    `bandwidth_bytes_per_s` is per direction per device (spec sheets often print the sum of both
    directions: NVLink 4's "900 GB/s" is 450 GB/s each way). `latency_s` is the alpha of one message.
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"Link {self.name!r}: bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"Link {self.name!r}: latency_s must be >= 0 seconds, got {self.latency_s!r}")

    def message_time_s(self, num_bytes: float) -> float:
        """One point-to-point message: alpha + bytes / bandwidth."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


# --- presets -------------------------------------------------------------------------------------
# Bandwidths are the vendors' figures, halved where the sheet prints both directions together.
# Latencies (alpha) are not on spec sheets: they are round per-message figures of the right order
# (about a microsecond across NVLink/NVSwitch, a few over PCIe or through an InfiniBand NIC and
# switch), so that a ring all-reduce of a few KiB on 8 GPUs costs 14 us (NVLink) to 42 us
# (InfiniBand), the order of nccl-tests' small-message times. Treat them as knobs: `dataclasses.replace(link, latency_s=...)`.

# NVIDIA A100 Tensor Core GPU datasheet (SXM4): "NVIDIA NVLink: 600GB/s" (third-generation NVLink,
# 12 links x 50 GB/s, both directions), https://www.nvidia.com/en-us/data-center/a100/
NVLINK3_A100 = Link("NVLink3 (A100)", 300e9, 1e-6, "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional")
# NVIDIA H100 Tensor Core GPU datasheet (SXM): "NVIDIA NVLink: 900GB/s" (fourth generation, 18 links);
# the H200 datasheet (SXM) prints the same 900 GB/s. https://www.nvidia.com/en-us/data-center/h100/,
# https://www.nvidia.com/en-us/data-center/h200/
NVLINK4_H100 = Link("NVLink4 (H100/H200)", 450e9, 1e-6, "NVIDIA H100/H200 datasheets: NVLink 900 GB/s bidirectional")
# PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b coding = 31.5 GB/s each way; the A100 PCIe datasheet
# prints "PCIe Gen4: 64GB/s" (both directions). PCI-SIG, PCI Express Base Specification 4.0.
PCIE_GEN4_X16 = Link("PCIe Gen4 x16", 32e9, 2e-6, "PCI-SIG PCIe 4.0 (16 GT/s x16); A100 datasheet: PCIe Gen4 64 GB/s")
# PCIe 5.0 x16: 32 GT/s x 16 lanes = 63 GB/s each way; the H100 datasheet prints "PCIe Gen5: 128GB/s".
PCIE_GEN5_X16 = Link("PCIe Gen5 x16", 64e9, 2e-6, "PCI-SIG PCIe 5.0 (32 GT/s x16); H100 datasheet: PCIe Gen5 128 GB/s")
# InfiniBand, one port per GPU (as in DGX A100 / DGX H100): HDR 200 Gb/s (ConnectX-6, Quantum
# switches) and NDR 400 Gb/s (ConnectX-7, Quantum-2), per direction: 25 and 50 GB/s.
# https://www.nvidia.com/en-us/networking/infiniband-adapters/ (ConnectX-6 / ConnectX-7 product briefs)
INFINIBAND_HDR = Link("InfiniBand HDR (200 Gb/s)", 25e9, 3e-6, "NVIDIA ConnectX-6 HDR: 200 Gb/s per port")
INFINIBAND_NDR = Link("InfiniBand NDR (400 Gb/s)", 50e9, 3e-6, "NVIDIA ConnectX-7 NDR: 400 Gb/s per port")

LINK_PRESETS: dict[str, Link] = {
    link.name: link
    for link in (NVLINK3_A100, NVLINK4_H100, PCIE_GEN4_X16, PCIE_GEN5_X16, INFINIBAND_HDR, INFINIBAND_NDR)
}


def get_link(name: str) -> Link:
    """A preset by (case-insensitive) name or prefix, e.g. `get_link("nvlink4")`, `get_link("pcie gen5")`."""
    matches = [link for key, link in LINK_PRESETS.items() if key.lower().startswith(name.lower())]
    if len(matches) != 1:
        raise ValueError(f"unknown or ambiguous link {name!r}; presets: {', '.join(LINK_PRESETS)}")
    return matches[0]


# --- collectives ---------------------------------------------------------------------------------


def _check(num_bytes: float, num_devices: int) -> None:
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")


def all_reduce_time_s(num_bytes: float, num_devices: int, link: Link) -> float:
    """Ring all-reduce of a `num_bytes` tensor held by each of `num_devices` devices."""
    _check(num_bytes, num_devices)
    n = num_devices
    if n == 1:
        return 0.0  # nothing to reduce with
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * num_bytes / link.bandwidth_bytes_per_s


def all_gather_time_s(output_bytes: float, num_devices: int, link: Link) -> float:
    """Ring all-gather: each device contributes output_bytes / n and ends with all `output_bytes`."""
    _check(output_bytes, num_devices)
    n = num_devices
    if n == 1:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * output_bytes / link.bandwidth_bytes_per_s


def reduce_scatter_time_s(input_bytes: float, num_devices: int, link: Link) -> float:
    """Ring reduce-scatter: the first half of a ring all-reduce (each device keeps 1/n, reduced)."""
    return all_gather_time_s(input_bytes, num_devices, link)


def all_to_all_time_s(send_bytes: float, num_devices: int, link: Link) -> float:
    """All-to-all: each device sends `send_bytes` split evenly over all devices (1/n stays home)."""
    _check(send_bytes, num_devices)
    n = num_devices
    if n == 1:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * send_bytes / link.bandwidth_bytes_per_s


def send_recv_time_s(num_bytes: float, link: Link) -> float:
    """One tensor from one device to the next (pipeline stages hand over hidden states this way)."""
    _check(num_bytes, 1)
    return link.message_time_s(num_bytes)
