"""Sysfs trees of realistic hosts, written under a test's tmp_path, for the topology and placement tests.

Each writer lays out what Linux shows under ``/sys/devices/system``: per CPU its
``topology/physical_package_id`` and ``thread_siblings_list`` and its ``cache/index*`` (L1d, L1i, L2,
L3 with ``level`` and ``shared_cpu_list``), and per NUMA node ``node/nodeN/cpulist``. CPUs are
numbered the way Linux numbers them on these machines: every core's first thread, then every
core's second (so core ``c`` of a host with ``n`` cores is CPUs ``c`` and ``c + n``).
"""

from __future__ import annotations

from pathlib import Path

from fd_core.host_topology import format_cpulist


def write_host(root: Path, *, cores: int, smt: bool, package_of_core: list[int], l3_of_core: list[int],
               node_of_core: list[int] | None, caches: bool = True) -> Path:
    """Write the tree of a host with ``cores`` physical cores (two threads each with ``smt``):
    core ``c`` is in socket ``package_of_core[c]``, L3 ``l3_of_core[c]`` and NUMA node
    ``node_of_core[c]`` (no node directories when None); ``caches=False`` leaves out every
    ``cache`` directory (as some containers do). Returns ``root``."""
    threads = 2 if smt else 1
    cpu_core = {core + thread * cores: core for core in range(cores) for thread in range(threads)}

    def cpus_of(wanted: set[int]) -> str:
        return format_cpulist([cpu for cpu, core in cpu_core.items() if core in wanted])

    system = root / "devices" / "system"
    for cpu, core in cpu_core.items():
        cpu_dir = system / "cpu" / f"cpu{cpu}"
        _write(cpu_dir / "topology" / "physical_package_id", str(package_of_core[core]))
        _write(cpu_dir / "topology" / "thread_siblings_list", cpus_of({core}))
        if caches:
            l3_cores = {c for c in range(cores) if l3_of_core[c] == l3_of_core[core]}
            for index, (level, shared) in enumerate([(1, {core}), (1, {core}), (2, {core}), (3, l3_cores)]):
                _write(cpu_dir / "cache" / f"index{index}" / "level", str(level))
                _write(cpu_dir / "cache" / f"index{index}" / "shared_cpu_list", cpus_of(shared))
    nodes = node_of_core or []
    for node in sorted(set(nodes)):
        _write(system / "node" / f"node{node}" / "cpulist", cpus_of({c for c in range(cores) if nodes[c] == node}))
    return root


def xeon_2s_64c(root: Path) -> Path:
    """Two 32-core Xeon sockets with SMT (128 CPUs): one L3 and one NUMA node per socket."""
    socket = [c // 32 for c in range(64)]
    return write_host(root, cores=64, smt=True, package_of_core=socket, l3_of_core=socket, node_of_core=socket)


def epyc_9654(root: Path, *, nps: int) -> Path:
    """One 96-core EPYC 9654 with SMT (192 CPUs): 12 CCDs of 8 cores, each with its own L3; NPS1
    (one NUMA node) or NPS4 (four nodes of three CCDs)."""
    ccd = [c // 8 for c in range(96)]
    return write_host(root, cores=96, smt=True, package_of_core=[0] * 96, l3_of_core=ccd,
                      node_of_core=[c // (96 // nps) for c in range(96)])


def container(root: Path, *, cpus: int) -> Path:
    """A container's partial sysfs: CPU topology files only, no caches and no NUMA nodes."""
    return write_host(root, cores=cpus, smt=False, package_of_core=[0] * cpus, l3_of_core=[0] * cpus,
                      node_of_core=None, caches=False)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
