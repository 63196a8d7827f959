"""The kt_pool handle: persistent native worker threads every parallel kernel runs on.

AMX tiles: pools of the amx variant run BF16 weights (and I8 ones the ROW8 layout cannot
hold) on the AMX tile path from 4 (BF16) or 16 (I8) tokens on, and ROW8 INT4 and I8 ones
through bf16 copies of their rows from 24 and 64 tokens, unless amx_tiles=False or the
environment sets KT_AMX_TILES=0. Verified on Sapphire Rapids-class guests, where it ran one
Qwen3-30B-A3B MoE layer's BF16 prefill (T=512) in 66 ms against 207 ms on AVX512-BF16, and
its Q4_0 prefill (T=2048) 1.83x faster than the AVX512-VNNI kernels.

NUMA (ops/numa.py): on hosts with several nodes, or under KT_NUMA=interleave, a new
pool pins its workers round-robin over the nodes' CPUs; a refusal only warns."""

import os
from collections.abc import Sequence
from contextlib import contextmanager

from ..kernels import Kernels
from . import numa as _numa
from .ffi_args import OpError, check, check_status
from .numa import NumaPlan

AMX_ENV = "KT_AMX_TILES"
AMX_VARIANT = "amx"


class Pool:
    """One kt_pool of `threads` threads (the caller counts as one), freed with this object.
    A pool belongs to the library (variant) that made it: pass it only to that library."""

    def __init__(self, kernels: Kernels, threads: int, amx_tiles: bool | None = None,
                 numa: NumaPlan | None = None):
        check(isinstance(threads, int) and 1 <= threads <= 4096,
              f"thread count must be an integer in 1..4096, got {threads!r}")
        raw = kernels.lib.kt_pool_new(threads)
        if raw == kernels.ffi.NULL:
            raise OpError(f"could not start a pool of {threads} threads")
        self.kernels = kernels
        self.threads = threads
        self.handle = kernels.ffi.gc(raw, kernels.lib.kt_pool_free)
        self.amx_tiles = amx_tiles_wanted(kernels.variant) if amx_tiles is None else bool(amx_tiles)
        if self.amx_tiles:
            check(kernels.variant == AMX_VARIANT,
                  f"AMX tiles need the {AMX_VARIANT} kernel variant, this pool runs {kernels.variant}")
            check_status(kernels.lib.kt_pool_set_amx_tiles(self.handle, 1), "kt_pool_set_amx_tiles")
        self.numa = numa if numa is not None else _numa.current_plan()
        if self.numa.active:
            self._spread_workers()

    def pin_workers(self, cpus: Sequence[int]) -> None:
        """Pins the worker threads, not the caller's: worker w to cpus[w % len(cpus)]."""
        cpus = list(cpus)
        check(len(cpus) > 0 and all(type(c) is int and 0 <= c < 1024 for c in cpus),
              f"worker CPUs must be a non-empty list of integers in 0..1023, got {cpus!r}")
        ffi, lib = self.kernels.ffi, self.kernels.lib
        check_status(lib.kt_pool_pin_workers(self.handle, ffi.new("int32_t[]", cpus), len(cpus)),
                     "kt_pool_pin_workers")

    def _spread_workers(self) -> None:
        try:
            self.pin_workers(self.numa.worker_cpus)
        except OpError as exc:
            _numa.warn_once("pin", f"could not pin kt's workers to the NUMA nodes' CPUs ({exc}); they run unpinned")

    def set_spin(self, rounds: int) -> None:
        """Pause rounds an idle worker polls before sleeping (kt.h kt_pool_set_spin; -1 the default)."""
        check(isinstance(rounds, int) and -1 <= rounds <= 1 << 24, f"spin rounds must be in -1..2^24, got {rounds!r}")
        check_status(self.kernels.lib.kt_pool_set_spin(self.handle, rounds), "kt_pool_set_spin")

    @contextmanager
    def sleeping_workers(self):
        """Idle workers sleep at once inside the block: for steps where torch's own
        threads run between kt's kernels and need the cores."""
        self.set_spin(0)
        try:
            yield
        finally:
            self.set_spin(-1)

    def __repr__(self) -> str:
        return f"Pool(variant={self.kernels.variant!r}, threads={self.threads}, amx_tiles={self.amx_tiles})"


def amx_tiles_wanted(variant: str) -> bool:
    return variant == AMX_VARIANT and os.environ.get(AMX_ENV) != "0"
