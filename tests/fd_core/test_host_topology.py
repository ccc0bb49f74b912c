"""The host's CPU topology from sysfs: realistic trees written to tmp_path, a partial one, none, and this host's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fd_core.host_topology import FACTS, format_cpulist, parse_cpulist, read_host_topology
from tests.fd_core.sysfs_trees import container, epyc_9654, write_host, xeon_2s_64c


@pytest.fixture(scope="module")
def epyc(tmp_path_factory) -> dict[int, Path]:
    """The EPYC 9654's trees by NPS mode."""
    return {nps: epyc_9654(tmp_path_factory.mktemp(f"epyc-nps{nps}"), nps=nps) for nps in (1, 4)}


def test_cpulists_parse_and_format_both_ways():
    assert parse_cpulist("0-3,8-11\n") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_cpulist("5") == [5] and parse_cpulist("") == []
    assert format_cpulist([11, 0, 1, 2, 3, 8, 9, 10]) == "0-3,8-11"
    assert format_cpulist([0, 2, 4]) == "0,2,4"
    for bad in ("3-1", "a-b", "1-2-3"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_a_two_socket_xeon_is_one_domain_per_socket_with_smt_siblings_paired(tmp_path):
    topology = read_host_topology(xeon_2s_64c(tmp_path), cpus=list(range(128)))
    assert topology.unknown == ()
    assert [(d.package, d.node, d.l3) for d in topology.domains] == [(0, 0, "0-31,64-95"), (1, 1, "32-63,96-127")]
    first = topology.domains[0]
    assert len(first.cores) == 32 and first.cores[0] == (0, 64) and first.cores[31] == (31, 95)
    assert first.cpus == tuple([*range(32), *range(64, 96)])
    assert topology.cpus == tuple(range(128))


@pytest.mark.parametrize("nps", [1, 4])
def test_an_epyc_9654_is_one_domain_per_ccd_in_its_numa_node(epyc, nps):
    topology = read_host_topology(epyc[nps], cpus=list(range(192)))
    assert len(topology.domains) == 12
    for ccd, domain in enumerate(topology.domains):
        assert domain.l3 == format_cpulist([*range(8 * ccd, 8 * ccd + 8), *range(96 + 8 * ccd, 104 + 8 * ccd)])
        assert domain.node == ccd // (12 // nps) and domain.package == 0
        assert domain.cores == tuple((c, c + 96) for c in range(8 * ccd, 8 * ccd + 8))


def test_an_affinity_subset_keeps_only_its_cpus_and_their_domains(epyc):
    topology = read_host_topology(epyc[1], cpus=list(range(8, 24)))
    assert [d.cpus for d in topology.domains] == [tuple(range(8, 16)), tuple(range(16, 24))]
    assert topology.domains[0].cores == tuple((c,) for c in range(8, 16)), "siblings 104-111 are not usable"
    both_threads = read_host_topology(epyc[1], cpus=[*range(8, 16), *range(104, 112)])
    [domain] = both_threads.domains
    assert domain.cores == tuple((c, c + 96) for c in range(8, 16))


def test_a_container_without_cache_or_node_files_is_one_domain(tmp_path):
    topology = read_host_topology(container(tmp_path, cpus=16), cpus=list(range(16)))
    assert topology.unknown == ("NUMA nodes", "L3 caches")
    [domain] = topology.domains
    assert domain.cpus == tuple(range(16)) and domain.l3 == ""


def test_nothing_readable_is_one_domain_holding_every_cpu(tmp_path):
    topology = read_host_topology(tmp_path / "absent", cpus=[2, 3, 5])
    assert topology.unknown == FACTS
    [domain] = topology.domains
    assert domain.cores == ((2,), (3,), (5,))


def test_malformed_files_count_as_unknown_and_never_raise(tmp_path):
    write_host(tmp_path, cores=4, smt=True, package_of_core=[0] * 4, l3_of_core=[0] * 4, node_of_core=[0] * 4)
    cpu0 = tmp_path / "devices" / "system" / "cpu" / "cpu0"
    (cpu0 / "cache" / "index2" / "shared_cpu_list").write_text("garbage\n")
    (cpu0 / "cache" / "index3" / "shared_cpu_list").write_text("7-2\n")
    (cpu0 / "topology" / "physical_package_id").write_text("zero\n")
    (cpu0 / "topology" / "thread_siblings_list").write_text("1-\n")
    topology = read_host_topology(tmp_path, cpus=[0, 1, 4])    # CPU 4 is CPU 0's sibling
    assert topology.cpus == (0, 1, 4), "a CPU is missing or in two domains"
    assert [(d.l3, d.cores) for d in topology.domains] == [("", ((0,),)), ("0-7", ((1,), (4,)))]


def test_this_hosts_topology_holds_each_usable_cpu_once():
    topology = read_host_topology()
    usable = sorted(os.sched_getaffinity(0))
    cpus = [cpu for domain in topology.domains for core in domain.cores for cpu in core]
    assert sorted(cpus) == usable, "a usable CPU is missing or in two places"
    assert topology.domains
    assert [(d.package, d.node, d.cpus[0]) for d in topology.domains] == sorted(
        (d.package, d.node, d.cpus[0]) for d in topology.domains)
