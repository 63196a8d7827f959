"""kt_dequantize_rows_f32 (Ops.row_lookup, the CPU token-embedding lookup) on each variant,
against rows built here from the codes by the layout's definition (weights/layout.py):
I4 w = s*(q-8) or s*q + min, I8 w = s*q (+ min), each operation rounded to float32, so the
bits must be equal. Float formats must come back as their exact float32 values."""

import pytest
import torch

from kt_cli.ops import OpError
from kt_cli.ops.linear import kernel_layout
from kt_weights.layout import Format, QMatrix

ROWS, COLS = 12, 256


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _pack_i4(q: torch.Tensor) -> torch.Tensor:
    """q [rows, cols] in 0..15 -> bytes: each 32-column block is 16 bytes, byte j = q[j] | q[j+16] << 4"""
    blocks = q.view(q.shape[0], -1, 2, 16).to(torch.uint8)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(q.shape[0], -1).contiguous()


def _quantized(fmt: Format, group: int, with_min: bool, seed: int, rows: int = ROWS) -> tuple[QMatrix, torch.Tensor]:
    g = _gen(seed)
    n_groups = COLS // group
    scale = torch.rand(rows, n_groups, generator=g) * 0.1 + 1e-3
    mins = (torch.rand(rows, n_groups, generator=g) - 0.5) if with_min else None
    if fmt == Format.I4:
        q = torch.randint(0, 16, (rows, COLS), generator=g)
        data, codes = _pack_i4(q), q.float() - (0.0 if with_min else 8.0)
    else:
        q = torch.randint(-128, 128, (rows, COLS), generator=g, dtype=torch.int8)
        data, codes = q, q.float()
    s = scale.repeat_interleave(group, dim=1)
    want = codes * s + (mins.repeat_interleave(group, dim=1) if with_min else 0.0)
    return QMatrix(fmt, rows, COLS, data, group, scale, mins), want


CASES = [(Format.I4, 32, False), (Format.I4, 32, True), (Format.I4, 128, False), (Format.I4, 64, True),
         (Format.I8, 32, False), (Format.I8, 16, True), (Format.I8, 256, False)]


@pytest.mark.parametrize("fmt,group,with_min", CASES)
def test_quantized_rows_match_the_layout_definition(ops, fmt, group, with_min):
    w, want = _quantized(fmt, group, with_min, seed=group + with_min)
    ids = torch.tensor([3, 0, 11, 3, 7])
    got = ops.row_lookup(w)(ids)
    assert got.dtype == torch.float32 and got.shape == (5, COLS)
    assert torch.equal(got, want[ids])
    assert torch.equal(got, w.dequantize_rows(ids))


@pytest.mark.parametrize("fmt,group,with_min", [(Format.I4, 32, False), (Format.I8, 16, True)])
def test_tiled_matrices_give_the_same_rows(ops, fmt, group, with_min):
    w, want = _quantized(fmt, group, with_min, seed=5)
    tiled = kernel_layout(w, ops.pool)
    assert tiled.tiled
    ids = torch.arange(ROWS).flip(0)
    assert torch.equal(ops.row_lookup(tiled)(ids), want[ids])


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, Format.F32), (torch.bfloat16, Format.BF16),
                                       (torch.float16, Format.F16)])
def test_float_rows_come_back_exactly(ops, dtype, fmt):
    data = torch.randn(ROWS, 40, generator=_gen(9)).to(dtype)
    ids = torch.tensor([1, 10, 1])
    got = ops.row_lookup(QMatrix(fmt, ROWS, 40, data))(ids)
    assert torch.equal(got, data[ids].float())


def test_no_ids_give_no_rows(ops):
    w, _ = _quantized(Format.I4, 32, False, seed=1)
    assert ops.row_lookup(w)(torch.empty(0, dtype=torch.int64)).shape == (0, COLS)


@pytest.mark.parametrize("bad", [[-1], [ROWS], [0, 2, ROWS + 100]])
def test_ids_outside_the_matrix_are_refused(ops, bad):
    w, _ = _quantized(Format.I8, 32, False, seed=2)
    with pytest.raises(OpError, match=f"row ids must lie in 0..{ROWS - 1}"):
        ops.row_lookup(w)(torch.tensor(bad))


def test_ids_of_the_wrong_dtype_are_refused(ops):
    w, _ = _quantized(Format.I8, 32, False, seed=3)
    with pytest.raises(OpError, match="1-D int64"):
        ops.row_lookup(w)(torch.tensor([1, 2], dtype=torch.int32))


def test_row8_matrices_are_refused(ops):
    from kt_weights.layout import to_row8
    w, _ = _quantized(Format.I4, 32, False, seed=4, rows=16)
    with pytest.raises(OpError, match="not row8"):
        ops.row_lookup(to_row8(w))
