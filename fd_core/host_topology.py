"""Read the host's CPU topology from sysfs: which usable CPUs share a socket, a NUMA node, an L3 cache, a core.

Linux describes each CPU under ``devices/system/cpu/cpuN``: ``topology/physical_package_id``
(its socket), ``topology/thread_siblings_list`` (the CPUs of its physical core, SMT siblings
included) and ``cache/index*/`` (``level`` 3: ``shared_cpu_list``, the CPUs sharing that L3: a
whole socket on most Xeons, one CCD or CCX on an AMD EPYC). NUMA nodes list their CPUs in
``devices/system/node/nodeN/cpulist``. A file that is missing or unreadable (a container
without sysfs, another OS) leaves its fact unknown, and an unknown fact puts every CPU in the
same place (socket 0, node 0, one L3, each CPU its own core): with nothing known, one domain
holds every CPU. Reading never raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: The facts read, as named in :attr:`HostTopology.unknown`.
FACTS: Final = ("sockets", "NUMA nodes", "L3 caches", "SMT siblings")


def parse_cpulist(text: str) -> list[int]:
    """The CPUs of a Linux cpulist such as ``"0-3,8-11"`` (``""`` is none), ascending; ValueError if malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if low > high or low < 0:
            raise ValueError(f"bad cpulist range {part!r}")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def format_cpulist(cpus: list[int] | tuple[int, ...]) -> str:
    """The cpulist of ``cpus`` (``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``), the inverse of :func:`parse_cpulist`."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in runs)


@dataclass(frozen=True, slots=True)
class CpuDomain:
    """Usable CPUs that share one L3 cache inside one NUMA node (and so one socket)."""

    package: int                          # physical_package_id (the socket)
    node: int                             # NUMA node
    l3: str                               # the L3's shared_cpu_list (all its CPUs, usable or not); "" if unknown
    cores: tuple[tuple[int, ...], ...]    # the usable CPUs by physical core (SMT siblings together), ascending

    @property
    def cpus(self) -> tuple[int, ...]:
        """Every usable CPU of the domain, ascending."""
        return tuple(sorted(cpu for core in self.cores for cpu in core))


@dataclass(frozen=True, slots=True)
class HostTopology:
    """The usable CPUs grouped into domains, ordered by (socket, node, first CPU)."""

    domains: tuple[CpuDomain, ...]
    unknown: tuple[str, ...] = ()        # the FACTS that no CPU's files gave (all CPUs then share one value)

    @property
    def cpus(self) -> tuple[int, ...]:
        """Every usable CPU, ascending."""
        return tuple(sorted(cpu for domain in self.domains for cpu in domain.cpus))

    def domains_of(self, cpus: list[int] | tuple[int, ...]) -> list[CpuDomain]:
        """The domains holding any of ``cpus``, in order."""
        wanted = set(cpus)
        return [domain for domain in self.domains if wanted & set(domain.cpus)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def _read_cpulist(path: Path) -> list[int] | None:
    text = _read(path)
    try:
        return parse_cpulist(text) if text is not None else None
    except ValueError:
        return None


def _package(cpu_dir: Path) -> int | None:
    text = _read(cpu_dir / "topology" / "physical_package_id")
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _l3(cpu_dir: Path) -> str | None:
    """The shared_cpu_list of the L3 cache of the CPU at ``cpu_dir``, normalised; None if not found."""
    try:
        indexes = sorted((cpu_dir / "cache").glob("index*"))
    except OSError:
        return None
    for index in indexes:
        shared = _read_cpulist(index / "shared_cpu_list")
        if _read(index / "level") == "3" and shared:
            return format_cpulist(shared)
    return None


def _nodes(root: Path) -> dict[int, int]:
    """CPU -> NUMA node, from every ``nodeN/cpulist`` that can be read."""
    node_of: dict[int, int] = {}
    try:
        node_dirs = list((root / "devices" / "system" / "node").glob("node[0-9]*"))
    except OSError:
        return node_of
    for node_dir in node_dirs:
        if node_dir.name[4:].isdigit():
            for cpu in _read_cpulist(node_dir / "cpulist") or ():
                node_of[cpu] = int(node_dir.name[4:])
    return node_of


def read_host_topology(root: str | os.PathLike[str] = "/sys", cpus: list[int] | None = None) -> HostTopology:
    """The topology of ``cpus`` (default: those this process may run on) from the sysfs at ``root``.

    Never raises: what cannot be read is unknown (see the module docstring), and a core's
    siblings outside ``cpus`` are left out of it.
    """
    root = Path(root)
    wanted = set(cpus if cpus is not None else os.sched_getaffinity(0))
    node_of = _nodes(root)
    facts: dict[int, tuple[int | None, int | None, str | None, tuple[int, ...] | None]] = {}
    for cpu in sorted(wanted):
        cpu_dir = root / "devices" / "system" / "cpu" / f"cpu{cpu}"
        siblings = _read_cpulist(cpu_dir / "topology" / "thread_siblings_list")
        core = tuple(c for c in siblings if c in wanted) if siblings and cpu in siblings else None
        facts[cpu] = (_package(cpu_dir), node_of.get(cpu), _l3(cpu_dir), core)
    unknown = tuple(fact for i, fact in enumerate(FACTS) if all(f[i] is None for f in facts.values()))
    groups: dict[tuple[int, int, str], list[tuple[int, ...]]] = {}
    placed: set[int] = set()
    for cpu, (package, node, l3, core) in facts.items():   # a core goes where its first CPU is
        if cpu not in placed:
            core = tuple(c for c in core or (cpu,) if c not in placed)
            placed.update(core)
            groups.setdefault((package or 0, node or 0, l3 or ""), []).append(core)
    domains = [CpuDomain(package, node, l3, tuple(sorted(cores)))
               for (package, node, l3), cores in groups.items()]
    domains.sort(key=lambda d: (d.package, d.node, d.cpus[0]))
    return HostTopology(tuple(domains), unknown)
