"""Picked rows of a weight matrix as float32 on the native side (kt.h
kt_dequantize_rows_f32): a token-embedding lookup in one C call. QMatrix.dequantize_rows
builds the same rows from about ten torch ops, which a decode step ran on a cold cache
(each step streams the weights through L3): ~0.2 ms a step on the scaled Qwen3-MoE."""

import torch

from kt_weights.layout import QMatrix

from ..kernels import Kernels
from .ffi_args import OpError, check_status, kt_matrix


class RowLookup:
    """w's rows by id, w's descriptor built once; w must be in the row layout (or tiled)."""

    def __init__(self, kernels: Kernels, w: QMatrix):
        if w.row8:
            raise OpError("a row lookup takes a matrix in the row or tiled layout, not row8")
        self.w, self.ffi, self.lib = w, kernels.ffi, kernels.lib
        self.desc = kt_matrix(self.ffi, w)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] int64 on the cpu -> [n, cols] float32; each id is checked in C"""
        if not (isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 1
                and ids.device.type == "cpu"):
            raise OpError("row ids must be a 1-D int64 cpu tensor")
        ids = ids.contiguous()
        out = torch.empty(ids.numel(), self.w.cols, dtype=torch.float32)
        if ids.numel() == 0:
            return out
        rc = self.lib.kt_dequantize_rows_f32(self.ffi.cast("float *", out.data_ptr()), self.desc,
                                             self.ffi.cast("const int64_t *", ids.data_ptr()), ids.numel())
        if rc == self.lib.KT_EINVAL:     # the descriptor was checked when built: an id is out of range
            raise OpError(f"row ids must lie in 0..{self.w.rows - 1}")
        check_status(rc, "kt_dequantize_rows_f32")
        return out
