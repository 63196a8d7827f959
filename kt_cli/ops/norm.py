"""RMSNorm on the native kernel (kt.h kt_rmsnorm_f32): one C call in place of
torch's seven small ops, for the norms decode runs every layer."""

import torch

from ..kernels import Kernels
from .ffi_args import OpError, check_status


def rms_norm(kernels: Kernels, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] f32 -> x / sqrt(mean(x^2) + eps) * w, with w [D], or [H, D] for
    per-head norms over x [..., H, D]."""
    _check(x, w, eps)
    out = torch.empty_like(x)
    cols, w_rows = x.shape[-1], (1 if w.dim() == 1 else w.shape[0])
    ffi = kernels.ffi
    rc = kernels.lib.kt_rmsnorm_f32(ffi.cast("float *", out.data_ptr()), ffi.cast("const float *", x.data_ptr()),
                                    ffi.cast("const float *", w.data_ptr()), x.numel() // cols, cols, w_rows, eps)
    check_status(rc, "kt_rmsnorm_f32")
    return out


def _check(x, w, eps) -> None:
    """Messages are formatted only on failure: this runs for every norm of a decode step."""
    for t, what in ((x, "x"), (w, "norm weight")):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
                and t.is_contiguous() and t.numel() > 0):
            raise OpError(f"RMSNorm {what} must be a non-empty contiguous float32 cpu tensor")
    if not (isinstance(eps, float) and eps >= 0.0):
        raise OpError(f"RMSNorm eps must be a float >= 0, got {eps!r}")
    if w.dim() == 1 and x.shape[-1] == w.shape[0]:
        return
    if w.dim() == 2 and x.dim() >= 2 and tuple(x.shape[-2:]) == tuple(w.shape):
        return
    raise OpError(f"RMSNorm weight {tuple(w.shape)} does not fit x {tuple(x.shape)}")
