"""kt_rope_f32 (ops.rope_) on each variant: in place, against the rotation written
out from its definition with explicit pair indices (x1 cos - x2 sin, x2 cos + x1 sin),
in float32 with the same roundings (so bit for bit) and within float32 rounding of
float64; halves and interleaved pairs; rows strided inside a wider buffer (a view of
a fused projection), whose other columns must stay untouched."""

import pytest
import torch

from kt_cli.errors import KtError


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tables(n, dim, seed):
    angles = _randn(n, dim // 2, seed=seed) * 3
    return angles.cos(), angles.sin()


def _reference(x, cos_half, sin_half, interleaved, dtype):
    """x [n, H, dim]; cos/sin [n, dim/2] per pair p: (a, b) -> (a cos - b sin, b cos + a sin)"""
    x = x.to(dtype)
    c, s = cos_half.to(dtype)[:, None, :], sin_half.to(dtype)[:, None, :]
    half = x.shape[-1] // 2
    first, second = ((x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:]))
    out = torch.empty_like(x)
    a, b = (out[..., 0::2], out[..., 1::2]) if interleaved else (out[..., :half], out[..., half:])
    a.copy_(first * c - second * s)
    b.copy_(second * c + first * s)
    return out


def _layer_tables(cos_half, sin_half, interleaved):
    """The layers' RopeTables form: full-width cos and sin carrying the pair's sign, [n, 1, dim]."""
    if interleaved:
        cos, sin = cos_half.repeat_interleave(2, -1), torch.stack((-sin_half, sin_half), -1).flatten(-2)
    else:
        cos, sin = torch.cat((cos_half, cos_half), -1), torch.cat((-sin_half, sin_half), -1)
    return cos[:, None, :].contiguous(), sin[:, None, :].contiguous()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("n, heads, dim", [(1, 36, 128), (7, 3, 64), (70, 2, 2), (5, 4, 1024)])
def test_rotation_matches_definition(ops, interleaved, n, heads, dim):
    x = _randn(n, heads, dim, seed=1)
    cos_half, sin_half = _tables(n, dim, seed=2)
    got = x.clone()
    out = ops.rope_(got, *_layer_tables(cos_half, sin_half, interleaved), interleaved)
    assert out.data_ptr() == got.data_ptr()
    assert torch.equal(got, _reference(x, cos_half, sin_half, interleaved, torch.float32))
    torch.testing.assert_close(got.double(), _reference(x, cos_half, sin_half, interleaved, torch.float64),
                               rtol=0, atol=4e-7 * x.abs().max().item())


def test_strided_rows_leave_other_columns(ops):
    n, heads, dim = 9, 5, 16
    buffer = _randn(n, (heads + 2) * dim, seed=3)
    view = buffer[:, :heads * dim].view(n, heads, dim)
    before = buffer.clone()
    cos_half, sin_half = _tables(n, dim, seed=4)
    ops.rope_(view, *_layer_tables(cos_half, sin_half, False), False)
    assert torch.equal(buffer[:, heads * dim:], before[:, heads * dim:])
    assert torch.equal(view, _reference(before[:, :heads * dim].view(n, heads, dim), cos_half, sin_half, False,
                                        torch.float32))


@pytest.mark.parametrize("x, table_shape, message", [
    (torch.ones(2, 3, 7), (2, 1, 7), "even dim"),
    (torch.ones(2, 3, 2048), (2, 1, 2048), "even dim"),
    (torch.ones(2, 3, 8, dtype=torch.float64), (2, 1, 8), "float32"),
    (torch.ones(2, 8, 3).transpose(1, 2), (2, 1, 8), "contiguous heads"),
    (torch.ones(2, 3, 8), (2, 1, 4), r"\[2, 1, 8\]"),
    (torch.ones(2, 3, 8), (1, 1, 8), r"\[2, 1, 8\]"),
])
def test_bad_inputs_are_refused(ops, x, table_shape, message):
    with pytest.raises(KtError, match=message):
        ops.rope_(x, torch.ones(table_shape), torch.ones(table_shape), False)
