"""Data-parallel ranks on a host's CPUs: what ``"auto"`` gives and each rank's share, on sysfs trees and this host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fd_core.config import load_config
from fd_core.host_topology import HostTopology, format_cpulist, read_host_topology
from fd_core.server.rank_placement import (
    auto_ranks,
    cpu_shares,
    describe_share,
    describe_shares,
    resolve_data_parallel_size,
    split_cpus,
)
from tests.fd_core.sysfs_trees import container, epyc_9654, write_host, xeon_2s_64c


@pytest.fixture(scope="module")
def xeon(tmp_path_factory) -> HostTopology:
    """Every CPU of the two-socket Xeon."""
    return read_host_topology(xeon_2s_64c(tmp_path_factory.mktemp("xeon")), cpus=list(range(128)))


@pytest.fixture(scope="module")
def epyc(tmp_path_factory) -> dict[int, Path]:
    """The EPYC 9654's trees by NPS mode."""
    return {nps: epyc_9654(tmp_path_factory.mktemp(f"epyc-nps{nps}"), nps=nps) for nps in (1, 4)}


def _cpus(*ranges: range) -> list[int]:
    return sorted(cpu for r in ranges for cpu in r)


def _assert_partition(shares: list[list[int]], cpus: tuple[int, ...]) -> None:
    """Every usable CPU in exactly one share, none empty."""
    assert all(shares) and sorted(cpu for share in shares for cpu in share) == sorted(cpus), shares


def _assert_siblings_together(shares: list[list[int]], topology: HostTopology) -> None:
    for domain in topology.domains:
        for core in domain.cores:
            assert sum(bool(set(core) & set(share)) for share in shares) == 1, f"core {core} split: {shares}"


def test_cpus_are_shared_out_without_overlap() -> None:
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([5], 3) == [[5], [5], [5]]


def test_a_two_socket_xeon_gets_a_rank_per_socket_and_socket_halves_for_four(xeon):
    topology = xeon
    assert auto_ranks(topology) == 2
    assert cpu_shares(topology, 2) == [_cpus(range(32), range(64, 96)), _cpus(range(32, 64), range(96, 128))]
    four = cpu_shares(topology, 4)
    assert four == [_cpus(range(0, 16), range(64, 80)), _cpus(range(16, 32), range(80, 96)),
                    _cpus(range(32, 48), range(96, 112)), _cpus(range(48, 64), range(112, 128))]
    assert describe_share(topology, four[1]) == "socket 0, node 0, L3 of CPUs 0-31,64-95"
    assert cpu_shares(topology, 1) == [list(range(128))]


def test_counts_that_do_not_fit_the_sockets_fall_back_to_contiguous_runs_of_whole_cores(xeon):
    topology = xeon
    three = cpu_shares(topology, 3)
    _assert_partition(three, topology.cpus)
    _assert_siblings_together(three, topology)
    assert [len(share) for share in three] == [44, 42, 42]           # 64 cores: 22, 21, 21
    assert three[0] == _cpus(range(22), range(64, 86))
    assert describe_share(topology, three[1]) == "2 sockets, 2 NUMA nodes, 2 L3 caches"


@pytest.mark.parametrize("nps", [1, 4])
def test_an_epyc_9654_gets_a_rank_per_ccd(epyc, nps):
    topology = read_host_topology(epyc[nps], cpus=list(range(192)))
    assert auto_ranks(topology) == 12
    shares = cpu_shares(topology, 12)
    assert shares == [_cpus(range(8 * k, 8 * k + 8), range(96 + 8 * k, 104 + 8 * k)) for k in range(12)]
    assert describe_share(topology, shares[5]) == f"socket 0, node {5 // (12 // nps)}, L3 of CPUs 40-47,136-143"
    halves = cpu_shares(topology, 24)                # each CCD cut into two shares of 4 cores
    assert halves[:2] == [_cpus(range(0, 4), range(96, 100)), _cpus(range(4, 8), range(100, 104))]
    _assert_partition(halves, topology.cpus)
    _assert_siblings_together(halves, topology)


