"""NUMA placement (native/src/numa.c, kt_cli/ops/numa.py): worker pinning checked
by sched_getcpu() inside tasks and by the OS's affinity masks; page interleaving
checked by the kernel's own get_mempolicy() and /proc/self/numa_maps; the plan
KT_NUMA picks; and that a one-node host without KT_NUMA calls nothing at all.
What needs several nodes to mean anything is skipped with that reason."""

import ctypes
import mmap
import os
import platform
from collections import Counter
from mmap import PAGESIZE
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kt_cli import hardware
from kt_cli.errors import KtError
from kt_cli.kernels import Kernels
from kt_cli.ops import Pool, numa
from kt_cli.ops.moe import MoEExperts
from kt_cli.ops.numa import NO_PLACEMENT, NumaError, NumaPlan
from kt_weights.layout import Format, QMatrix

from c_harness import run_harness

TARGET_CPU = max(os.sched_getaffinity(0))
MPOL_DEFAULT, MPOL_INTERLEAVE, MPOL_F_ADDR = 0, 3, 1 << 1          # Linux uapi <linux/mempolicy.h>
SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}                 # asm/unistd.h
KT_EINVAL, KT_EUNSUPPORTED = -1, -4
TWO_NODES = (hardware.NumaNode(0, (0,)), hardware.NumaNode(1, (1,)))


# ---- worker pinning -----------------------------------------------------------------

@pytest.fixture(scope="module")
def harness_lines(tmp_path_factory) -> list[str]:
    return run_harness(tmp_path_factory.mktemp("numa"), "numa_harness", ["threadpool.c", "numa.c"], [str(TARGET_CPU)])


HARNESS_CHECKS = ["pinned async threads=1", "pinned sync threads=2", "pinned async threads=2",
                  "pinned sync threads=3", "pinned async threads=3", "caller affinity untouched"]


@pytest.mark.parametrize("check", HARNESS_CHECKS)
def test_pinned_workers_run_their_tasks_on_that_cpu(harness_lines, check):
    failures = [line for line in harness_lines if line.startswith(f"FAIL {check}")]
    assert not failures, failures
    assert f"ok {check}" in harness_lines


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def pool_and_workers(kernels, threads: int, plan: NumaPlan = NO_PLACEMENT) -> tuple[Pool, set[int]]:
    before = thread_ids()
    pool = Pool(kernels, threads, numa=plan)
    return pool, thread_ids() - before


def test_pin_workers_sets_every_worker_and_not_the_caller(ops):
    caller = os.sched_getaffinity(0)
    pool, workers = pool_and_workers(ops.kernels, 3)
    assert len(workers) == 2
    pool.pin_workers([TARGET_CPU])
    assert all(os.sched_getaffinity(tid) == {TARGET_CPU} for tid in workers)
    assert os.sched_getaffinity(0) == caller


def test_plan_spreads_workers_round_robin(ops):
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    plan = NumaPlan((0,), cpus)
    pool, workers = pool_and_workers(ops.kernels, 4, plan)
    got = Counter(frozenset(os.sched_getaffinity(tid)) for tid in workers)
    assert got == Counter(frozenset({cpus[w % len(cpus)]}) for w in range(3))


@pytest.mark.parametrize("cpus", [[], [-1], [1024], [0, 2.0], "0"])
def test_pin_workers_refuses_bad_cpus(ops, cpus):
    with pytest.raises(KtError, match="worker CPUs"):
        Pool(ops.kernels, 2, numa=NO_PLACEMENT).pin_workers(cpus)


def test_native_pin_refuses_bad_arguments(ops):
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    pool = Pool(ops.kernels, 2, numa=NO_PLACEMENT)
    good = ffi.new("int32_t[]", [0])
    assert lib.kt_pool_pin_workers(ffi.NULL, good, 1) == KT_EINVAL
    assert lib.kt_pool_pin_workers(pool.handle, ffi.NULL, 1) == KT_EINVAL
    for n in (0, -1):
        assert lib.kt_pool_pin_workers(pool.handle, good, n) == KT_EINVAL
    for cpu in (-1, 1024, 1 << 30):
        assert lib.kt_pool_pin_workers(pool.handle, ffi.new("int32_t[]", [0, cpu]), 2) == KT_EINVAL


