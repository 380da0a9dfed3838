"""The meshes the planner searches: every factoring of the devices (and of the most devices the
batch divides, 6 of 7 for a batch of 24) into (data, seq, model), `data` dividing the batch and
`seq` the sequence of every batch leaf; on slices, (replica, data, seq, model) laid out
slice-major, with the slow link crossed only by data parallelism unless nothing else fits, and
meshes whose `expert` axis spans whole slices where the step has stacked experts. The fast level
keeps to meshes without seq and with model within a host (`fast_mesh`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .analysis import Inputs, experts
from .errors import PlanInputError
from .hardware import Hardware


def mesh_shapes(devices: int, inputs: Inputs, hw: Hardware, level: str, cross: bool = False) -> list[dict[str, int]]:
    """(data, seq, model) factorizations of all the devices, and of the most devices whose count
    the batch divides (6 of 7 for a batch of 24). `data` must divide the batch and `seq` every
    batch leaf's sequence. The fast level keeps to meshes without seq and with model within a
    host (`fast_mesh`), except where none of those uses every device (a batch of 64 on 1,024):
    then it also prices all-device meshes with the largest data axis the batch allows, the rest
    of the devices over seq and model (model within a host where one allows it, as on the other
    fast meshes), so a plan uses the cluster wherever that is cheaper. A smaller data axis would
    only move devices into seq: the batch and the sequence are cut as many ways in all (the same
    activations per device), the weights' gradients are reduced over as many devices, and only
    the keys and values that seq gathers grow (on every corpus model the largest data axis gave
    the best all-device plan)."""
    leaves = [
        inputs.graph.values[v].shape
        for v, a in zip(inputs.ids, inputs.argnum)
        if a in inputs.batch_argnums and inputs.graph.values[v].shape
    ]
    if not leaves:
        raise PlanInputError("no batch argument found: pass batch_argnums=... naming the arguments that hold the batch")
    divides = lambda d: all(s[0] % d == 0 for s in leaves)
    seq_divides = lambda q: any(len(s) >= 2 for s in leaves) and all(s[1] % q == 0 for s in leaves if len(s) >= 2)
    if hw.slice_devices is not None:
        stacked = bool(experts(inputs, {"model": 1}))
        return sliced_meshes(devices, hw, level, divides, seq_divides, cross, stacked)
    counts = [devices] + [next((m for m in range(devices - 1, 0, -1) if divides(m)), 1)]
    valid = {
        m: [
            {"data": m // t // q, "seq": q, "model": t}
            for t in divisors(m)
            for q in divisors(m // t)
            if divides(m // t // q) and (q == 1 or seq_divides(q))
        ]
        for m in dict.fromkeys(counts)
    }
    if level != "fast":
        return [mesh for meshes in valid.values() for mesh in meshes]
    out = [mesh for meshes in valid.values() for mesh in meshes if fast_mesh(mesh, hw)]
    if not any(math.prod(mesh.values()) == devices for mesh in out):
        largest = max(mesh["data"] for mesh in valid[devices])
        fill = [mesh for mesh in valid[devices] if mesh["data"] == largest]
        out += [mesh for mesh in fill if mesh["model"] <= _fast_model(hw)] or fill
    return out


def sliced_meshes(
    devices: int, hw: Hardware, level: str, divides, seq_divides, cross: bool, experts: bool = False
) -> list[dict[str, int]]:
    """Meshes on slices of `hw.slice_devices` devices, laid out slice-major: (replica, data, seq,
    model), `replica` outermost and only across slices (data parallel: state replicated over it,
    so FSDP over `data` inside a slice is hybrid sharding), `data` crossing slices where replica
    does not take them all (FSDP or data parallel everywhere). Tensor and sequence parallelism
    stay inside a slice unless `cross` (asked only when nothing else fits). On all the devices,
    or on the most whole slices that the batch divides. Where the step has stacked experts
    (`experts`), also (data, expert) meshes whose expert axis spans two or more whole slices."""
    per = hw.slice_devices
    slices = devices // per
    counts = [devices] + [next((k * per for k in range(slices - 1, 0, -1) if divides(k * per)), per)]
    out = []
    for m in dict.fromkeys(counts):
        s = m // per
        replicas = divisors(s) if level != "fast" else sorted({1, s})
        for r in replicas:
            for t in divisors(m // r):
                for q in divisors(m // r // t):
                    d = m // r // t // q
                    if not divides(r * d) or (q > 1 and not seq_divides(q)):
                        continue
                    if t * q > per and not cross:
                        continue  # tensor or sequence parallelism over the slow link
                    out.append(
                        {"replica": r, "data": d, "seq": q, "model": t} if r > 1 else {"data": d, "seq": q, "model": t}
                    )
        if experts and not cross:
            for k in divisors(s)[1:]:  # expert parallelism over k whole slices, data parallel over the rest
                if divides(m):
                    out.append({"data": m // (k * per), "expert": k * per, "seq": 1, "model": 1})
    if level != "fast" or cross:
        return out
    fast = [mesh for mesh in out if fast_mesh(mesh, hw) or "expert" in mesh]
    whole = [mesh for mesh in out if math.prod(mesh.values()) == devices]
    if whole and not any(math.prod(mesh.values()) == devices for mesh in fast):  # as `mesh_shapes` fills
        largest = max(mesh.get("replica", 1) * mesh["data"] for mesh in whole)
        fill = [mesh for mesh in whole if mesh.get("replica", 1) * mesh["data"] == largest]
        fast += [mesh for mesh in fill if mesh["model"] <= _fast_model(hw)] or fill
    return fast


def fast_mesh(mesh: Mapping[str, int], hw: Hardware) -> bool:
    """A mesh the fast level searches: no seq axis, model within one host's fast links."""
    return mesh["seq"] == 1 and mesh["model"] <= _fast_model(hw)


def _fast_model(hw: Hardware) -> int:
    return hw.devices_per_host if hw.inter.bandwidth < hw.intra.bandwidth else 16


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
