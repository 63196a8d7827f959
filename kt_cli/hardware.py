"""The one place that reads facts about this machine: CPU features and whether
the OS enables them, cores, NUMA nodes, RAM, GPUs, disk. Everything else asks here."""

import os
import platform
import shutil
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import psutil

# XCR0 bits: which register state the OS saves (Intel SDM vol. 1, 13.3)
XCR0_AVX = 0b110                       # SSE + AVX (YMM upper halves)
XCR0_AVX512 = 0b1110_0000              # opmask, ZMM0-15 upper, ZMM16-31
XCR0_AMX = (1 << 17) | (1 << 18)       # TILECFG, TILEDATA

_ALIASES = {
    "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
    "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
    "amxtile": "amx_tile", "amxint8": "amx_int8", "amxbf16": "amx_bf16",
}
_AVX_FLAGS = {"avx", "avx2", "fma", "f16c"}
_AMX_FLAGS = {"amx_tile", "amx_int8", "amx_bf16"}


@dataclass(frozen=True)
class CpuFacts:
    brand: str
    arch: str
    flags: frozenset[str]              # what CPUID advertises
    xcr0: int                          # what the OS enables (0 when unknown)
    amx_permitted: bool                # Linux granted the AMX tile state
    physical_cores: int
    logical_cores: int
    numa_nodes: int

    @property
    def os_avx(self) -> bool:
        return self.xcr0 & XCR0_AVX == XCR0_AVX

    @property
    def os_avx512(self) -> bool:
        return self.xcr0 & XCR0_AVX512 == XCR0_AVX512

    @property
    def os_amx(self) -> bool:
        return self.xcr0 & XCR0_AMX == XCR0_AMX and self.amx_permitted

    def usable(self) -> frozenset[str]:
        """Flags the CPU has and the OS lets this process use."""
        return frozenset(f for f in self.flags if self._os_enables(f))

    def _os_enables(self, flag: str) -> bool:
        if flag.startswith("avx512"):
            return self.os_avx and self.os_avx512
        if flag in _AMX_FLAGS:
            return self.os_amx
        if flag in _AVX_FLAGS:
            return self.os_avx
        return True


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: str


@dataclass(frozen=True)
class MemoryFacts:
    total_bytes: int
    available_bytes: int


@dataclass(frozen=True)
class GpuSummary:
    cuda_version: str | None
    gpus: tuple[GpuFacts, ...] = field(default_factory=tuple)
    error: str | None = None


def normalise_flags(raw: set[str] | frozenset[str]) -> frozenset[str]:
    return frozenset(_ALIASES.get(f.lower(), f.lower()) for f in raw)


def _proc_cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    brand, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not brand:
            brand = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return brand, flags


def _py_cpuinfo() -> tuple[str, set[str]]:
    try:
        import cpuinfo
        info = cpuinfo.get_cpu_info()
    except Exception:
        return "", set()
    return info.get("brand_raw", ""), set(info.get("flags", []))


def _numa_nodes() -> int:
    nodes = Path("/sys/devices/system/node")
    count = len(list(nodes.glob("node[0-9]*"))) if nodes.is_dir() else 0
    return max(count, 1)


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]     # one CPU of each physical core first, then their SMT siblings


SYSFS_NODES = Path("/sys/devices/system/node")
SYSFS_CPUS = Path("/sys/devices/system/cpu")
MAX_CPU_ID = 1 << 20


