"""What the compiler really does with a plan: compile it on devices (fake CPU devices are fine),
read the collectives XLA inserted from the optimized HLO (kind, bytes, group size), XLA's FLOP
count and memory analysis, and price the collectives with the same hardware profile the planner
uses, beside the plan's own prediction.

    >>> v = partitioner.verify(plan, step, state, batch)
    >>> print(v.table())
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .hardware import Hardware, latency_steps, profile
from .plan import Plan

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_LINE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # result bytes per device
    group_size: int
    text: str
    span: int = 1  # consecutive devices the group spans
    count: int = 1  # times it runs per call: a while loop's known trip count (a scanned layer's collectives)
    group: tuple[int, ...] = ()  # the first group's devices (positions in the mesh's device order), where read


@dataclasses.dataclass(frozen=True)
class Verification:
    collectives: tuple[Collective, ...]
    flops: float  # per device: XLA's cost analysis, with a loop body's matmuls counted once per trip
    peak_bytes: int  # per device: arguments + outputs + temporaries - aliased, XLA's memory analysis
    communication_seconds: float  # the collectives found, priced with the hardware profile
    compute_seconds: float
    predicted: Any  # the plan's Cost
    predicted_peak_bytes: int  # the plan's peak as the backend compiled lays it out (see Cost)
    # Bytes each device sends per call over each network level, on a plan for slices (else None).
    level_bytes: Mapping[str, int] | None = None

    @property
    def collective_bytes(self) -> dict[str, int]:
        """Bytes each device sends per kind, with the same ring formulas as the planner."""
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + int(_sent(c)) * c.count
        return out

    def table(self) -> str:
        p = self.predicted
        rows = [
            ("", "predicted", "compiled"),
            ("compute s", f"{p.compute_seconds:.3g}", f"{self.compute_seconds:.3g}"),
            ("communication s", f"{p.communication_seconds:.3g}", f"{self.communication_seconds:.3g}"),
            ("peak bytes/device", f"{self.predicted_peak_bytes:,}", f"{self.peak_bytes:,}"),
        ]
        for kind in sorted(set(p.collective_bytes) | set(self.collective_bytes)):
            rows.append(
                (
                    f"{kind} bytes",
                    f"{int(p.collective_bytes.get(kind, 0)):,}",
                    f"{self.collective_bytes.get(kind, 0):,}",
                )
            )
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{a:<{width}}  {b:>16}  {c:>16}" for a, b, c in rows)


class VerifyDevicesError(RuntimeError):
    """Not enough devices to compile the plan."""


def verify(plan: Plan, fn, *args, hardware: str | Hardware = "h100", devices=None) -> Verification:
    """`plan` compiled as it runs (`Plan.program(fn)`) on `devices`, and what XLA made of it."""
    return verify_many([(plan, fn, args)], hardware=hardware, devices=devices)[0]


# The backend's own optimisation of the code it emits changes nothing `verify` reads (the
# partitioned HLO, its collectives, FLOPs and buffers) and is most of a CPU compile's time.
QUICK = {"xla_backend_optimization_level": 0}
# The compiler guard only ranks plans: on CPU it also emits fusions the older, simpler way, which
# halves a compile again and moves XLA's FLOP count by a few parts in 10^5 (a Llama step, 2.0 s
# against 4.0 s per compile, collectives and buffers unchanged).
QUICKER = {**QUICK, "xla_cpu_use_fusion_emitters": False}


def verify_many(
    jobs, *, hardware: str | Hardware = "h100", devices=None, threads: int | None = None, ranking: bool = False
) -> list[Verification]:
    """`verify` for each (plan, fn, args) in `jobs`: traced one after another, compiled at once
    on `threads` threads (default: one per CPU; XLA compiles without holding Python's lock).
    `ranking`: the figures only rank plans against each other (the compiler guard), so the
    quickest compile on CPU is good enough (`QUICKER`).

    Example:
        >>> fast, thorough = verify_many([(p, step, args), (q, step, args)])
    """
    devices = list(devices if devices is not None else jax.devices())
    for plan, _, _ in jobs:
        if len(devices) < plan.devices_used:
            raise VerifyDevicesError(
                f"verifying a plan for {plan.devices_used} devices needs that many, got {len(devices)}; on CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={plan.devices_used} before importing jax"
            )
    hw = profile(hardware)
    options = QUICKER if ranking and devices[0].platform == "cpu" else QUICK
    workers = max(1, min(len(jobs), threads or os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        # Each compiles while the next is traced.
        lowered, futures = [], []
        for plan, fn, args in jobs:
            lowered.append(plan.jit(plan.program(fn, required=False), args, devices).lower(*args))
            futures.append(pool.submit(lowered[-1].compile, compiler_options=options))
        widths = [program_widths(low.as_text(dialect="hlo", debug_info=True)) for low in lowered]
        compiled = [f.result() for f in futures]
    return [_read(c, plan, hw, devices, w) for c, w, (plan, _, _) in zip(compiled, widths, jobs)]


def _read(compiled, plan: Plan, hw: Hardware, devices, widths: Mapping[str, int]) -> Verification:
    collectives = tuple(parse_collectives(compiled.as_text(), widths))
    memory = compiled.memory_analysis()
    peak = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    if plan.slices > 1:
        hw = hw.sliced(plan.devices, plan.slices)
    comm = sum(_seconds(c, hw, plan.mesh) * c.count for c in collectives)
    levels = _level_bytes(collectives, hw) if plan.slices > 1 else None
    flops = (analysed_flops(compiled.cost_analysis()) or 0.0) + uncounted_loop_flops(compiled.as_text())
    cpu = devices[0].platform == "cpu" and plan.cost.cpu_peak_bytes_per_device is not None
    predicted_peak = plan.cost.cpu_peak_bytes_per_device if cpu else plan.cost.peak_bytes_per_device
    return Verification(collectives, flops, int(peak), comm, flops / hw.peak_flops, plan.cost, predicted_peak, levels)


def parse_collectives(hlo: str, widths: Mapping[str, int] | None = None) -> list[Collective]:
    """Collectives in optimized HLO text; an async pair (`-start`/`-done`) counts once, and one
    in a while loop's body (a scanned layer) counts the loop's known trip count times.

    `widths` (`program_widths` of the program before optimisation): the CPU backend has no 16-bit
    float arithmetic and no 16-bit all-reduce, so it widens bfloat16 values and their collectives
    to float32; a GPU or TPU sends them as the program made them. An element of a collective
    made by ops (its metadata's op_name) whose every result the program made 16-bit wide is
    counted at that width.

    An all-reduce whose every reader takes one group member's 1/p slice of it is a reduce-scatter
    and is counted as one (its result being that slice): XLA's GPU and TPU pipelines rewrite the
    pair into a reduce-scatter (ReduceScatterCreator), the CPU backend these plans are compiled on
    has no such pass and sends the whole sum. For a tuple all-reduce (combined gradients) the
    elements read that way are counted as a reduce-scatter and the rest as an all-reduce."""
    out = []
    runs = _runs_per_computation(hlo)
    scattered = _scattered_elements(hlo)
    for computation, line in _instruction_lines(hlo):
        m = _LINE.search(line)
        if not m or "-done" in line.split("=", 1)[-1].split("(", 1)[0]:
            continue
        shape = m.group("shape")
        arrays = _ARRAY.findall(shape)
        if m.group("start") and m.group("kind") in ("all-gather", "collective-permute") and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2 :]  # (operands, results): the results
        names = _op_names(line, len(arrays))
        sizes = [
            min(_DTYPE_BYTES.get(dt, 4), _width(widths or {}, name) if dt in _FLOATS else 8)
            * math.prod(int(d) for d in dims.split(",") if d)
            for (dt, dims), name in zip(arrays, names)
        ]
        p, span, count, text = _group_size(line), _group_span(line), runs.get(computation, 1), line.strip()[:160]
        sliced = scattered.get(_name(line), set()) if m.group("kind") == "all-reduce" and p > 1 else set()
        whole = sum(n for i, n in enumerate(sizes) if i not in sliced)
        group = _first_group(line)
        if whole or not sliced:
            out.append(Collective(m.group("kind"), whole, p, text, span, count, group))
        if sliced:
            out.append(Collective("reduce-scatter", sum(sizes[i] for i in sliced) // p, p, text, span, count, group))
    return out


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FLOATS = ("bf16", "f16", "f32", "f64")


def program_widths(hlo: str) -> dict[str, int]:
    """op_name -> the widest float element, in bytes, of the results of the instructions that
    name (HLO text with metadata, `Lowered.as_text(dialect="hlo", debug_info=True)`)."""
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        name = _OP_NAME.search(line)
        if not name or " = " not in line:
            continue
        result = line.split(" = ", 1)[1].split(" ", 1)[0]
        floats = [_DTYPE_BYTES[dt] for dt, _ in _ARRAY.findall(result) if dt in _FLOATS]
        if floats:
            out[name.group(1)] = max(out.get(name.group(1), 0), *floats)
    return out


def _width(widths: Mapping[str, int], name: str | None) -> int:
    """The program's width for an op_name: its own, or, inside a scan's or a call's body (named
    relative to the body before optimisation, from the top after inlining), its longest suffix's."""
    while name:
        if name in widths:
            return widths[name]
        name = name.partition("/")[2]
    return 8


def _op_names(line: str, count: int) -> list[str | None]:
    """The op_name of each of a collective's `count` elements: XLA joins those of collectives it
    combines as `prefix/(a:b:...)`, one per element, in order. None where they cannot be told."""
    m = _OP_NAME.search(line)
    if not m:
        return [None] * count
    name = m.group(1)
    combined = re.fullmatch(r"(.*?/)\((.*)\)", name)
    if combined:
        names = [combined.group(1) + n for n in combined.group(2).split(":")]
        return names if len(names) == count else [None] * count
    return [name] * count


def _instruction_lines(hlo: str):
    """(computation name, line) for each line inside a computation."""
    computation = None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
        else:
            yield computation, line


def _name(line: str) -> str | None:
    m = _INSTRUCTION.match(line)
    return m.group(1) if m else None


def _parse_instructions(hlo: str):
    """name -> (opcode, operand names, element count of an array result, attributes text), and
    each fused computation's parameters by index."""
    ops, params = {}, {}
    for computation, line in _instruction_lines(hlo):
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        rest = line[m.end() :]
        if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
            depth = 0
            for i, ch in enumerate(rest):  # noqa: B007 (i is read after the loop)
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    break
            shape, rest = rest[: i + 1], rest[i + 1 :].lstrip()
        else:
            shape, _, rest = rest.partition(" ")
        opcode, _, tail = rest.partition("(")
        args, _, attrs = tail.partition(")")
        array = _ARRAY.match(shape)
        elements = (
            math.prod(int(d) for d in array.group(2).split(",") if d) if array and not shape.startswith("(") else None
        )
        ops[m.group(1)] = (opcode, re.findall(r"%([\w.\-]+)", args), elements, attrs)
        if opcode == "parameter":
            params.setdefault(computation, {})[int(args)] = m.group(1)
    return ops, params


def _scattered_elements(hlo: str) -> dict[str, set[int]]:
    """all-reduce name -> indices of its results (0 for an array) that are only ever read as one
    1/p slice by dynamic-slice, directly or inside a fusion."""
    ops, params = _parse_instructions(hlo)
    users: dict[str, list[str]] = {}
    for name, (_, operands, _, _) in ops.items():
        for o in operands:
            users.setdefault(o, []).append(name)

    def sliced(value: str, elements: int, p: int) -> bool:
        readers = users.get(value, [])
        for r in readers:
            opcode, operands, out, attrs = ops[r]
            if opcode == "dynamic-slice" and operands[0] == value and out and out * p == elements:
                continue
            if opcode == "all-reduce-done" and sliced(r, elements, p):  # an async pair: its readers read the done
                continue
            callee = re.search(r"calls=%([\w.\-]+)", attrs)
            if (
                opcode == "fusion"
                and callee
                and all(
                    sliced(params.get(callee.group(1), {}).get(k, ""), elements, p)
                    for k, o in enumerate(operands)
                    if o == value
                )
            ):
                continue
            return False
        return bool(readers)

    out: dict[str, set[int]] = {}
    for name, (opcode, _, elements, attrs) in ops.items():
        if opcode not in ("all-reduce", "all-reduce-start"):
            continue
        p = _group_size(attrs)
        if p <= 1:
            continue
        if elements is not None:
            if sliced(name, elements, p):
                out[name] = {0}
            continue
        got = set()
        for r in users.get(name, []):
            opcode_r, _, n, attrs_r = ops[r]
            index = re.search(r"index=(\d+)", attrs_r)
            if opcode_r == "get-tuple-element" and index and n and sliced(r, n, p):
                got.add(int(index.group(1)))
        if got:
            out[name] = got
    return out


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(")


def _runs_per_computation(hlo: str) -> dict[str, int]:
    """How many times each computation runs per call: 1 for the entry, a while body its loop's
    known trip count times its caller's, a called computation as often as its caller."""
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, computation = None, None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            entry = computation if line.startswith("ENTRY") else entry
            continue
        body = re.search(r"\bbody=%([^\s,]+)", line)
        if body and " while(" in line:
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            calls.setdefault(computation, []).append((body.group(1), int(trips.group(1)) if trips else 1))
        elif " call(" in line or " conditional(" in line:
            for callee in re.findall(r"(?:to_apply|branch_computations=\{[^}]*)%([^\s,}]+)", line):
                calls.setdefault(computation, []).append((callee, 1))
        elif " fusion(" in line:  # a fusion runs its computation as often as it runs
            for callee in re.findall(r"\bcalls=%([^\s,}]+)", line):
                calls.setdefault(computation, []).append((callee, 1))
    runs = {entry: 1} if entry else {}
    frontier = [entry] if entry else []
    while frontier:
        caller = frontier.pop()
        for callee, n in calls.get(caller, ()):
            runs[callee] = runs.get(callee, 0) + runs[caller] * n
            frontier.append(callee)
    return runs


# A matmul: XLA's `dot`, or on GPUs the cuBLAS custom call it becomes (its result a tuple of the
# product and a workspace, its dimension numbers in the backend config).
_DOT = re.compile(
    r"^\s*(?:ROOT )?%\S+ = \(?\w+\[([\d,]*)\][^ ]* (?:dot|.*custom-call)\(%([\w.\-]+), .*?"
    r"(?:lhs_contracting_dims=\{([\d,]*)\}|\"lhs_contracting_dimensions\":\[([\d\",]*)\])"
)
_SHAPE = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]")


def uncounted_loop_flops(hlo: str) -> float:
    """FLOPs of the matmuls in loop bodies that XLA's cost analysis leaves out: it counts a while
    loop's body once, and a scanned model's layers run its trip count times."""
    dims = {m.group(1): [int(d) for d in m.group(2).split(",") if d] for m in map(_SHAPE.match, hlo.splitlines()) if m}
    runs = _runs_per_computation(hlo)
    missing = 0.0
    for computation, line in _instruction_lines(hlo):
        n = runs.get(computation, 1)
        m = _DOT.match(line) if n > 1 and ("dot(" in line or "gemm" in line or "matmul" in line) else None
        if not m:
            continue
        lhs = dims.get(m.group(2), [])
        contracting = (m.group(3) if m.group(3) is not None else m.group(4) or "").replace('"', "")
        k = math.prod(lhs[int(d)] for d in contracting.split(",") if d) if lhs else 1
        missing += 2.0 * math.prod(int(d) for d in m.group(1).split(",") if d) * k * (n - 1)
    return missing


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    return _iota_group_size(line)


def _first_group(line: str) -> tuple[int, ...]:
    """The devices of the first replica group, in any of the forms XLA writes: explicit
    `{{0,1},{2,3}}`, iota `[2,4]<=[4,2]T(1,0)`, or over named mesh axes."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return tuple(int(x) for x in m.group(1).split(",") if x)
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        groups = [int(d) for d in m.group(1).split(",")]
        ids = _device_ids(f"([{m.group(2)}]" + (f"T({m.group(3)}))" if m.group(3) else ")"), 0)
        return tuple(int(i) for i in ids.reshape(-1, groups[-1])[0])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=(\S*))?\s*\{([^}]*)\}", line)
    if m:
        axes = [(n, int(v)) for n, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        chosen = set(re.findall(r"'([^']+)'", m.group(3)))
        ids = _device_ids(m.group(2), math.prod(n for _, n in axes)).reshape([n for _, n in axes])
        return tuple(int(i) for i in ids[tuple(slice(None) if name in chosen else 0 for name, _ in axes)].ravel())
    return ()


def _group_span(line: str) -> int:
    """How many consecutive devices the first group spans (what decides the link it uses)."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        ids = [int(x) for x in m.group(1).split(",") if x]
        return max(ids) - min(ids) + 1
    mesh = _mesh_groups(line)
    return mesh[1] if mesh else _iota_group_size(line)


def _mesh_groups(line: str):
    """`replica_groups=mesh['a'=2,'b'=4] {'a'}`, with the devices in mesh order or as given by
    `device_ids=([4,2]T(1,0))` (an iota reshaped and transposed): (group size, span) of the first
    group over the named axes."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=(\S*))?\s*\{([^}]*)\}", line)
    if not m:
        return None
    axes = [(n, int(v)) for n, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
    chosen = set(re.findall(r"'([^']+)'", m.group(3)))
    shape = [n for _, n in axes]
    ids = _device_ids(m.group(2), math.prod(shape)).reshape(shape)
    first = ids[tuple(slice(None) if name in chosen else 0 for name, _ in axes)].ravel()
    return len(first), int(first.max() - first.min() + 1)


def _device_ids(given: str | None, count: int) -> np.ndarray:
    """Device ids in mesh order: `([4,2]T(1,0))` is iota(8) reshaped to [4,2], transposed by
    (1,0), flattened; absent, 0..count-1."""
    m = re.match(r"\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", given or "")
    if not m:
        return np.arange(count)
    dims = [int(d) for d in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        ids = ids.transpose([int(d) for d in m.group(2).split(",")])
    return ids.ravel()


def _iota_group_size(line: str) -> int:
    mesh = _mesh_groups(line)
    if mesh:
        return mesh[0]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)  # iota form: [groups, size]
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"source_target_pairs=\{([^}]*)\}", line)
    return 2 if m else 1


def _sent(c: Collective) -> float:
    p = c.group_size
    if p <= 1:
        return 0.0
    if c.kind == "all-reduce":
        return 2 * (p - 1) / p * c.bytes
    if c.kind == "all-gather":
        return (p - 1) / p * c.bytes  # the result is the gathered whole
    if c.kind == "reduce-scatter":
        return (p - 1) * c.bytes  # the result is one shard
    if c.kind == "all-to-all":
        return (p - 1) / p * c.bytes  # each device keeps its own 1/p of the result
    return float(c.bytes)  # a collective-permute sends its whole operand


def analysed_flops(analysis) -> float | None:
    """The flops in XLA's cost analysis of a lowered or compiled program (a dict, or in older JAX
    a list of one per computation); None where it counts none."""
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    return float(analysis["flops"]) if analysis and "flops" in analysis else None


def _split(c: Collective, hw: Hardware):
    """Where the group spans slices (devices slice-major): how it splits, as the planner prices
    it (`cost.Split`); None inside one slice, or for a collective without a group read."""
    from .cost import Split

    if hw.slice_devices is None or len(c.group) < 2:
        return None
    slices = {i // hw.slice_devices for i in c.group}
    if len(slices) < 2:
        return None
    inside = len(c.group) // len(slices)
    members = sorted(i for i in c.group if i // hw.slice_devices == min(slices))
    extent = members[-1] - members[0] + 1
    return Split(inside, len(slices), extent, hw.level(extent))


def _shard(c: Collective) -> float:
    """The planner's measure of a collective's bytes: an all-gather's shard, else as read."""
    return c.bytes / c.group_size if c.kind == "all-gather" else c.bytes


def _level_bytes(collectives, hw: Hardware) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in collectives:
        split = _split(c, hw)
        sent = (
            split.bytes(c.kind, _shard(c))
            if split and c.kind in LEVELLED
            else {hw.level(max(c.span, c.group_size)): _sent(c)}
        )
        for level, n in sent.items():
            out[level] = out.get(level, 0) + int(n) * c.count
    return out


LEVELLED = ("all-reduce", "all-gather", "reduce-scatter")


def _seconds(c: Collective, hw: Hardware, mesh: Mapping[str, int]) -> float:
    split = _split(c, hw)
    if split is not None and c.kind in LEVELLED and split.inside > 1:  # level by level, as the planner prices it
        return sum(split.seconds(c.kind, _shard(c), hw))
    # The first group's own extent where it was read (an iota group's span is not its size).
    span = max(c.group) - min(c.group) + 1 if c.group else c.span
    link = hw.link(max(span, c.group_size))
    steps = latency_steps(c.kind, c.group_size) if c.kind in ("all-reduce", "all-gather", "reduce-scatter") else 1
    return _sent(c) / link.bandwidth + steps * link.latency
