"""Dense linear layers on the native kernels: out [m, rows] = x [m, cols] @ W^T."""

import torch

from kt_weights.layout import QMatrix

from .ffi_args import check, check_status, kt_matrix, matrix_2d, pointer
from .pool import Pool


def linear(pool: Pool, x: torch.Tensor, w: QMatrix) -> torch.Tensor:
    ffi, lib = pool.kernels.ffi, pool.kernels.lib
    desc = kt_matrix(ffi, w)
    m, cols = matrix_2d(x, torch.float32, "x")
    check(cols == w.cols, f"x has {cols} columns, the weight expects {w.cols}")
    out = torch.empty(m, w.rows, dtype=torch.float32)
    rc = lib.kt_linear_f32(pool.handle, pointer(ffi, out, "float *"),
                           pointer(ffi, x, "const float *"), m, desc)
    check_status(rc, "kt_linear_f32")
    return out
