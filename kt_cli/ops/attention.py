"""Attention over the paged cache on the native kernel (kt.h kt_attention_decode_f32):
every query row of a step, decode or prefill, attends over its paged context in one C
call, in place of a gather, two batched matmuls and a softmax per sequence (decode), or
a gather and torch's SDPA per sequence (prefill)."""

from dataclasses import dataclass

import torch

from .ffi_args import OpError, check, check_status
from .pool import Pool


@dataclass(frozen=True)
class Contexts:
    """Which cache rows each query row attends to: row i reads slots[offset[i]:offset[i] + length[i]].
    Built once per step and shared by every layer, so its tensors are checked here, once (the
    slot values and ranges are checked in C, against the cache, on every call)."""
    slots: torch.Tensor    # [S] int64
    offset: torch.Tensor   # [n] int64
    length: torch.Tensor   # [n] int64

    def __post_init__(self) -> None:
        for t, what in ((self.slots, "context slots"), (self.offset, "context offsets"),
                        (self.length, "context lengths")):
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.dim() == 1
                    and t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0):
                raise OpError(f"attention {what} must be a non-empty contiguous 1-D int64 cpu tensor")
        check(self.offset.numel() == self.length.numel(),
              f"{self.offset.numel()} context offsets for {self.length.numel()} lengths")

    @classmethod
    def causal(cls, slots: list[torch.Tensor], new: list[int]) -> "Contexts":
        """Sequence s owns the next new[s] query rows (rows follow sequence order), its last
        positions, over its cache slots slots[s] (positions 0..L-1): its new row j of k reads
        the first L - k + 1 + j slots."""
        check(len(new) == len(slots), f"{len(new)} row counts for {len(slots)} sequences")
        totals = [int(t.numel()) for t in slots]
        for k, total in zip(new, totals):
            if not 0 < k <= total:
                raise OpError(f"a sequence with {k} new rows in a context of {total}")
        offset, length, start = [], [], 0
        for k, total in zip(new, totals):
            offset += [start] * k
            length += range(total - k + 1, total + 1)
            start += total
        return cls(torch.cat(slots).to(torch.int64).contiguous(), torch.tensor(offset, dtype=torch.int64),
                   torch.tensor(length, dtype=torch.int64))

    @classmethod
    def of(cls, per_row: list[torch.Tensor]) -> "Contexts":
        lengths = [int(s.numel()) for s in per_row]
        offsets = [0]
        for n in lengths[:-1]:
            offsets.append(offsets[-1] + n)
        return cls(torch.cat(per_row).to(torch.int64).contiguous(), torch.tensor(offsets, dtype=torch.int64),
                   torch.tensor(lengths, dtype=torch.int64))


def paged_attention(pool: Pool, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     contexts: Contexts, scale: float) -> torch.Tensor:
    """q [n, H, D], k_cache [R, Hkv, D], v_cache [R, Hkv, Dv], all float32 -> [n, H, Dv]"""
    _check(q, k_cache, v_cache, contexts, scale)
    n, heads, _ = q.shape
    rows, kv_heads, dim = k_cache.shape
    v_dim = v_cache.shape[2]
    out = q.new_empty((n, heads, v_dim))
    ffi, lib = pool.kernels.ffi, pool.kernels.lib
    rc = lib.kt_attention_decode_f32(
        pool.handle, ffi.cast("float *", out.data_ptr()), ffi.cast("const float *", q.data_ptr()), n, heads,
        ffi.cast("const float *", k_cache.data_ptr()), ffi.cast("const float *", v_cache.data_ptr()), rows,
        kv_heads, dim, v_dim, ffi.cast("const int64_t *", contexts.slots.data_ptr()), contexts.slots.numel(),
        ffi.cast("const int64_t *", contexts.offset.data_ptr()),
        ffi.cast("const int64_t *", contexts.length.data_ptr()),
        scale)
    check_status(rc, "kt_attention_decode_f32")
    return out


def _check(q, k_cache, v_cache, contexts: Contexts, scale) -> None:
    """Messages are formatted only on failure (if, not check()): this runs for every layer of
    a decode step."""
    for t, what in ((q, "query"), (k_cache, "key cache"), (v_cache, "value cache")):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 3
                and t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0):
            raise OpError(f"attention {what} must be a non-empty contiguous 3-D float32 cpu tensor")
    n, heads, dim = q.shape
    rows, kv_heads, k_dim = k_cache.shape
    if not (k_dim == dim and v_cache.shape[:2] == k_cache.shape[:2] and heads % kv_heads == 0):
        raise OpError(f"attention shapes do not fit: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, "
                      f"v {tuple(v_cache.shape)}")
    if not (isinstance(contexts, Contexts) and contexts.offset.numel() == n):
        raise OpError(f"attention has {n} query rows but contexts for {getattr(contexts, 'offset', q).numel()}")
    if not isinstance(scale, float):
        raise OpError(f"attention scale must be a float, got {scale!r}")
