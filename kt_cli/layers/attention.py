"""Paged causal attention over the engine's KVCache, and grouped-query attention.

Every layer writes its new tokens' K/V at batch.slot_mapping, then each sequence
attends over the cache slots of its whole context (seq_slots), causal within the
new tokens: new token j of a sequence with n new tokens and context length L sits
at position L - n + j and sees cache positions 0..L - n + j."""

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from .. import ops
from ..engine.forward_batch import ForwardBatch, KVCache, KVSpec
from .fused import FusedLinear
from .linear import Linear, int8_prefill_fits
from .norm import RMSNorm, stack_heads
from .rope import RopeTables, Rotary


@dataclass
class SeqView:
    rows: slice
    slots: torch.Tensor | slice   # [L] int64 cache slots of positions 0..L-1, or their range
    mask: torch.Tensor | None     # [n, L] bool, True = may attend; None = all (or causal)
    causal: bool = False          # n == L > 1: plain causal, no mask (torch's flash kernel skips the masked blocks)

    @cached_property
    def own_contexts(self) -> ops.Contexts:
        """The native kernel's contexts for the new rows over a context laid out on its own,
        rows 0..L-1 (as MLA's expanded keys and values are): built once a step, not once a layer"""
        length = self.slots.stop - self.slots.start if isinstance(self.slots, slice) else self.slots.numel()
        return ops.Contexts.causal([torch.arange(length)], [self.rows.stop - self.rows.start])


@dataclass
class AttentionContext:
    kv: KVCache
    slot_mapping: torch.Tensor  # [N] int64, on the cache's device
    seqs: list[SeqView]
    rope: RopeTables

    @classmethod
    def build(cls, batch: ForwardBatch, rotary: Rotary, dtype: torch.dtype) -> "AttentionContext":
        device = batch.kv.layers[0][0].device
        seqs = [_seq_view(batch, i, device) for i in range(batch.num_seqs)]
        end = max(batch.context_lens, default=0)       # each sequence's last position is its length - 1
        return cls(batch.kv, batch.slot_mapping.to(device), seqs, rotary.tables(batch.positions, dtype, end))

    @cached_property
    def rows(self) -> ops.Contexts | None:
        """The native attention kernel's contexts for every new row when the cache is on the
        CPU, else None; built on first use (MLA layers never ask)."""
        return _row_contexts(self.seqs, self.slot_mapping.device)

    @cached_property
    def decode(self) -> ops.Contexts | None:
        """rows when every sequence has one new token (a decode step), else None"""
        return self.rows if all(seq.rows.stop - seq.rows.start == 1 for seq in self.seqs) else None


def _row_contexts(seqs: list[SeqView], device: torch.device) -> ops.Contexts | None:
    """seqs' rows follow each other from row 0 (ForwardBatch.seq_rows)"""
    if device.type != "cpu" or not seqs:
        return None
    slots = [torch.arange(s.slots.start, s.slots.stop) if isinstance(s.slots, slice) else s.slots for s in seqs]
    return ops.Contexts.causal(slots, [s.rows.stop - s.rows.start for s in seqs])


def _seq_view(batch: ForwardBatch, i: int, device: torch.device) -> SeqView:
    rows = batch.seq_rows(i)
    n, length = rows.stop - rows.start, batch.context_lens[i]
    mask, causal = None, n > 1 and n == length
    if n > 1 and not causal:
        query_pos = torch.arange(length - n, length, device=device)
        mask = torch.arange(length, device=device)[None, :] <= query_pos[:, None]
    slots = batch.seq_slot_range(i)
    return SeqView(rows, batch.seq_slots(i).to(device) if slots is None else slots, mask, causal)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float, causal: bool = False) -> torch.Tensor:
    """q [n, H, D], k [L, Hkv, D], v [L, Hkv, Dv], H a multiple of Hkv -> [n, H, Dv]; causal
    (n == L, mask None): query i sees keys 0..i"""
    if q.shape[0] == 1 and q.dtype == torch.float32 and q.device.type == "cpu":
        return _attend_one_query(q, k, v, scale)
    # batched 4-D inputs: torch's CPU SDPA takes its flash kernel for them, but the
    # math fallback for 3-D ones (pp512, 32/4 heads of 128, 2 threads: 45 vs 112 ms).
    # is_causal lets the flash kernel skip the key blocks past each query block, which
    # a boolean mask only zeroes after computing them
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def attend_new_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqView, scale: float) -> torch.Tensor:
    """attend() for a sequence's new rows q [n, H, D] over its whole context k [L, Hkv, D],
    v [L, Hkv, Dv] (causal through seq.mask or seq.causal): on the native kernel when all
    three are contiguous float32 CPU tensors and n > 1 (row j reads the first L - n + 1 + j)"""
    native = (q.shape[0] > 1 and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32
              and k.is_contiguous() and v.is_contiguous())
    if not native:
        return attend(q, k, v, seq.mask, scale, seq.causal)
    return ops.paged_attention(q.contiguous(), k, v, seq.own_contexts, scale)


