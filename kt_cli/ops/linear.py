"""Dense linear layers on the native kernels: out [m, rows] = x [m, cols] @ W^T."""

import torch

from kt_weights.layout import QMatrix, can_tile

from .ffi_args import check, check_status, kt_matrix, matrix_2d, pointer
from .pool import Pool


ACTS = ("int8", "int16", "f32")


def linear(pool: Pool, x: torch.Tensor, w: QMatrix, acts: str = "int8") -> torch.Tensor:
    """The activations I8/I4 weights meet (kt.h, kt_linear): "int8" one scale per
    32 values; "int16" the same in int16 (each value within max|x| / 65534 of its
    block); "f32" float32. Float formats always take float32."""
    check(acts in ACTS, f"acts must be one of {ACTS}, not {acts!r}")
    ffi, lib = pool.kernels.ffi, pool.kernels.lib
    desc = kt_matrix(ffi, w)
    m, cols = matrix_2d(x, torch.float32, "x")
    check(cols == w.cols, f"x has {cols} columns, the weight expects {w.cols}")
    out = torch.empty(m, w.rows, dtype=torch.float32)
    kind = {"int8": lib.KT_ACTS_INT8, "int16": lib.KT_ACTS_INT16, "f32": lib.KT_ACTS_F32}[acts]
    rc = lib.kt_linear(pool.handle, pointer(ffi, out, "float *"), pointer(ffi, x, "const float *"), m, desc, kind)
    check_status(rc, "kt_linear")
    return out


def kernel_layout(w: QMatrix, pool: Pool | None = None) -> QMatrix:
    """w as the CPU kernels stream it fastest: I8/I4 tiled (kt.h KT_LAYOUT_TILES)
    where the shape allows (a copy of the codes, made by the native kt_tile_codes
    on the pool's threads), else w itself. Decode of one I4 2048 x 2048 matrix
    from DRAM on a 2-core Zen 3 guest: 1.6x faster tiled."""
    if w.tiled or not can_tile(w):
        return w
    pool = pool if pool is not None else _default_pool()
    ffi, lib = pool.kernels.ffi, pool.kernels.lib
    rows, row_bytes = w.data.shape
    check(w.data.is_contiguous() and w.data.device.type == "cpu", "weight codes must be contiguous on the cpu")
    data = torch.empty_like(w.data)
    rc = lib.kt_tile_codes(pool.handle, pointer(ffi, data, "void *"), pointer(ffi, w.data, "const void *"),
                           rows, row_bytes)
    check_status(rc, "kt_tile_codes")
    return QMatrix(w.format, w.rows, w.cols, data, w.group, w.scale, w.min, tiled=True)


def _default_pool() -> Pool:
    from . import default
    return default().pool
