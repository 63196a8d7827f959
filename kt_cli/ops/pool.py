"""The kt_pool handle: persistent native worker threads every parallel kernel runs on."""

from ..kernels import Kernels
from .ffi_args import check, OpError


class Pool:
    """One kt_pool of `threads` threads (the caller counts as one), freed with this object.
    A pool belongs to the library (variant) that made it: pass it only to that library."""

    def __init__(self, kernels: Kernels, threads: int):
        check(isinstance(threads, int) and 1 <= threads <= 4096,
              f"thread count must be an integer in 1..4096, got {threads!r}")
        raw = kernels.lib.kt_pool_new(threads)
        if raw == kernels.ffi.NULL:
            raise OpError(f"could not start a pool of {threads} threads")
        self.kernels = kernels
        self.threads = threads
        self.handle = kernels.ffi.gc(raw, kernels.lib.kt_pool_free)

    def __repr__(self) -> str:
        return f"Pool(variant={self.kernels.variant!r}, threads={self.threads})"
