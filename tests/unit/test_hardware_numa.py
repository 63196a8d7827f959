"""NUMA topology from sysfs (kt_cli.hardware.numa_topology) on fake sysfs trees:
cpulist parsing, offline and CPU-less nodes, SMT ordering, and the fallback to one
node of this process's CPUs when sysfs is missing or malformed."""

import os

import pytest

from kt_cli import hardware
from kt_cli.hardware import NumaNode, numa_topology, parse_cpulist


@pytest.mark.parametrize("text, cpus", [
    ("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-3,8-11\n", (0, 1, 2, 3, 8, 9, 10, 11)),
    ("5,1,3", (1, 3, 5)), ("", ()), ("\n", ()), ("2-2", (2,)), ("0-1,1-2", (0, 1, 2)),
])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "-1", "0-", "1-2-3", "0x3", "1 2", f"0-{1 << 21}"])
def test_parse_cpulist_refuses_malformed(text):
    with pytest.raises(ValueError):
        parse_cpulist(text)


def make_sysfs(root, nodes: dict[int, str], online: str | None = None, siblings: dict[int, str] | None = None):
    node_root, cpu_root = root / "node", root / "cpu"
    node_root.mkdir(parents=True)
    for node, cpulist in nodes.items():
        (node_root / f"node{node}").mkdir()
        (node_root / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    if online is not None:
        (node_root / "online").write_text(online + "\n")
    for cpu, group in (siblings or {}).items():
        (cpu_root / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (cpu_root / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(group + "\n")
    return node_root, cpu_root


def this_process_node() -> tuple[NumaNode, ...]:
    return (NumaNode(0, tuple(sorted(os.sched_getaffinity(0)))),)


def test_two_nodes(tmp_path):
    nodes, cpus = make_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, online="0-1")
    assert numa_topology(nodes, cpus) == (NumaNode(0, (0, 1, 2, 3)), NumaNode(1, (4, 5, 6, 7)))


def test_offline_and_cpuless_nodes_are_left_out(tmp_path):
    nodes, cpus = make_sysfs(tmp_path, {0: "0-1", 1: "", 2: "2-3", 3: "4-5"}, online="0-2")
    assert numa_topology(nodes, cpus) == (NumaNode(0, (0, 1)), NumaNode(2, (2, 3)))


def test_nodes_sorted_by_number_not_name(tmp_path):
    nodes, cpus = make_sysfs(tmp_path, {10: "2", 2: "1", 0: "0"})
    assert [n.id for n in numa_topology(nodes, cpus)] == [0, 2, 10]


def test_physical_cores_before_smt_siblings(tmp_path):
    # siblings numbered side by side: (0,1) (2,3) on node 0
    nodes, cpus = make_sysfs(tmp_path, {0: "0-3"}, siblings={0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"})
    assert numa_topology(nodes, cpus) == (NumaNode(0, (0, 2, 1, 3)),)


def test_unreadable_sibling_lists_keep_the_node_order(tmp_path):
    nodes, cpus = make_sysfs(tmp_path, {0: "0-3"}, siblings={0: "0,2", 1: "garbage", 2: "0,2"})
    assert numa_topology(nodes, cpus) == (NumaNode(0, (0, 1, 3, 2)),)


def test_missing_sysfs_falls_back_to_this_process_cpus(tmp_path):
    assert numa_topology(tmp_path / "absent", tmp_path / "absent_cpu") == this_process_node()


@pytest.mark.parametrize("nodes, online", [
    ({0: "0-3", 1: "4-x"}, None),      # a malformed cpulist
    ({0: "0-3"}, "zero"),              # a malformed online list
    ({}, None),                        # no node directories at all
    ({0: ""}, None),                   # no node with CPUs
])
def test_malformed_sysfs_falls_back_to_one_node(tmp_path, nodes, online):
    node_root, cpu_root = make_sysfs(tmp_path, nodes, online)
    assert numa_topology(node_root, cpu_root) == this_process_node()


def test_missing_cpulist_file_falls_back(tmp_path):
    node_root, cpu_root = make_sysfs(tmp_path, {0: "0-1"})
    (node_root / "node1").mkdir()
    assert numa_topology(node_root, cpu_root) == this_process_node()


def test_this_host_matches_the_node_count_kt_doctor_reports():
    topology = hardware.numa_topology()
    assert 1 <= len(topology) <= hardware.cpu().numa_nodes
    assert set().union(*(n.cpus for n in topology)) >= set(os.sched_getaffinity(0))