def parse_cpulist(text: str) -> tuple[int, ...]:
    """A kernel cpu/node list such as "0-3,8-11" -> (0, 1, 2, 3, 8, 9, 10, 11);
    "" (an empty node) -> (). ValueError when malformed."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if not 0 <= first <= last < MAX_CPU_ID:
            raise ValueError(f"bad range {part!r} in cpu list {text.strip()!r}")
        ids.update(range(first, last + 1))
    return tuple(sorted(ids))


def numa_topology(nodes_root: Path = SYSFS_NODES, cpus_root: Path = SYSFS_CPUS) -> tuple[NumaNode, ...]:
    """The online NUMA nodes that have CPUs, from sysfs. One node holding every CPU
    this process may run on when sysfs is missing, unreadable or malformed."""
    try:
        nodes = _sysfs_nodes(nodes_root)
    except (OSError, ValueError):
        nodes = ()
    if not nodes:
        return (NumaNode(0, _core_order(allowed_cpus(), cpus_root)),)
    return tuple(NumaNode(n, _core_order(cpus, cpus_root)) for n, cpus in nodes)


@lru_cache(maxsize=1)
def system_numa_topology() -> tuple[NumaNode, ...]:
    return numa_topology()


def _sysfs_nodes(root: Path) -> tuple[tuple[int, tuple[int, ...]], ...]:
    online_file = root / "online"
    online = set(parse_cpulist(online_file.read_text())) if online_file.exists() else None
    found = []
    for path in root.glob("node[0-9]*"):
        node = int(path.name[4:])
        if online is not None and node not in online:
            continue
        cpus = parse_cpulist((path / "cpulist").read_text())
        if cpus:
            found.append((node, cpus))
    return tuple(sorted(found))


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity: taskset, cgroup cpusets)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def _core_order(cpus: tuple[int, ...], cpus_root: Path) -> tuple[int, ...]:
    """cpus with the first thread of each physical core ahead of its siblings, so
    taking the first k CPUs spreads over k cores wherever the kernel numbers siblings."""
    firsts, siblings = [], []
    for cpu in cpus:
        try:
            text = (cpus_root / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
            group = parse_cpulist(text)
        except (OSError, ValueError):
            group = ()
        (siblings if group and cpu != group[0] else firsts).append(cpu)
    return tuple(firsts + siblings)


def _xcr0_and_amx() -> tuple[int, bool]:
    from . import kernels
    lib = kernels.load_generic()
    xcr0 = int(lib.kt_os_xcr0())
    amx = xcr0 & XCR0_AMX == XCR0_AMX and lib.kt_amx_request_permission() == 0
    return xcr0, amx


@lru_cache(maxsize=1)
def cpu() -> CpuFacts:
    brand, proc_flags = _proc_cpuinfo()
    py_brand, py_flags = _py_cpuinfo()
    xcr0, amx = _xcr0_and_amx()
    logical = psutil.cpu_count(logical=True) or 1
    return CpuFacts(
        brand=py_brand or brand or platform.processor() or "unknown",
        arch=platform.machine().lower(),
        flags=normalise_flags(proc_flags | py_flags),
        xcr0=xcr0,
        amx_permitted=amx,
        physical_cores=psutil.cpu_count(logical=False) or logical,
        logical_cores=logical,
        numa_nodes=_numa_nodes(),
    )


def memory() -> MemoryFacts:
    vm = psutil.virtual_memory()
    return MemoryFacts(total_bytes=vm.total, available_bytes=vm.available)


@lru_cache(maxsize=1)
def gpus() -> GpuSummary:
    try:
        import torch
        if not torch.cuda.is_available():
            return GpuSummary(cuda_version=torch.version.cuda)
        return GpuSummary(torch.version.cuda, tuple(_gpu(i) for i in range(torch.cuda.device_count())))
    except Exception as exc:  # a broken driver must not stop the CPU path
        return GpuSummary(cuda_version=None, error=str(exc).splitlines()[0])


def _gpu(index: int) -> GpuFacts:
    import torch
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return GpuFacts(index, props.name, total, free, f"{props.major}.{props.minor}")


def default_threads() -> int:
    env = os.environ.get("KT_THREADS")
    if env:
        return max(1, int(env))
    return cpu().physical_cores


def kt_home() -> Path:
    env = os.environ.get("KT_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kt"


def free_disk_bytes(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


@lru_cache(maxsize=1)
def _libc():
    """The C library through ctypes (find_library runs ldconfig: once a process), or None"""
    import ctypes
    import ctypes.util

    lib = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(lib) if lib else None
    except OSError:
        return None


def _glibc(name: str):
    """glibc's function `name`, or None where the C library has none (musl, macOS, Windows)."""
    return getattr(_libc(), name, None)


def release_freed_memory() -> None:
    """Hands memory freed during model loading back to the OS (glibc's malloc_trim).
    Loading frees large temporaries (GGUF repacks, row-layout codes once tiled) that
    glibc keeps in its heap once its mmap threshold has grown: 0.4 GB of a 3 GB
    Q4_0 model. A no-op where glibc is absent."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # mallopt's parameters (malloc.h)
STEP_MMAP_THRESHOLD = 64 << 20
STEP_TRIM_THRESHOLD = 256 << 20


def hold_step_buffers() -> None:
    """Makes glibc keep the memory an engine step frees for the next step, after loading's
    release_freed_memory. A step allocates its activations afresh (torch tensors of 4-16 MB
    at 512 tokens); by default glibc maps the larger ones anew or hands its heap's free top
    back once past 2x its mmap threshold, and the kernel then zeroes every page again as the
    next step touches it: 10% of the scaled Qwen3-MoE Q4_0's pp512 in clear_page (perf,
    2-core Zen 3 guest). Here allocations up to 64 MB come from the heap, which keeps up to
    256 MB free: pp512 ~1.2x (Q4_0) and ~1.06x (Q8_0), three alternating pairs of processes
    each; decode unchanged (~50 MB more resident). What stays free is a step's freed memory,
    its top trimmed past 256 MB. A no-op without glibc."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD)
