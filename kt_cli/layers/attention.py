"""Paged causal attention over the engine's KVCache, and grouped-query attention.

Every layer writes its new tokens' K/V at batch.slot_mapping, then each sequence
attends over the cache slots of its whole context (seq_slots), causal within the
new tokens: new token j of a sequence with n new tokens and context length L sits
at position L - n + j and sees cache positions 0..L - n + j."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..engine.forward_batch import ForwardBatch, KVCache, KVSpec
from .linear import Linear
from .norm import RMSNorm
from .rope import Rotary


@dataclass
class SeqView:
    rows: slice
    slots: torch.Tensor         # [L] int64 cache slots of positions 0..L-1
    mask: torch.Tensor | None   # [n, L] bool, True = may attend; None = all


@dataclass
class AttentionContext:
    kv: KVCache
    slot_mapping: torch.Tensor  # [N] int64, on the cache's device
    seqs: list[SeqView]
    cos: torch.Tensor           # [N, rope_dim/2]
    sin: torch.Tensor

    @classmethod
    def build(cls, batch: ForwardBatch, rotary: Rotary) -> "AttentionContext":
        device = batch.kv.layers[0][0].device
        seqs = [_seq_view(batch, i, device) for i in range(batch.num_seqs)]
        cos, sin = rotary.cos_sin(batch.positions)
        return cls(batch.kv, batch.slot_mapping.to(device), seqs, cos, sin)


def _seq_view(batch: ForwardBatch, i: int, device: torch.device) -> SeqView:
    rows = batch.seq_rows(i)
    n, length = rows.stop - rows.start, batch.context_lens[i]
    mask = None
    if n > 1:
        query_pos = torch.arange(length - n, length, device=device)
        mask = torch.arange(length, device=device)[None, :] <= query_pos[:, None]
    return SeqView(rows, batch.seq_slots(i).to(device), mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """q [n, H, D], k [L, Hkv, D], v [L, Hkv, Dv], H a multiple of Hkv -> [n, H, Dv]"""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    cache.index_copy_(0, slots, values.to(cache.dtype))


class GQAAttention(torch.nn.Module):
    def __init__(self, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 proj: dict[str, Linear], rotary: Rotary,
                 qk_norm: tuple[RMSNorm, RMSNorm] | None = None):
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads, self.head_dim = layer, num_heads, num_kv_heads, head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (proj[k] for k in ("q", "k", "v", "o"))
        self.rotary = rotary
        self.q_norm, self.k_norm = qk_norm if qk_norm else (None, None)
        self.scale = head_dim ** -0.5

    def kv_spec(self, dtype: torch.dtype) -> KVSpec:
        shape = (self.num_kv_heads, self.head_dim)
        return KVSpec((shape, shape), dtype)

    def forward(self, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """h [N, hidden] -> [N, hidden]"""
        n = h.shape[0]
        q = self.q_proj(h).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.apply(q, ctx.cos, ctx.sin), self.rotary.apply(k, ctx.cos, ctx.sin)
        k_cache, v_cache = ctx.kv.layers[self.layer]
        write_cache(k_cache, ctx.slot_mapping, k)
        write_cache(v_cache, ctx.slot_mapping, v)
        out = q.new_empty(n, self.num_heads, self.head_dim)
        for seq in ctx.seqs:
            keys, values = k_cache[seq.slots].to(q.dtype), v_cache[seq.slots].to(q.dtype)
            out[seq.rows] = attend(q[seq.rows], keys, values, seq.mask, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
