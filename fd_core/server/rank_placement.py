"""Place data-parallel ranks on the host's CPUs: how many ``"auto"`` means, and each rank's share.

A rank is a whole engine (its own weights, KV pool and thread pools), so it is placed on
CPUs that share an L3 cache and a NUMA node where it can be: its threads then work on one
cache and local memory. The unit is a *placement domain*: a domain of
:mod:`fd_core.host_topology` (the usable CPUs under one L3 in one NUMA node), except that a
domain of fewer than :data:`MIN_RANK_CORES` physical cores (a piece of a CCD left by an
affinity mask) joins the nearest domain that has them (the same node first), since a rank that
small is not worth its copy of the weights. When no domain has that many cores (a small host, or
a VM that reports an L3 per vCPU), the topology says nothing worth acting on: every CPU is one
placement domain.

``parallel.data_parallel_size = "auto"`` is one rank per placement domain, so 1 on a host with one
L3; an instance of a prefill or decode role runs one engine, so ``"auto"`` is 1 there. The shares
of N ranks over D placement domains (:func:`cpu_shares`):

- N a multiple of D (each domain with at least N/D cores): each domain is cut into N/D shares of
  whole cores (SMT siblings stay together); N = D is one rank per domain;
- D a multiple of N: each share is D/N consecutive whole domains (in socket, node order);
- otherwise the cores, in domain order, are cut into N contiguous runs (the split of earlier
  versions, by core rather than by CPU number); with fewer cores than ranks, the CPUs are; with
  fewer CPUs than ranks, ranks share CPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, TypeVar

from fd_core.host_topology import HostTopology, format_cpulist, read_host_topology

if TYPE_CHECKING:
    from fd_core.config import FdConfig

log = logging.getLogger(__name__)

#: Fewest physical cores of a domain that gets a rank of its own (see the module docstring).
MIN_RANK_CORES: Final = 4

_T = TypeVar("_T")
Core = tuple[int, ...]


def split_evenly(items: Sequence[_T], parts: int) -> list[list[_T]]:
    """``items`` cut into ``parts`` contiguous runs whose lengths differ by at most one (longer first)."""
    assert 0 < parts <= len(items), (parts, len(items))
    size, extra = divmod(len(items), parts)
    runs, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        runs.append(list(items[start:end]))
        start = end
    return runs


def split_cpus(cpus: list[int], ranks: int) -> list[list[int]]:
    """Contiguous, disjoint shares of ``cpus``, one per rank; with fewer CPUs than ranks, ranks share."""
    if len(cpus) < ranks:
        return [[cpus[rank % len(cpus)]] for rank in range(ranks)]
    return split_evenly(cpus, ranks)


def placement_domains(topology: HostTopology) -> list[list[Core]]:
    """The cores of each placement domain, in the topology's order (see the module docstring)."""
    domains = topology.domains
    kept = {i: list(d.cores) for i, d in enumerate(domains) if len(d.cores) >= MIN_RANK_CORES}
    if not kept:
        return [[core for domain in domains for core in domain.cores]]
    for i, small in enumerate(domains):
        if i not in kept:
            host = min(kept, key=lambda j: (domains[j].package != small.package, domains[j].node != small.node,
                                            abs(j - i)))
            kept[host] = sorted(kept[host] + list(small.cores))
    return [kept[i] for i in sorted(kept)]


def auto_ranks(topology: HostTopology) -> int:
    """What ``"auto"`` gives on ``topology``: one rank per placement domain (at least one)."""
    return len(placement_domains(topology))


def resolve_data_parallel_size(config: FdConfig, topology: HostTopology | None = None) -> FdConfig:
    """``config`` with ``parallel.data_parallel_size = "auto"`` replaced by its count on ``topology``
    (default: this host's, read only for ``"auto"``); engines and the front end read a number."""
    if isinstance(config.parallel.data_parallel_size, int):
        return config
    if config.splitwise.role != "mixed":
        ranks, why = 1, f"a {config.splitwise.role} instance runs one engine"
    else:
        topology = topology if topology is not None else read_host_topology()
        ranks = auto_ranks(topology)
        why = (f"{len(topology.domains)} L3 / NUMA domains, one rank per domain of at least {MIN_RANK_CORES} cores"
               + (f"; unknown here: {', '.join(topology.unknown)}" if topology.unknown else ""))
    log.info("parallel.data_parallel_size = \"auto\": %d rank%s (%s)", ranks, "s" * (ranks != 1), why)
    return config.with_data_parallel_size(ranks)


def _cpus(cores: list[Core]) -> list[int]:
    return sorted(cpu for core in cores for cpu in core)


def cpu_shares(topology: HostTopology, ranks: int) -> list[list[int]]:
    """One CPU share per rank, ascending, following the placement domains (see the module docstring)."""
    domains = placement_domains(topology)
    per_domain, rest = divmod(ranks, len(domains))
    if not rest and all(len(domain) >= per_domain for domain in domains):
        return [_cpus(part) for domain in domains for part in split_evenly(domain, per_domain)]
    per_share, rest = divmod(len(domains), ranks)
    if not rest:
        return [_cpus([core for domain in domains[i:i + per_share] for core in domain])
                for i in range(0, len(domains), per_share)]
    cores = [core for domain in domains for core in domain]
    if len(cores) >= ranks:
        return [_cpus(part) for part in split_evenly(cores, ranks)]
    return split_cpus(list(topology.cpus), ranks)


def describe_share(topology: HostTopology, cpus: list[int]) -> str:
    """Where ``cpus`` sit, for the log: ``"socket 0, node 1, L3 of CPUs 8-15"`` or ``"2 sockets, ..."``."""
    domains = topology.domains_of(cpus)
    facts = (("sockets", "socket", {d.package for d in domains}), ("NUMA nodes", "node", {d.node for d in domains}),
             ("L3 caches", "L3 of CPUs", {d.l3 or "unknown" for d in domains}))
    parts = [f"{one} {next(iter(values))}" if len(values) == 1 else f"{len(values)} {fact}"
             for fact, one, values in facts if fact not in topology.unknown]
    return ", ".join(parts) or "topology unknown"


def describe_shares(topology: HostTopology, shares: list[list[int]]) -> str:
    """Each rank's share and where it sits, for the start-up log line."""
    return " | ".join(f"rank {rank}: CPUs {format_cpulist(share)} ({describe_share(topology, share)})"
                      for rank, share in enumerate(shares))
