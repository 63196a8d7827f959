"""Native quantization vs the torch reference (kt_weights.layout.quantize_reference).

Both compute the same float32 operations with IEEE division and round-half-to-even,
so codes, scales and mins must be bit-identical (error bound: 0 quanta). Symmetric I4
scales are the nearest float16 values (kt.h KT_SCALE_F16), rounded the same way."""

import pytest
import torch

from kt_cli.errors import KtError
from kt_weights.layout import Format, quantize_reference

CASES = [  # fmt, rows, cols, group
    (Format.I8, 1, 16, 16), (Format.I8, 5, 48, 16), (Format.I8, 7, 96, 32), (Format.I8, 33, 256, 128),
    (Format.I4, 1, 32, 32), (Format.I4, 5, 96, 32), (Format.I4, 7, 128, 64), (Format.I4, 33, 256, 128),
]


def _weights(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3
    w[0, : min(cols, 16)] = 0.0                       # an all-zero span: zero scale
    w[-1, ::5] = torch.round(w[-1, ::5] * 4) / 4      # exact halves: round-half-to-even ties
    return w


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("fmt, rows, cols, group", CASES)
def test_quantize_matches_reference_bit_for_bit(ops, fmt, rows, cols, group, symmetric):
    w = _weights(rows, cols, rows * cols + group)
    ref = quantize_reference(w, fmt, group, symmetric)
    got = ops.quantize(w, fmt, group, symmetric)
    assert torch.equal(got.scale, ref.scale)
    assert (got.min is None) == symmetric and (symmetric or torch.equal(got.min, ref.min))
    assert torch.equal(got.data, ref.data)


def test_quantize_constant_rows_give_zero_scale(ops):
    w = torch.full((3, 64), 2.5)
    ref = quantize_reference(w, Format.I4, 32, symmetric=False)
    got = ops.quantize(w, Format.I4, 32, symmetric=False)
    assert torch.equal(got.data, ref.data) and torch.equal(got.min, ref.min)
    assert torch.equal(got.dequantize(), w)


def _scale_edges() -> torch.Tensor:
    """Rows of one 32-weight group whose symmetric I4 scale (signed absmax / -8) lands on the edges
    of float16: ties between two halves, subnormals, the largest half, and beyond it (overflow)."""
    scales = [1 + 2 ** -11, 1 + 3 * 2 ** -11, -(2 + 2 ** -10), 3.3e-6, 2 ** -24 * 1.5, 2 ** -25, 6.1e-5,
              65504.0, 65519.0, 65520.0, 1e6, 1 / 3]
    rows = torch.zeros(len(scales), 32)
    rows[:, 0] = torch.tensor(scales, dtype=torch.float32) * -8.0
    rows[:, 1:] = rows[:, :1] * torch.linspace(-0.9, 0.9, 31)
    return rows


def test_symmetric_i4_scales_are_the_nearest_halves(ops):
    """Rounded to float16 with ties to even (torch's .half()), except where a half would overflow."""
    w = _scale_edges()
    got, ref = ops.quantize(w, Format.I4, 32), quantize_reference(w, Format.I4, 32)
    assert torch.equal(got.scale, ref.scale) and torch.equal(got.data, ref.data)
    exact = (-w[:, :1] / 8).float()
    halves = exact.half().float()
    assert torch.equal(got.scale, torch.where(torch.isfinite(halves), halves, exact))
    assert got.scale[0, 0] == 1.0 and got.scale[1, 0] == 1 + 4 * 2 ** -11      # ties to even, both ways
    assert got.scale[-3, 0] == 65520.0 and got.scale[-2, 0] == 1e6             # no half: kept as they are
    assert not torch.equal(got.scale, exact)


def _rows_reference(x):
    scale = x.abs().amax(dim=1) / 127.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x / safe[:, None]).clamp(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("rows, n", [(1, 1), (3, 7), (8, 33), (33, 256)])
def test_quantize_rows_i8_matches_reference(ops, rows, n):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n)) * 5
    x[0] = 0.0
    q, scale = ops.quantize_rows_i8(x)
    q_ref, scale_ref = _rows_reference(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)
    assert (q.float() * scale[:, None] - x).abs().max() <= scale.max() / 2 + 1e-6


@pytest.mark.parametrize("args", [
    (torch.randn(4, 40), Format.I4, 32, True),     # cols not a multiple of the group
    (torch.randn(4, 64), Format.I4, 16, True),     # I4 group below the 32-weight block
    (torch.randn(4, 64), Format.I8, 24, True),     # I8 group not a multiple of 16
    (torch.randn(4, 64), Format.F32, 32, True),    # not a quantized format
    (torch.randn(4, 64).double(), Format.I8, 32, True),
    (torch.randn(64, 4).T, Format.I8, 32, True),   # non-contiguous (4 x 64 view)
    (torch.randn(64), Format.I8, 32, True),
])
def test_quantize_rejects_bad_input(ops, args):
    with pytest.raises(KtError):
        ops.quantize(*args)


def test_quantize_rows_rejects_bad_input(ops):
    with pytest.raises(KtError):
        ops.quantize_rows_i8(torch.randn(3, 0))
    with pytest.raises(KtError):
        ops.quantize_rows_i8(torch.randn(3, 4, dtype=torch.float16))
