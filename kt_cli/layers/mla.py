"""Multi-head latent attention (DeepSeek V2/V3).

Per token the cache holds one row [c (kv_lora_rank) | k_pe (rope_dim)], where c is
the normalised compressed KV and k_pe the rotated shared rope key. kv_b_proj maps
c to per-head keys and values: k_nope[h] = W_UK[h] c, v[h] = W_UV[h] c, with
W_UK[h] [nope, r] and W_UV[h] [v_dim, r].

Two equivalent ways to attend:
  expanded: build k_nope and v for every cached token, then ordinary attention;
  absorbed: q_lat[h] = W_UK[h]^T q_nope[h], attend with [q_lat | q_pe] over the
            cache rows directly (one shared KV head), out[h] = W_UV[h] out_lat[h].
The absorbed form costs n*L*H*(2r - nope - v) more for scores and values, the
expanded form L*H*r*(nope + v) more for the expansion, so absorbed wins when
n * (2r - nope - v) < r * (nope + v): decode steps and short chunks."""

from dataclasses import dataclass

import torch

from ..engine.forward_batch import KVSpec
from .attention import AttentionContext, SeqView, attend, attend_new_rows, read_cache, write_cache
from .fused import FusedLinear
from .linear import Linear
from .norm import RMSNorm
from .rope import Rotary


@dataclass(frozen=True)
class MLADims:
    num_heads: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int

    def absorbed_is_cheaper(self, n_new: int) -> bool:
        per_query = max(2 * self.kv_lora_rank - self.nope_dim - self.v_dim, 1)
        return n_new * per_query < self.kv_lora_rank * (self.nope_dim + self.v_dim)


@dataclass
class MLAWeights:
    q_kv_a: FusedLinear             # hidden -> (q_proj or q_a_proj rows, kv_a_proj's r + rope_dim rows)
    q_a_norm: RMSNorm | None        # with q_lora_rank
    q_b_proj: Linear | None         # with q_lora_rank
    kv_a_norm: RMSNorm
    kv_b: torch.Tensor              # [H * (nope + v), r] in the compute dtype
    o_proj: Linear


class MLAttention(torch.nn.Module):
    def __init__(self, layer: int, dims: MLADims, w: MLAWeights, rotary: Rotary, scale: float):
        super().__init__()
        self.layer, self.dims, self.rotary, self.scale = layer, dims, rotary, scale
        self.q_kv_a, self.q_a_norm, self.q_b_proj = w.q_kv_a, w.q_a_norm, w.q_b_proj
        self.kv_a_norm, self.o_proj = w.kv_a_norm, w.o_proj
        kv_b = w.kv_b.view(dims.num_heads, dims.nope_dim + dims.v_dim, dims.kv_lora_rank)
        self.w_uk = kv_b[:, :dims.nope_dim].contiguous()     # [H, nope, r]
        self.w_uv = kv_b[:, dims.nope_dim:].contiguous()     # [H, v, r]

    def kv_spec(self, dtype: torch.dtype) -> KVSpec:
        return KVSpec(((self.dims.kv_lora_rank + self.dims.rope_dim,),), dtype)

    def forward(self, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """h [N, hidden] -> [N, hidden]"""
        d = self.dims
        q_in, latent = self.q_kv_a.forward(h)
        q_nope, q_pe = self._queries(q_in, ctx)
        c = self.kv_a_norm.forward(latent[:, :d.kv_lora_rank])
        k_pe = self.rotary.apply(latent[:, None, d.kv_lora_rank:], ctx.rope)[:, 0]
        cache = ctx.kv.layers[self.layer][0]
        write_cache(cache, ctx.slot_mapping, torch.cat((c, k_pe), dim=-1))
        out = h.new_empty(h.shape[0], d.num_heads, d.v_dim)
        for seq in ctx.seqs:
            rows = read_cache(cache, seq.slots, h.dtype)
            attend_seq = self._absorbed if d.absorbed_is_cheaper(seq.rows.stop - seq.rows.start) else self._expanded
            out[seq.rows] = attend_seq(q_nope[seq.rows], q_pe[seq.rows], rows, seq)
        return self.o_proj.forward(out.reshape(h.shape[0], d.num_heads * d.v_dim))

    def _queries(self, q_in: torch.Tensor, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """q_proj(h), or q_a_proj(h) with q_lora_rank -> q_nope [N, H, nope], rotated q_pe [N, H, rope]"""
        d = self.dims
        q = q_in if self.q_b_proj is None else self.q_b_proj.forward(self.q_a_norm.forward(q_in))
        q = q.view(q_in.shape[0], d.num_heads, d.nope_dim + d.rope_dim)
        return q[..., :d.nope_dim], self.rotary.apply(q[..., d.nope_dim:], ctx.rope)

    def _absorbed(self, q_nope, q_pe, rows, seq: SeqView) -> torch.Tensor:
        """rows [L, r + rope] cache rows -> [n, H, v]"""
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, self.w_uk)
        q = torch.cat((q_lat, q_pe), dim=-1)
        out_lat = attend(q, rows[:, None, :], rows[:, None, :self.dims.kv_lora_rank], seq.mask, self.scale,
                         seq.causal)
        return torch.einsum("nhr,hvr->nhv", out_lat, self.w_uv)

    def _expanded(self, q_nope, q_pe, rows, seq: SeqView) -> torch.Tensor:
        d = self.dims
        c, k_pe = rows[:, :d.kv_lora_rank], rows[:, d.kv_lora_rank:]
        k_nope = torch.einsum("lr,hdr->lhd", c, self.w_uk)
        v = torch.einsum("lr,hvr->lhv", c, self.w_uv)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, d.num_heads, -1)), dim=-1)
        return attend_new_rows(torch.cat((q_nope, q_pe), dim=-1), k, v, seq, self.scale)
