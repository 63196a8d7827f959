"""QMatrix.dequantize_rows (the embedding lookup) against a numpy dequantization of
the picked rows' codes, in every format and layout an embedding table can have."""

import numpy as np
import pytest
import torch

from kt_weights.layout import Format, QMatrix, pack_i4, to_row8

ROWS, COLS, GROUP = 16, 64, 32
PICK = torch.tensor([5, 0, 15, 5])


def numpy_rows(codes: np.ndarray, scale: np.ndarray, mins: np.ndarray | None, offset: float) -> np.ndarray:
    """w[r, k] = scale[r, k // GROUP] * (codes[r, k] - offset) (+ min[r, k // GROUP])"""
    s = np.repeat(scale, GROUP, axis=1)
    w = s * (codes.astype(np.float32) - np.float32(offset))
    return w + np.repeat(mins, GROUP, axis=1) if mins is not None else w


def quantized(fmt: Format, with_min: bool) -> tuple[QMatrix, np.ndarray]:
    g = torch.Generator().manual_seed(3)
    scale = torch.rand(ROWS, COLS // GROUP, generator=g) + 0.1
    mins = torch.randn(ROWS, COLS // GROUP, generator=g) if with_min else None
    if fmt == Format.I4:
        codes = torch.randint(0, 16, (ROWS, COLS), generator=g)
        m = QMatrix(fmt, ROWS, COLS, pack_i4(codes), GROUP, scale, mins)
        offset = 0.0 if with_min else 8.0
    else:
        codes = torch.randint(-127, 128, (ROWS, COLS), generator=g).to(torch.int8)
        m = QMatrix(fmt, ROWS, COLS, codes, GROUP, scale, mins)
        offset = 0.0
    want = numpy_rows(codes.numpy(), scale.numpy(), None if mins is None else mins.numpy(), offset)
    return m, want[PICK.numpy()]


@pytest.mark.parametrize("fmt,with_min", [(Format.I8, False), (Format.I4, False), (Format.I4, True)])
def test_quantized_rows_match_numpy(fmt, with_min):
    m, want = quantized(fmt, with_min)
    got = m.dequantize_rows(PICK)
    assert got.dtype == torch.float32 and got.shape == (len(PICK), COLS)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got, m.dequantize()[PICK])


def test_row8_layout_rows_match_numpy():
    m, want = quantized(Format.I4, False)
    np.testing.assert_allclose(to_row8(m).dequantize_rows(PICK).numpy(), want, rtol=1e-6, atol=1e-6)


def test_bf16_rows_are_float32():
    data = torch.randn(ROWS, COLS).to(torch.bfloat16)
    got = QMatrix(Format.BF16, ROWS, COLS, data).dequantize_rows(PICK)
    assert got.dtype == torch.float32 and torch.equal(got, data.float()[PICK])
