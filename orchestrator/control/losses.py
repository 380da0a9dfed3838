"""What a host loss was, read from the group's nodes and what the cluster says now: the hosts
whose nodes are gone, the processes that went down with them, and the hosts that leave with a
broken slice. Pure: the controller hands in what it knows and acts on the answer."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from . import policies


@dataclasses.dataclass(frozen=True)
class Loss:
    hosts: list[int]  # the group's hosts lost: those whose node is gone, else the processes that died
    processes: list[int]  # processes that died on a live node beside them
    dead: int  # hosts whose node is gone
    left: int  # live hosts that leave with their broken slice (no group runs a slice short)
    processes_lost: int  # processes that died while their node lives on

    def failure(self, hosts_in_group: int, hosts_alive: int, failures_in_a_row: int) -> policies.Failure:
        """What the failure policy is told."""
        return policies.Failure(hosts_in_group, self.dead, self.processes_lost, hosts_alive, failures_in_a_row)


def read_loss(nodes: Sequence[str], lost: Sequence[int], alive: Collection[str], live: Collection[str]) -> Loss:
    """The loss of a group on `nodes` whose poll found processes `lost`, the cluster offering
    `alive` hosts to run on and `live` hosts in all. Every host whose node is gone counts, the
    poll's or not (a slice's hosts can die one after the other); a process that died on a live
    node went down with them (on CPU a lost coordinator aborts the others), or, with no node
    gone, is the loss itself."""
    dead = [i for i, n in enumerate(nodes) if n not in live]
    hosts = dead or list(lost)
    left = [
        n for i, n in enumerate(nodes) if n in live and n not in alive and i not in lost
    ]  # (a host set aside is the loss)
    processes = [i for i in lost if i not in hosts]
    return Loss(hosts, processes, len(dead), len(left), len([i for i in lost if i not in dead]))