def _attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode: softmax(q k^T * scale) v as two batched matmuls, one batch per KV head
    with its group of query heads (head h reads KV head h // (H / Hkv)). torch's CPU
    SDPA took 110 us for 8 cached tokens and 15-28 ms for 512 (32/4 heads, dim 128);
    this takes 30 us and 0.3 ms, equal within float32 rounding."""
    num_kv = k.shape[1]
    grouped = (q[0] * scale).view(num_kv, -1, q.shape[-1])           # [Hkv, G, D]
    probs = torch.bmm(grouped, k.permute(1, 2, 0)).softmax(dim=-1)    # [Hkv, G, L]
    out = torch.bmm(probs, v.transpose(0, 1))                         # [Hkv, G, Dv]
    return out.view(1, q.shape[1], v.shape[-1])


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    cache.index_copy_(0, slots, values if values.dtype == cache.dtype else values.to(cache.dtype))


def read_cache(cache: torch.Tensor, slots: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
    """The cache rows at slots: a view for a range, a gathered copy otherwise."""
    rows = cache[slots] if isinstance(slots, slice) else cache.index_select(0, slots)
    return rows if rows.dtype == dtype else rows.to(dtype)


class GQAAttention(torch.nn.Module):
    """Queries and keys sit side by side in the fused projection's output, so the
    per-head norm (Qwen3) and rope run once over [N, H + Hkv, D]."""

    def __init__(self, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qkv: FusedLinear, o_proj: Linear, rotary: Rotary,
                 qk_norm: tuple[RMSNorm, RMSNorm] | None = None):
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads, self.head_dim = layer, num_heads, num_kv_heads, head_dim
        self.qkv, self.o_proj = qkv, o_proj
        self.rotary = rotary
        self.qk_norm = stack_heads([(qk_norm[0], num_heads), (qk_norm[1], num_kv_heads)]) if qk_norm else None
        self.scale = head_dim ** -0.5

    def int8_prefill(self) -> None:
        """q/k/v and o_proj take int8 activations in prefill where their weights allow
        (int8_prefill_fits), as they do in decode: asked by MoE layers, whose experts prefill on
        int8 activations already"""
        for linear in (*self.qkv.linears, self.o_proj):
            if int8_prefill_fits(linear):
                linear.prefill_acts = "int8"

    def kv_spec(self, dtype: torch.dtype) -> KVSpec:
        shape = (self.num_kv_heads, self.head_dim)
        return KVSpec((shape, shape), dtype)

    def forward(self, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """h [N, hidden] -> [N, hidden]"""
        n, heads, kv_heads, dim = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv.forward_joined(h)                                # [N, (H + 2 Hkv) D]
        qk = qkv[:, :(heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim)
        if self.qk_norm is not None:
            qk = self.qk_norm.forward(qk)
        qk = self.rotary.apply_(qk, ctx.rope)      # qk is this step's own buffer
        q, k = qk[:, :heads], qk[:, heads:]
        k_cache, v_cache = ctx.kv.layers[self.layer]
        write_cache(k_cache, ctx.slot_mapping, k)
        write_cache(v_cache, ctx.slot_mapping, v)
        return self.o_proj.forward(self._attend(q, k_cache, v_cache, ctx).reshape(n, heads * dim))

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """q [N, H, D] -> [N, H, D], each sequence over its own cached context"""
        if q.dtype == k_cache.dtype == torch.float32 and ctx.rows is not None:
            return ops.paged_attention(q.contiguous(), k_cache, v_cache, ctx.rows, self.scale)
        def one(seq: SeqView, q_seq: torch.Tensor) -> torch.Tensor:
            keys, values = read_cache(k_cache, seq.slots, q.dtype), read_cache(v_cache, seq.slots, q.dtype)
            return attend(q_seq, keys, values, seq.mask, self.scale, seq.causal)
        if len(ctx.seqs) == 1:
            return one(ctx.seqs[0], q)
        out = q.new_empty(q.shape)
        for seq in ctx.seqs:
            out[seq.rows] = one(seq, q[seq.rows])
        return out
