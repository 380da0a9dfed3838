"""Named hardware profiles: per-device peak FLOP/s, memory, and alpha-beta links on three levels
of network, and what fails together.

A cluster is slices joined by a slower network: a TPU slice (chips on ICI, several hosts), a GPU
NVLink domain (the 8 GPUs of an H100 host, the 72 of a GB200 NVL72 rack). A link is priced
alpha + bytes / bandwidth; `intra` applies within one host, `inter` between the hosts of one slice,
`dcn` between slices (the data-center network: InfiniBand or Ethernet). A collective pays the
slowest level its group crosses (`Hardware.link`).

Figures are bf16 dense peaks and per-device, one-direction bandwidths from vendor data sheets
(H100 SXM, H200, B200, GB200 NVL72; TPU v4, v5e, v5p, v6e):
DCN per chip 25 Gb/s on v5e (2 x 100 Gb/s per 8-chip host), 50 Gb/s on v5p, 100 Gb/s on v6e
(4 x 200 Gb/s per 8-chip host); 400 Gb/s per GPU (ConnectX-7) on H100, H200, B200 and GB200.
The TPUs' ICI is one torus link in one direction (a ring over one mesh axis uses one dimension
of the torus), below the data sheets' all-links bidirectional figures.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction, per device
    latency: float  # seconds per collective step (alpha)


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # FLOP/s per device
    memory_bytes: int  # per device
    memory_bandwidth: float  # bytes/s
    devices_per_host: int
    intra: Link  # within one host
    inter: Link  # between the hosts of one slice (on GPUs whose slice is one host: unused)
    # XLA:CPU's dot kernels read the lhs with its contracting dimensions minor: a lhs contracted
    # over a major dimension (x^T in a weight gradient) is first copied transposed, a buffer
    # made beside the lhs and freed after the dot. cuBLAS and the TPU's MXU take the transpose
    # in the kernel.
    copies_transposed_lhs: bool = False
    dcn: Link | None = None  # between slices; None: as `inter`
    # A slice's hosts where the cluster does not say: None, the whole cluster one slice (a TPU
    # job on one slice); 1, every host its own slice (a GPU host is its NVLink domain).
    hosts_per_slice: int | None = None
    # What a lost host takes with it: "host" (GPUs go one by one) or "slice" (a TPU slice cannot
    # run with a host missing: its other hosts leave the group too).
    fails_by: str = "host"
    # Devices in one slice for the plan at hand (`sliced`); None: one slice of every device.
    slice_devices: int | None = None

    def link(self, span: int) -> Link:
        """The slowest link a collective crosses whose group spans `span` consecutive devices
        (devices are ordered host-major within a slice, slice-major across slices). A slice
        boundary counts first: slices smaller than a host (emulated ones) still cross the slow link."""
        if self.slice_devices is not None and span > self.slice_devices:
            return self.dcn or self.inter
        return self.intra if span <= self.devices_per_host else self.inter

    def level(self, span: int) -> str:
        """Which network a group spanning `span` consecutive devices crosses: "host", "slice" or "dcn"."""
        if self.slice_devices is not None and span > self.slice_devices:
            return "dcn"
        return "host" if span <= self.devices_per_host else "slice"

    def sliced(self, devices: int, slices: int) -> Hardware:
        """This profile for `devices` laid out as `slices` equal slices."""
        if slices == 1:
            return dataclasses.replace(self, slice_devices=None)
        return dataclasses.replace(self, slice_devices=devices // slices)


def latency_steps(kind: str, group: int) -> int:
    """Latency terms (alpha) one collective pays. All-reduce: a ring's 2(p-1), or a double binary
    tree's 2*ceil(log2 p) where fewer (NCCL picks the tree when latency dominates, as it does
    across many hosts); all-gather and reduce-scatter: a ring's p-1."""
    if group <= 1:
        return 0
    if kind == "all-reduce":
        return min(2 * (group - 1), 2 * math.ceil(math.log2(group)))
    return group - 1


GB = 10**9
GiB = 2**30
Gbit = 10**9 / 8

NVLINK4, NVLINK5 = Link(450 * GB, 3e-6), Link(900 * GB, 3e-6)
CX7 = Link(400 * Gbit, 10e-6)  # 400 Gb/s InfiniBand per GPU


def _tpu(name, flops, memory, bandwidth, per_host, ici, dcn_gbit) -> Hardware:
    return Hardware(
        name, flops, memory, bandwidth, per_host, ici, ici, dcn=Link(dcn_gbit * Gbit, 20e-6), fails_by="slice"
    )


def _gpu(name, flops, memory, bandwidth, nvlink, per_host=8, hosts_per_slice=1) -> Hardware:
    inter = nvlink if hosts_per_slice > 1 else CX7  # a rack's NVLink switches, or the host is the domain
    return Hardware(name, flops, memory, bandwidth, per_host, nvlink, inter, dcn=CX7, hosts_per_slice=hosts_per_slice)


PROFILES: dict[str, Hardware] = {
    "h100": _gpu("h100", 989e12, 80 * GB, 3.35e12, NVLINK4),
    "h200": _gpu("h200", 989e12, 141 * GB, 4.8e12, NVLINK4),
    "b200": _gpu("b200", 2.25e15, 180 * GB, 8e12, NVLINK5),
    # 72 GPUs on one NVLink domain: 18 compute trays of 4 (the rack fails tray by tray).
    "gb200-nvl72": _gpu("gb200-nvl72", 2.5e15, 186 * GB, 8e12, NVLINK5, per_host=4, hosts_per_slice=18),
    "tpu-v4": _tpu("tpu-v4", 275e12, 32 * GiB, 1.2e12, 4, Link(45 * GB, 5e-6), 50),  # DCN: as v5p (no data sheet)
    "tpu-v5p": _tpu("tpu-v5p", 459e12, 95 * GiB, 2.76e12, 4, Link(90 * GB, 5e-6), 50),
    "tpu-v5e": _tpu("tpu-v5e", 197e12, 16 * GB, 0.82e12, 4, Link(45 * GB, 5e-6), 25),
    "tpu-v6e": _tpu("tpu-v6e", 918e12, 32 * GB, 1.64e12, 8, Link(100 * GB, 5e-6), 100),
    # Fake CPU devices in tests: modest figures so that plans are exercised, not praised.
    "cpu": Hardware(
        "cpu", 100e9, 4 * GiB, 20 * GB, 2, Link(5 * GB, 20e-6), Link(1 * GB, 50e-6), copies_transposed_lhs=True
    ),
}


class UnknownHardwareError(KeyError):
    def __init__(self, name: str):
        super().__init__(
            f"unknown hardware profile {name!r}: expected one of {sorted(PROFILES)}; "
            "pass hardware= with one of those names"
        )


def profile(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise UnknownHardwareError(name) from None
