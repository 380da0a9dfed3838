"""Named hardware profiles: per-device peak FLOP/s, memory, and alpha-beta links per mesh level.

Figures are bf16 dense peaks from vendor data sheets (H100 SXM, H200, TPU v4, v5e, v5p). A link is priced
alpha + bytes / bandwidth; `intra` applies within one host (NVLink, ICI), `inter` across hosts.
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
    intra: Link
    inter: Link
    # XLA:CPU's dot kernels read the lhs with its contracting dimensions minor: a lhs contracted
    # over a major dimension (x^T in a weight gradient) is first copied transposed, a buffer
    # made beside the lhs and freed after the dot. cuBLAS and the TPU's MXU take the transpose
    # in the kernel.
    copies_transposed_lhs: bool = False

    def link(self, group_size: int) -> Link:
        """The slowest link a collective over `group_size` consecutive devices crosses."""
        return self.intra if group_size <= self.devices_per_host else self.inter


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

PROFILES: dict[str, Hardware] = {
    "h100": Hardware("h100", 989e12, 80 * GB, 3.35e12, 8, Link(450 * GB, 3e-6), Link(50 * GB, 10e-6)),
    "h200": Hardware("h200", 989e12, 141 * GB, 4.8e12, 8, Link(450 * GB, 3e-6), Link(50 * GB, 10e-6)),
    "tpu-v4": Hardware("tpu-v4", 275e12, 32 * GiB, 1.2e12, 4, Link(45 * GB, 5e-6), Link(45 * GB, 5e-6)),
    "tpu-v5p": Hardware("tpu-v5p", 459e12, 95 * GiB, 2.76e12, 4, Link(90 * GB, 5e-6), Link(90 * GB, 5e-6)),
    "tpu-v5e": Hardware("tpu-v5e", 197e12, 16 * GB, 0.82e12, 4, Link(45 * GB, 5e-6), Link(45 * GB, 5e-6)),
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
