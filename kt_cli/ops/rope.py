"""Rotary embedding on the native kernel (kt.h kt_rope_f32), in place: one C call in
place of torch's roll, two products and a sum over new tensors."""

import torch

from .ffi_args import OpError, check_status
from .pool import Pool

MAX_DIM = 1024


def rope_(pool: Pool, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [n, heads, dim] f32 (each row's heads contiguous; rows may be strided, e.g. a view
    of a fused projection's output) rotated in place by cos, sin [n, 1, dim] f32; returns x."""
    _check(x, cos, sin)
    n, heads, dim = x.shape
    ffi, lib = pool.kernels.ffi, pool.kernels.lib
    rc = lib.kt_rope_f32(pool.handle, ffi.cast("float *", x.data_ptr()), n, x.stride(0), heads, dim,
                         ffi.cast("const float *", cos.data_ptr()), ffi.cast("const float *", sin.data_ptr()),
                         int(interleaved))
    check_status(rc, "kt_rope_f32")
    return x


def supports(x: torch.Tensor) -> bool:
    """Whether rope_ takes x as it is laid out (one stride() and shape read: this runs for
    every layer of a step)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 3:
        return False
    (n, heads, dim), (row_stride, head_stride, step) = x.shape, x.stride()
    return (n > 0 and heads > 0 and step == 1 and head_stride == dim and row_stride >= heads * dim
            and supports_dim(dim))


def supports_dim(dim: int) -> bool:
    return dim % 2 == 0 and 2 <= dim <= MAX_DIM


def _check(x, cos, sin) -> None:
    """Messages are formatted only on failure."""
    if not (isinstance(x, torch.Tensor) and supports(x)):
        raise OpError("rope input must be a non-empty float32 cpu tensor [n, heads, dim] with contiguous heads "
                      f"and an even dim <= {MAX_DIM}")
    n, _, dim = x.shape
    for t, what in ((cos, "cos"), (sin, "sin")):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (n, 1, dim)
                and t.is_contiguous() and t.device.type == "cpu"):
            raise OpError(f"rope {what} table must be a contiguous float32 cpu tensor [{n}, 1, {dim}]")