def test_four_ranks_on_an_nps4_epyc_are_its_numa_nodes(epyc):
    topology = read_host_topology(epyc[4], cpus=list(range(192)))
    shares = cpu_shares(topology, 4)
    assert shares == [_cpus(range(24 * n, 24 * n + 24), range(96 + 24 * n, 120 + 24 * n)) for n in range(4)]
    assert [describe_share(topology, share) for share in shares] == [
        f"socket 0, node {n}, 3 L3 caches" for n in range(4)]


def test_an_affinity_subset_places_ranks_on_its_own_ccds(epyc):
    topology = read_host_topology(epyc[1], cpus=list(range(8, 24)))
    assert auto_ranks(topology) == 2
    assert cpu_shares(topology, 2) == [list(range(8, 16)), list(range(16, 24))]
    # a 2-core piece of CCD 0 is no rank of its own: it joins the CCD next to it in its node
    cut = read_host_topology(epyc[1], cpus=list(range(6, 24)))
    assert len(cut.domains) == 3 and auto_ranks(cut) == 2
    assert cpu_shares(cut, 2) == [list(range(6, 16)), list(range(16, 24))]


def test_a_host_of_tiny_domains_is_one_rank(tmp_path):
    """A VM that reports an L3 per pair of vCPUs: the topology gives no domain worth a rank."""
    root = write_host(tmp_path, cores=8, smt=False, package_of_core=[0] * 8, l3_of_core=[c // 2 for c in range(8)],
                      node_of_core=[0] * 8)
    topology = read_host_topology(root, cpus=list(range(8)))
    assert len(topology.domains) == 4 and auto_ranks(topology) == 1
    assert cpu_shares(topology, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_container_without_cache_files_is_one_rank_split_as_before(tmp_path):
    topology = read_host_topology(container(tmp_path, cpus=16), cpus=list(range(16)))
    assert auto_ranks(topology) == 1
    for ranks in (2, 3, 5):
        assert cpu_shares(topology, ranks) == split_cpus(list(range(16)), ranks)
    assert describe_share(topology, list(range(8))) == "socket 0"
    assert cpu_shares(topology, 20) == split_cpus(list(range(16)), 20)   # more ranks than CPUs: they share


def test_the_start_up_line_names_each_share_and_its_domain(xeon):
    topology = xeon
    assert describe_shares(topology, cpu_shares(topology, 2)) == (
        "rank 0: CPUs 0-31,64-95 (socket 0, node 0, L3 of CPUs 0-31,64-95) | "
        "rank 1: CPUs 32-63,96-127 (socket 1, node 1, L3 of CPUs 32-63,96-127)")


def test_auto_resolves_on_the_topology_and_is_one_for_a_prefill_or_decode_instance(epyc):
    topology = read_host_topology(epyc[4], cpus=list(range(192)))
    config = load_config(parallel={"data_parallel_size": "auto"})
    assert resolve_data_parallel_size(config, topology).parallel.data_parallel_size == 12
    assert config.parallel.data_parallel_size == "auto", "the config given was changed"
    prefill = load_config(parallel={"data_parallel_size": "auto"}, splitwise={"role": "prefill"})
    assert resolve_data_parallel_size(prefill, topology).parallel.data_parallel_size == 1
    explicit = load_config(parallel={"data_parallel_size": 3})
    assert resolve_data_parallel_size(explicit, topology) is explicit


def test_this_host_auto_and_shares_cover_every_usable_cpu_once():
    topology = read_host_topology()
    usable = tuple(sorted(os.sched_getaffinity(0)))
    ranks = auto_ranks(topology)
    assert 1 <= ranks <= len(usable)
    if len({domain.l3 for domain in topology.domains}) == 1:
        assert ranks == 1, "one L3 on this host: auto must not change anything"
    cores = sum(len(domain.cores) for domain in topology.domains)
    for n in range(1, len(usable) + 1):
        shares = cpu_shares(topology, n)
        assert len(shares) == n
        _assert_partition(shares, usable)
        if n <= cores:
            _assert_siblings_together(shares, topology)
    resolved = resolve_data_parallel_size(load_config(parallel={"data_parallel_size": "auto"}))
    assert resolved.parallel.data_parallel_size == ranks
    assert format_cpulist(list(usable)) in describe_shares(topology, cpu_shares(topology, 1))