def test_a_cpu_outside_this_process_is_refused_by_the_os(ops):
    outside = sorted(set(range(1024)) - os.sched_getaffinity(0))[-1]
    with pytest.raises(KtError, match="kt_pool_pin_workers failed"):
        Pool(ops.kernels, 2, numa=NO_PLACEMENT).pin_workers([outside])


# ---- interleaved pages --------------------------------------------------------------

def mempolicy(addr: int) -> int:
    number = SYS_GET_MEMPOLICY.get(platform.machine())
    if number is None:
        pytest.skip(f"needs x86-64 or aarch64 (the get_mempolicy syscall number), this is {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    mode = ctypes.c_int(-1)
    rc = libc.syscall(ctypes.c_long(number), ctypes.byref(mode), None, ctypes.c_ulong(0),
                      ctypes.c_void_p(addr), ctypes.c_ulong(MPOL_F_ADDR))
    assert rc == 0, os.strerror(ctypes.get_errno())
    return mode.value


def numa_maps_policy(addr: int) -> str:
    """The policy /proc/self/numa_maps shows for the mapping that starts at addr."""
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        start, policy = line.split()[:2]
        if int(start, 16) == addr:
            return policy
    return "(no mapping starts there)"


def page_aligned(pages: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A torch buffer of `pages` pages on a fresh anonymous mapping of its own (default
    policy: heap memory may already carry an interleave policy from an earlier layer)."""
    region = mmap.mmap(-1, pages * PAGESIZE)
    return region, torch.frombuffer(region, dtype=torch.uint8)


def interleave_raw(kernels, addr: int, size: int, nodes: list[int]) -> int:
    ffi, lib = kernels.ffi, kernels.lib
    return lib.kt_mem_interleave(ffi.cast("void *", addr), size, ffi.new("int32_t[]", nodes), len(nodes))


def test_interleave_sets_the_policy_of_the_whole_pages_only(ops):
    region, buf = page_aligned(8)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    before, ptr = buf.clone(), buf.data_ptr()
    rc = interleave_raw(ops.kernels, ptr + 100, 7 * PAGESIZE, [0])   # pages 1..6 whole, 0 and 7 partial
    if rc == KT_EUNSUPPORTED:
        pytest.skip("needs a kernel with NUMA support that lets this process call mbind (refused here)")
    assert rc == 0
    assert [mempolicy(ptr + p * PAGESIZE) for p in range(8)] == [MPOL_DEFAULT] + [MPOL_INTERLEAVE] * 6 + [MPOL_DEFAULT]
    assert numa_maps_policy(ptr + PAGESIZE) == "interleave:0"
    assert buf.data_ptr() == ptr and torch.equal(buf, before)


def test_interleave_without_a_whole_page_touches_nothing(ops):
    region, buf = page_aligned(2)
    assert interleave_raw(ops.kernels, buf.data_ptr() + 1, PAGESIZE, [0]) == 0
    assert mempolicy(buf.data_ptr()) == mempolicy(buf.data_ptr() + PAGESIZE) == MPOL_DEFAULT


@pytest.mark.parametrize("nodes", [[], [-1], [1024], [0, 1 << 20]])
def test_interleave_refuses_bad_nodes(ops, nodes):
    region, buf = page_aligned(2)
    assert interleave_raw(ops.kernels, buf.data_ptr(), buf.numel(), nodes) == KT_EINVAL


def test_interleave_refuses_bad_ranges(ops):
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    region, buf = page_aligned(2)
    nodes = ffi.new("int32_t[]", [0])
    assert lib.kt_mem_interleave(ffi.NULL, PAGESIZE, nodes, 1) == KT_EINVAL
    for size in (0, -1, -PAGESIZE):
        assert lib.kt_mem_interleave(ffi.cast("void *", buf.data_ptr()), size, nodes, 1) == KT_EINVAL
    assert lib.kt_mem_interleave(ffi.cast("void *", buf.data_ptr()), PAGESIZE, ffi.NULL, 1) == KT_EINVAL
    assert lib.kt_mem_interleave(ffi.cast("void *", buf.data_ptr()), PAGESIZE, nodes, 1025) == KT_EINVAL
    wraps = ffi.cast("void *", (1 << 64) - PAGESIZE)
    assert lib.kt_mem_interleave(wraps, 2 * PAGESIZE, nodes, 1) == KT_EINVAL
    unmapped = ffi.cast("void *", PAGESIZE)            # the kernel reports the hole (EFAULT)
    assert lib.kt_mem_interleave(unmapped, 4 * PAGESIZE, nodes, 1) == KT_EINVAL


def test_tensor_spans():
    raw = torch.zeros(4 * PAGESIZE, dtype=torch.uint8)
    a, far = raw[:100], raw[3 * PAGESIZE:]
    base = raw.data_ptr()
    assert numa.tensor_spans([far, a]) == [(base, base + 100), (base + 3 * PAGESIZE, base + 4 * PAGESIZE)]
    assert numa.tensor_spans([raw[:0], raw.view(64, -1).t()]) == []      # empty and non-contiguous left out


P = PAGESIZE
MAPS = f"""{10 * P:x}-{12 * P:x} rw-p 00000000 00:00 0                          [heap]
{12 * P:x}-{14 * P:x} rw-p 00000000 00:00 0
{20 * P:x}-{30 * P:x} rw-p 00000000 00:00 0
{30 * P:x}-{32 * P:x} r--p 00000000 08:01 1234                       /usr/lib/libc.so.6
{32 * P:x}-{38 * P:x} rw-p 00000000 00:00 0                          [stack]
{38 * P:x}-{42 * P:x} rw-s 00000000 00:05 77                         /dev/nvidia0
{42 * P:x}-{48 * P:x} rw-p 00000000 08:01 99                         /models/my model.gguf
{48 * P:x}-{50 * P:x} rw-p 00000000 00:00 0
{50 * P:x}-{52 * P:x} rw-p 00000000 00:00 0                          [anon:glibc malloc]
{52 * P:x}-{54 * P:x} rw-p 00000000 00:00 0
{54 * P:x}-{56 * P:x} r--p 00000000 00:00 0
"""


def test_mapped_runs():
    assert numa.mapped_runs(MAPS) == [(10 * P, 14 * P), (20 * P, 30 * P), (30 * P, 32 * P), (42 * P, 48 * P),
                                      (48 * P, 54 * P)]
    assert numa.mapped_runs("garbage\n\nx y z\n") == []


@pytest.mark.parametrize("spans, joined", [
    ([(10 * P + 8, 11 * P + 5), (11 * P + 70, 12 * P)], [(10 * P + 8, 12 * P)]),         # pages touch
    ([(10 * P, 10 * P + 9), (13 * P + 1, 13 * P + 9)], [(10 * P, 13 * P + 9)]),          # gap in one run
    ([(12 * P, 13 * P), (21 * P, 22 * P)], [(12 * P, 13 * P), (21 * P, 22 * P)]),          # a hole between
    ([(29 * P, 30 * P - 8), (31 * P, 31 * P + 8)], [(29 * P, 30 * P - 8), (31 * P, 31 * P + 8)]),  # two mappings
    ([(43 * P, 43 * P + 8), (46 * P, 47 * P)], [(43 * P, 47 * P)]),                        # within one file
    ([(38 * P, 38 * P + 8), (41 * P, 42 * P)], [(38 * P, 38 * P + 8), (41 * P, 42 * P)]),          # device
    ([(3 * P, 4 * P), (6 * P, 7 * P)], [(3 * P, 4 * P), (6 * P, 7 * P)]),                  # not mapped
    ([(20 * P, 25 * P), (21 * P, 22 * P)], [(20 * P, 25 * P)]),                            # overlapping views
])
def test_join_spans(spans, joined):
    assert numa.join_spans(spans, numa.mapped_runs(MAPS)) == joined


def test_experts_of_a_layer_become_few_mappings(ops):
    plan = NumaPlan((0,), (TARGET_CPU,))
    pool = Pool(ops.kernels, 2, numa=plan)
    g = torch.Generator().manual_seed(0)
    i4 = lambda rows, cols: ops.quantize(torch.randn(rows, cols, generator=g), Format.I4, 32)
    # quantized, then tiled copies: freed originals leave holes in the heap between experts
    weights = [[i4(128, 512) for _ in range(16)], [i4(128, 512) for _ in range(16)], [i4(512, 128) for _ in range(16)]]
    experts = MoEExperts(*weights, ops=SimpleNamespace(pool=pool))
    if experts.numa_ranges == 0:
        pytest.skip("needs a kernel with NUMA support that lets this process call mbind (refused here)")
    assert experts.numa_ranges <= 3
    pages = [p for p in map(_first_whole_page, experts.tensors()) if p is not None]
    assert len(pages) >= 48 and all(mempolicy(p) == MPOL_INTERLEAVE for p in pages)


def _first_whole_page(t: torch.Tensor) -> int | None:
    """The address of the first page that lies wholly inside t, if one does (small row8 scales may not)"""
    start = -(-t.data_ptr() // PAGESIZE) * PAGESIZE
    return start if start + PAGESIZE <= t.data_ptr() + t.numel() * t.element_size() else None


def test_interleave_failure_warns_once_and_places_nothing(ops, caplog, monkeypatch):
    monkeypatch.setattr(numa, "_warned", set())
    region, buf = page_aligned(4)
    plan = NumaPlan((1023,), (0,))           # no such node: the kernel refuses
    with caplog.at_level("WARNING", logger="kt.numa"):
        assert numa.interleave(ops.kernels, [buf], plan) == 0
        assert numa.interleave(ops.kernels, [buf], plan) == 0
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1 == len(caplog.records)
    assert "could not interleave" in caplog.records[0].message


# ---- the plan and what it calls ---------------------------------------------------------

@pytest.mark.parametrize("env, topology, nodes", [
    (None, TWO_NODES, (0, 1)), ("interleave", TWO_NODES, (0, 1)), ("off", TWO_NODES, ()),
    (None, TWO_NODES[:1], ()), ("interleave", TWO_NODES[:1], (0,)), ("  Interleave ", TWO_NODES[:1], (0,)),
])
def test_plan_follows_kt_numa(monkeypatch, env, topology, nodes):
    monkeypatch.setattr(hardware, "allowed_cpus", lambda: (0, 1))
    monkeypatch.delenv(numa.ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(numa.ENV, env)
    assert numa.current_plan(topology).nodes == nodes


def test_plan_spreads_over_nodes_and_keeps_to_allowed_cpus(monkeypatch):
    monkeypatch.delenv(numa.ENV, raising=False)
    topology = (hardware.NumaNode(0, (0, 1, 2, 8)), hardware.NumaNode(1, (4, 5)), hardware.NumaNode(2, (9,)))
    monkeypatch.setattr(hardware, "allowed_cpus", lambda: (0, 1, 2, 4, 5, 8))
    assert numa.current_plan(topology) == NumaPlan((0, 1), (0, 4, 1, 5, 2, 8))
    monkeypatch.setattr(hardware, "allowed_cpus", lambda: (0, 1, 2))     # a cpuset of node 0 only
    assert numa.current_plan(topology) == NO_PLACEMENT


def test_bad_kt_numa_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(numa.ENV, "spread")
    with pytest.raises(NumaError, match="KT_NUMA must be 'interleave' or 'off'"):
        numa.current_plan(TWO_NODES)


@pytest.mark.parametrize("nodes, cpus", [((0,), ()), ((), (0,)), ((-1,), (0,)), ((0,), (1024,))])
def test_plan_validated_at_construction(nodes, cpus):
    with pytest.raises(NumaError):
        NumaPlan(nodes, cpus)


class SpyLib:
    """The real library, with the placement entry points recorded (or refused)."""

    def __init__(self, lib, refuse: bool):
        self._lib, self._refuse, self.calls = lib, refuse, []

    def __getattr__(self, name):
        real = getattr(self._lib, name)
        if name not in ("kt_pool_pin_workers", "kt_mem_interleave"):
            return real

        def spy(*args):
            if self._refuse:
                raise AssertionError(f"{name} called on a one-node host without KT_NUMA")
            self.calls.append(name)
            return real(*args)
        return spy


def tiny_experts(n: int = 4, hidden: int = 256, inter: int = 128) -> list[list[QMatrix]]:
    g = torch.Generator().manual_seed(0)
    mat = lambda rows, cols: QMatrix(Format.F32, rows, cols, torch.randn(rows, cols, generator=g))
    return [[mat(inter, hidden) for _ in range(n)], [mat(inter, hidden) for _ in range(n)],
            [mat(hidden, inter) for _ in range(n)]]


def build_with(ops, monkeypatch, topology, env: str | None, refuse: bool) -> tuple[SpyLib, MoEExperts]:
    monkeypatch.setattr(hardware, "system_numa_topology", lambda: topology)
    monkeypatch.setattr(hardware, "allowed_cpus", lambda: tuple(sorted(os.sched_getaffinity(0))))
    monkeypatch.delenv(numa.ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(numa.ENV, env)
    spy = SpyLib(ops.kernels.lib, refuse)
    kernels = Kernels(ops.kernels.variant, ops.kernels.reason, ops.kernels.ffi, spy)
    fake_ops = SimpleNamespace(pool=Pool(kernels, 3))
    return spy, MoEExperts(*tiny_experts(), ops=fake_ops)


def test_one_node_without_kt_numa_calls_nothing(ops, monkeypatch):
    spy, experts = build_with(ops, monkeypatch, TWO_NODES[:1], None, refuse=True)
    assert spy.calls == [] and experts.numa_ranges == 0
    x = torch.randn(2, 256)
    out = experts.forward(x, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.ones(2, 2))
    assert out.shape == (2, 256)


@pytest.mark.parametrize("topology, env", [(TWO_NODES, None), (TWO_NODES[:1], "interleave")])
def test_placement_pins_and_interleaves_when_planned(ops, monkeypatch, topology, env):
    if len(os.sched_getaffinity(0)) < 2 and env is None:
        pytest.skip("the fake two-node topology needs CPUs 0 and 1 in this process's affinity")
    spy, experts = build_with(ops, monkeypatch, topology, env, refuse=False)
    assert spy.calls[0] == "kt_pool_pin_workers" and spy.calls.count("kt_mem_interleave") == experts.numa_ranges
    assert experts.numa_ranges >= 1


def test_workers_spread_over_real_nodes(ops):
    topology = hardware.system_numa_topology()
    if len(topology) < 2:
        pytest.skip("needs a machine with 2+ NUMA nodes")
    plan = numa.current_plan(topology)
    pool, workers = pool_and_workers(ops.kernels, 2 * len(topology) + 1, plan)
    nodes_of = {cpu: n.id for n in topology for cpu in n.cpus}
    used = Counter(nodes_of[next(iter(os.sched_getaffinity(tid)))] for tid in workers)
    assert set(used) == {n.id for n in numa.usable_nodes(topology)}


@pytest.mark.parametrize("env, status, detail", [
    ("off", "ok", "no placement (KT_NUMA=off)"), ("interleave", "ok", "experts interleaved over nodes [0"),
    ("both", "warn", "KT_NUMA must be"),
])
def test_doctor_shows_the_placement(monkeypatch, env, status, detail):
    from kt_cli import doctor
    monkeypatch.setattr(hardware, "system_numa_topology", lambda: TWO_NODES[:1])
    monkeypatch.setenv(numa.ENV, env)
    check = doctor._numa_check()
    assert (check.name, check.status) == ("numa", status) and detail in check.detail
