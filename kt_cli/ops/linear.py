"""Dense linear layers on the native kernels: out [m, rows] = x [m, cols] @ W^T."""

import torch

from kt_weights.layout import QMatrix, can_tile, tile_rows

from .ffi_args import check, check_status, kt_matrix, matrix_2d, pointer
from .pool import Pool


def linear(pool: Pool, x: torch.Tensor, w: QMatrix, exact: bool = False) -> torch.Tensor:
    """exact=False: I8/I4 weights meet int8 activations (one scale per 32 values);
    exact=True: float32 activations for every format (kt.h, kt_linear)."""
    ffi, lib = pool.kernels.ffi, pool.kernels.lib
    desc = kt_matrix(ffi, w)
    m, cols = matrix_2d(x, torch.float32, "x")
    check(cols == w.cols, f"x has {cols} columns, the weight expects {w.cols}")
    out = torch.empty(m, w.rows, dtype=torch.float32)
    rc = lib.kt_linear(pool.handle, pointer(ffi, out, "float *"), pointer(ffi, x, "const float *"), m, desc,
                       lib.KT_ACTS_F32 if exact else lib.KT_ACTS_INT8)
    check_status(rc, "kt_linear")
    return out


def kernel_layout(w: QMatrix) -> QMatrix:
    """w as the CPU kernels stream it fastest: I8/I4 tiled (kt.h KT_LAYOUT_TILES)
    where the shape allows (a copy of the codes), else w itself. Decode of one I4
    2048 x 2048 matrix from DRAM on a 2-core Zen 3 guest: 1.6x faster tiled."""
    return tile_rows(w) if not w.tiled and can_tile(w) else w
