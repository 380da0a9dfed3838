"""A job's slice layout: hosts per slice, and what fails together (`partitioner.Hardware`).

Pure data, read from the job file's `[hosts] hosts_per_slice` and its hardware profile; the hosts
of a running cluster are laid out by it in `hosts/slices.py`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SliceLayout:
    hosts_per_slice: int | None  # None: every host one slice
    fails_by: str  # "host" or "slice" (`partitioner.Hardware.fails_by`)

    @classmethod
    def of(cls, hardware: str, hosts_per_slice: int = 0) -> SliceLayout:
        from partitioner import profile

        hw = profile(hardware)
        return cls(hosts_per_slice or hw.hosts_per_slice, hw.fails_by)

    def slices(self, hosts: int) -> int:
        """Equal slices that `hosts` hosts of a group form, as the planner takes them: 1 where
        there is one slice; where hosts go one by one and a slice is left short, every host its
        own (what crosses a host is then priced at the slow link: never less than it costs)."""
        per = self.hosts_per_slice
        if per is None:
            return 1
        return hosts // per if hosts % per == 0 else hosts

    def usable(self, slice_of: dict[str, str]) -> list[str]:
        """Hosts a group may run on, slice-major: where slices fail whole, only complete ones."""
        by_slice: dict[str, list[str]] = {}
        for node in sorted(slice_of):
            by_slice.setdefault(slice_of[node], []).append(node)
        need = self.hosts_per_slice
        out = []
        for name in sorted(by_slice, key=_slice_order):
            nodes = by_slice[name]
            if self.fails_by == "slice" and need is not None and len(nodes) < need:
                continue  # a slice with a host missing cannot run
            out += nodes
        return out


def _slice_order(name: str):
    return (0, int(name)) if name.isdigit() else (1, name)
