"""The kt_pool handle: persistent native worker threads every parallel kernel runs on.

AMX tiles: the amx variant's tile path (BF16/I8 weights, >= 16 tokens) has not yet
been verified on AMX hardware, so a pool uses it only when asked: amx_tiles=True,
or by default when the environment sets KT_AMX_TILES=1 and the variant is amx."""

import os

from ..kernels import Kernels
from .ffi_args import OpError, check, check_status

AMX_ENV = "KT_AMX_TILES"
AMX_VARIANT = "amx"


class Pool:
    """One kt_pool of `threads` threads (the caller counts as one), freed with this object.
    A pool belongs to the library (variant) that made it: pass it only to that library."""

    def __init__(self, kernels: Kernels, threads: int, amx_tiles: bool | None = None):
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

    def __repr__(self) -> str:
        return f"Pool(variant={self.kernels.variant!r}, threads={self.threads}, amx_tiles={self.amx_tiles})"


def amx_tiles_wanted(variant: str) -> bool:
    return os.environ.get(AMX_ENV) == "1" and variant == AMX_VARIANT
