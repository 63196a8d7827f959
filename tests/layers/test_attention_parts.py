"""The decode-path pieces of attention against plain references: the one-query
attention (two batched matmuls) against float64 softmax attention, rope's
x * cos + partner(x) * sin (from the cached tables or past them) against the textbook rotation, and the fused RMSNorm
against the textbook formula."""

import math

import pytest
import torch

from kt_cli.layers.attention import attend
from kt_cli.errors import ModelError
from kt_cli.layers.norm import NATIVE_MAX_ROWS, RMSNorm, stack_heads
from kt_cli.layers.rope import CACHED_POSITIONS, RopeSpec, Rotary


def reference_attention(q, k, v, scale):
    """q [1, H, D], k [L, Hkv, D], v [L, Hkv, Dv] in float64; head h reads KV head h // (H / Hkv)"""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q[0].double(), k) * scale
    return torch.einsum("hl,lhv->hv", scores.softmax(-1), v)[None]


@pytest.mark.parametrize("heads,kv_heads,dim,v_dim,length", [
    (8, 2, 16, 16, 1), (8, 2, 16, 16, 37), (4, 4, 32, 32, 9),    # GQA, one cached token, MHA
    (6, 1, 40, 32, 20),                                            # MLA absorbed: one shared head, Dv < D
    (32, 4, 128, 128, 512)])
def test_one_query_attention_matches_float64(heads, kv_heads, dim, v_dim, length):
    g = torch.Generator().manual_seed(heads * length)
    q, k = torch.randn(1, heads, dim, generator=g), torch.randn(length, kv_heads, dim, generator=g)
    v = torch.randn(length, kv_heads, v_dim, generator=g)
    scale = dim ** -0.5
    ref = reference_attention(q, k, v, scale)
    got = attend(q, k, v, None, scale)
    assert got.shape == (1, heads, v_dim) and got.dtype == torch.float32
    assert (got.double() - ref).abs().max().item() < 2e-6 * ref.abs().max().item()   # measured <= 4e-7


def reference_causal_attention(q, k, v, scale):
    """q [n, H, D], k [n, Hkv, D], v [n, Hkv, Dv] in float64: query i sees keys 0..i"""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    n = q.shape[0]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hnl,lhv->nhv", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads,n", [(8, 2, 5), (4, 4, 64), (8, 1, 700)])    # 700: two key blocks
def test_causal_prompt_attention_matches_float64_and_the_mask(heads, kv_heads, n):
    """A whole prompt (n == L) attends with is_causal instead of a boolean mask, which lets
    torch's flash kernel skip key blocks: the result must be the causal softmax, and the
    masked call's within float32 rounding"""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, h, 32, generator=g) for h in (heads, kv_heads, kv_heads))
    mask = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    got = attend(q, k, v, None, 0.2, causal=True)
    ref = reference_causal_attention(q, k, v, 0.2)
    assert got.shape == (n, heads, 32)
    assert (got.double() - ref).abs().max().item() < 2e-6 * ref.abs().max().item()
    torch.testing.assert_close(got, attend(q, k, v, mask, 0.2), rtol=1e-6, atol=1e-6)


def textbook_rope(x, cos, sin, interleaved):
    """cos, sin [N, dim/2]: pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)"""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if interleaved:
        first, second = x[..., 0::2], x[..., 1::2]
        return torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [[0, 3, 77, 200], [5000, 2, CACHED_POSITIONS - 1],
                                       [7, CACHED_POSITIONS, 40000]])    # cached tables, grown, past the cache
def test_rope_is_the_textbook_rotation_bit_for_bit(interleaved, dtype, positions):
    spec = RopeSpec(dim=16, kind="yarn", factor=4.0, original_max_positions=64, interleaved=interleaved)
    rotary = Rotary(spec, torch.device("cpu"))
    rotary.tables(torch.tensor([1]), dtype)                   # the smallest cache first, so the second call grows it
    positions = torch.tensor(positions)
    x = torch.randn(len(positions), 5, 24)[..., 4:20].to(dtype)    # a strided view, like q from a fused projection
    cos, sin = rotary.cos_sin(positions)
    got = rotary.apply(x, rotary.tables(positions, dtype))
    assert got.dtype == dtype
    assert torch.equal(got, textbook_rope(x, cos, sin, interleaved))


@pytest.mark.parametrize("end", [78, 300, CACHED_POSITIONS + 5])
def test_rope_tables_sized_by_the_caller_rotate_as_the_textbook(end):
    """AttentionContext passes end = the batch's longest context; any end past the largest
    position must still give the textbook rotation at each position"""
    rotary = Rotary(RopeSpec(dim=16, theta=1e4), torch.device("cpu"))
    positions = torch.tensor([77, 3, 40])
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(end))
    cos, sin = rotary.cos_sin(positions)
    got = rotary.apply(x, rotary.tables(positions, torch.float32, end))
    assert torch.equal(got, textbook_rope(x, cos, sin, False))


def test_rope_rotates_by_position_times_frequency():
    rotary = Rotary(RopeSpec(dim=4, theta=100.0), torch.device("cpu"))
    x = torch.tensor([[[1.0, 0.0, 0.0, 1.0]]])
    got = rotary.apply(x, rotary.tables(torch.tensor([3]), torch.float32))[0, 0]
    a0, a1 = 3.0, 3.0 / 10.0              # angles: position * theta^(-2i/dim), i = 0, 1
    want = torch.tensor([math.cos(a0), -math.sin(a1), math.sin(a0), math.cos(a1)])
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 576), (7, 2048), (3, 4, 128), (65, 256)])
def test_rms_norm_matches_the_formula(shape):
    """Both paths, native (up to NATIVE_MAX_ROWS rows) and torch ops (65 rows), against
    the formula in float64; the torch path is also bit-equal to transformers' form."""
    g = torch.Generator().manual_seed(shape[-1])
    x, w = 3 * torch.randn(shape, generator=g), torch.randn(shape[-1], generator=g)
    x64 = x.double()
    want = w.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = RMSNorm(w, 1e-6)(x)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)
    if x.numel() > NATIVE_MAX_ROWS * shape[-1]:
        assert torch.equal(got, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_head_norms_equal_the_separate_norms(dtype):
    g = torch.Generator().manual_seed(3)
    q_norm = RMSNorm(torch.randn(24, generator=g).to(dtype), 1e-6)
    k_norm = RMSNorm(torch.randn(24, generator=g).to(dtype), 1e-6)
    qk = torch.randn(5, 6 + 2, 24, generator=g).to(dtype)
    got = stack_heads([(q_norm, 6), (k_norm, 2)])(qk)
    assert torch.equal(got[:, :6], q_norm(qk[:, :6])) and torch.equal(got[:, 6:], k_norm(qk[:, 6:]))


def test_stacked_norms_need_one_eps():
    with pytest.raises(ModelError, match="same eps"):
        stack_heads([(RMSNorm(torch.ones(4), 1e-6), 2), (RMSNorm(torch.ones(4), 1e-5), 1)])
