"""Softmax top-k routing on the native kernel (kt.h kt_route_softmax_topk): one C call
in place of torch's softmax, top-k, renormalisation and expert counting, which cost
~200 us per MoE layer and decode step once the streamed weights have evicted
torch's and Python's data from the caches."""

import torch

from ..kernels import Kernels
from .ffi_args import OpError, check_status, pointer

MAX_K = 64      # kt.h KT_ROUTE_MAX_K


def softmax_topk(kernels: Kernels, logits: torch.Tensor, k: int, normalize: bool,
                 counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] f32 -> (weights [T, k] f32, ids [T, k] int32), ids by descending
    probability; counts [E] int64, when given, gains the times each expert was chosen."""
    _check(logits, k, counts)
    tokens, experts = logits.shape
    weights = torch.empty(tokens, k, dtype=torch.float32)
    ids = torch.empty(tokens, k, dtype=torch.int32)
    ffi = kernels.ffi
    rc = kernels.lib.kt_route_softmax_topk(
        pointer(ffi, logits, "const float *"), tokens, experts, k, int(normalize), pointer(ffi, ids, "int32_t *"),
        pointer(ffi, weights, "float *"), pointer(ffi, counts, "int64_t *") if counts is not None else ffi.NULL)
    check_status(rc, "kt_route_softmax_topk")
    return weights, ids


def _check(logits, k, counts) -> None:
    """Messages are formatted only on failure: this runs for every MoE layer of a decode step."""
    if not (isinstance(logits, torch.Tensor) and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.device.type == "cpu" and logits.is_contiguous() and logits.numel() > 0):
        raise OpError("router logits must be a non-empty contiguous float32 cpu [T, E] tensor")
    if not (isinstance(k, int) and 1 <= k <= min(logits.shape[1], MAX_K)):
        raise OpError(f"top-k must be 1..{min(logits.shape[1], MAX_K)}, got {k!r}")
    if counts is not None and not (isinstance(counts, torch.Tensor) and counts.dtype == torch.int64
                                   and counts.device.type == "cpu" and counts.is_contiguous()
                                   and tuple(counts.shape) == (logits.shape[1],)):
        raise OpError(f"expert counts must be a contiguous int64 cpu tensor of {logits.shape[1]}")

