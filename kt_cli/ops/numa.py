"""NUMA placement on hosts with several nodes: the pool's workers spread over every
node's CPUs, and each MoE layer's expert weights (the bytes decode streams) interleaved
page by page over the nodes' memory: one copy split across the nodes, never a copy
per node. Experts are not scheduled per node: any worker may read any page.

KT_NUMA: unset -> placement when 2+ nodes have CPUs this process may run on;
"interleave" -> placement even on one node; "off" -> none. Without a plan nothing
is called. A placement the OS refuses (a container without the permission) logs
one warning and kt goes on unplaced: placement never changes results."""

import logging
import os
from bisect import bisect_right
from dataclasses import dataclass
from mmap import PAGESIZE
from pathlib import Path

import torch

from .. import hardware
from ..errors import KtError
from .ffi_args import STATUS_NAMES

ENV = "KT_NUMA"
MODES = {"": "auto", "auto": "auto", "interleave": "interleave", "off": "off"}
log = logging.getLogger("kt.numa")
_warned: set[str] = set()


class NumaError(KtError):
    pass


@dataclass(frozen=True)
class NumaPlan:
    nodes: tuple[int, ...] = ()         # nodes the expert weights interleave over; () = no placement
    worker_cpus: tuple[int, ...] = ()   # worker w runs on worker_cpus[w % len]: round robin over nodes

    def __post_init__(self) -> None:
        if bool(self.nodes) != bool(self.worker_cpus):
            raise NumaError(f"a NUMA plan needs both nodes and CPUs, got {self.nodes} and {self.worker_cpus}")
        for what, ids in (("node", self.nodes), ("cpu", self.worker_cpus)):
            if not all(isinstance(i, int) and 0 <= i < 1024 for i in ids):
                raise NumaError(f"NUMA {what} ids must be integers in 0..1023, got {ids}")

    @property
    def active(self) -> bool:
        return bool(self.nodes)


NO_PLACEMENT = NumaPlan()


def mode() -> str:
    value = os.environ.get(ENV, "").strip().lower()
    if value not in MODES:
        raise NumaError(f"{ENV} must be 'interleave' or 'off' (or unset), got {os.environ[ENV]!r}")
    return MODES[value]


def current_plan(topology: tuple[hardware.NumaNode, ...] | None = None) -> NumaPlan:
    """The placement kt uses on this host under KT_NUMA."""
    chosen = mode()
    if chosen == "off":
        return NO_PLACEMENT
    nodes = usable_nodes(topology if topology is not None else hardware.system_numa_topology())
    if not nodes or (chosen == "auto" and len(nodes) < 2):
        return NO_PLACEMENT
    return NumaPlan(tuple(n.id for n in nodes), spread_cpus(nodes))


def usable_nodes(topology: tuple[hardware.NumaNode, ...]) -> tuple[hardware.NumaNode, ...]:
    allowed = set(hardware.allowed_cpus())
    nodes = (hardware.NumaNode(n.id, tuple(c for c in n.cpus if c in allowed)) for n in topology)
    return tuple(n for n in nodes if n.cpus)


def spread_cpus(nodes: tuple[hardware.NumaNode, ...]) -> tuple[int, ...]:
    """Node 0's first CPU, node 1's first, ..., node 0's second...: any k workers
    split evenly over the nodes (and over physical cores before SMT siblings)."""
    depth = max(len(n.cpus) for n in nodes)
    return tuple(n.cpus[i] for i in range(depth) for n in nodes if i < len(n.cpus))


def describe(plan: NumaPlan, topology: tuple[hardware.NumaNode, ...]) -> str:
    count = f"{len(topology)} node{'s' if len(topology) != 1 else ''}"
    if not plan.active:
        forced = " (KT_NUMA=off)" if mode() == "off" else ""
        return f"{count}: no placement{forced}"
    return f"{count}: experts interleaved over nodes {list(plan.nodes)}, workers spread over their CPUs"


def interleave(kernels, tensors: list[torch.Tensor], plan: NumaPlan) -> int:
    """Interleaves the pages of `tensors` over plan.nodes; returns the ranges placed."""
    if not plan.active:
        return 0
    ffi, lib = kernels.ffi, kernels.lib
    nodes = ffi.new("int32_t[]", list(plan.nodes))
    spans = join_spans(tensor_spans(tensors), mapped_runs(_read_maps()))
    for placed, (start, end) in enumerate(spans):
        rc = lib.kt_mem_interleave(ffi.cast("void *", start), end - start, nodes, len(plan.nodes))
        if rc < 0:
            warn_once("interleave", f"could not interleave expert weights over NUMA nodes "
                                    f"{list(plan.nodes)} ({STATUS_NAMES.get(rc, rc)}); they stay where they are")
            return placed
    return len(spans)


def tensor_spans(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) bytes of the contiguous, non-empty CPU tensors, sorted."""
    return sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                  for t in tensors if t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0)


def join_spans(spans: list[tuple[int, int]], runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted spans joined where their pages touch, or where the gap between them lies
    in one run of mapped memory (mapped_runs), never across an unmapped hole. Each mbind range becomes its own kernel memory mapping and a
    process may hold only ~65k (DeepSeek-V3 has ~90k expert tensors); the pages
    of a gap (freed or unrelated memory) are interleaved too, which moves no value."""
    run_starts = [lo for lo, _ in runs]
    joined: list[tuple[int, int]] = []
    for start, end in spans:
        if joined and _joinable(joined[-1][1], start, runs, run_starts):
            joined[-1] = (joined[-1][0], max(joined[-1][1], end))
        else:
            joined.append((start, end))
    return joined


def _joinable(prev_end: int, start: int, runs, run_starts) -> bool:
    if start // PAGESIZE <= -(-prev_end // PAGESIZE):
        return True
    i = bisect_right(run_starts, prev_end - 1) - 1
    return i >= 0 and runs[i][0] <= prev_end - 1 and start < runs[i][1]


def mapped_runs(maps: str) -> list[tuple[int, int]]:
    """Address runs without holes, from a /proc/PID/maps text ("lo-hi perms offset dev
    inode [name]"): adjacent private anonymous mappings joined (heap, malloc's), and
    each mapping of a regular file alone (checkpoints mapped copy-on-write). Stacks,
    vdso and device mappings are left out."""
    runs: list[tuple[int, int, bool]] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        kind = _mapping_kind(fields)
        if kind is None:
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if kind == "anon" and runs and runs[-1][2] and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi, True)
        else:
            runs.append((lo, hi, kind == "anon"))
    return [(lo, hi) for lo, hi, _ in runs]


def _mapping_kind(fields: list[str]) -> str | None:
    if len(fields) < 5 or "-" not in fields[0]:
        return None
    name = fields[5].strip() if len(fields) > 5 else ""
    if fields[4] == "0":
        private_rw = fields[1] == "rw-p"
        return "anon" if private_rw and (name in ("", "[heap]") or name.startswith("[anon:")) else None
    if name.startswith("/") and (not name.startswith("/dev/") or name.startswith("/dev/shm/")):
        return "file"
    return None


def _read_maps() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


def warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(message)
