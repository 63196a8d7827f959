"""The tiled weight layout (kt.h KT_LAYOUT_TILES): tile_rows against the byte
formula of kt.h written out with numpy indexing, and the linear kernels (int8
activations, exact float activations, decode and prefill token counts) on tiled
matrices against the same fp64 references as the row layout (bounds and their
reasons: test_linear.py). The MoE operator tiles its experts by default:
test_moe.py covers both layouts."""

import numpy as np
import pytest
import torch

from kt_cli.ops import kernel_layout
from kt_weights.errors import WeightsError
from kt_weights.ktformat import matrix_entry
from kt_weights.layout import Format, QMatrix, can_tile, quantize_reference, tile_rows, untile_rows

from test_linear import QUANT_EXACT_BOUND, _acts_reference, _randn, rel_err

TILE_CASES = [  # fmt, rows, cols, group: one or several 64-byte chunks per row, every group kind
    (Format.I8, 8, 64, 16), (Format.I8, 20, 192, 48), (Format.I8, 64, 256, 64), (Format.I8, 12, 320, 32),
    (Format.I4, 12, 128, 32), (Format.I4, 16, 384, 96), (Format.I4, 64, 256, 128), (Format.I4, 8, 512, 64),
]
TOKENS = [1, 2, 5, 16, 37]     # decode tiles, partial token tiles, the exact path's GEMM (>= 16)


def _tiled_reference(data: np.ndarray) -> np.ndarray:
    """kt.h: byte b of row r at (r // 4) * 4 * row_bytes + ((b // 64) * 4 + r % 4) * 64 + b % 64."""
    rows, row_bytes = data.shape
    out = np.empty(rows * row_bytes, dtype=data.dtype)
    for r in range(rows):
        b = np.arange(row_bytes)
        out[(r // 4) * 4 * row_bytes + ((b // 64) * 4 + r % 4) * 64 + b % 64] = data[r]
    return out.reshape(rows, row_bytes)


@pytest.mark.parametrize("fmt, rows, cols, group", TILE_CASES)
def test_tile_rows_follows_the_byte_formula_and_round_trips(fmt, rows, cols, group):
    w = quantize_reference(_randn(rows, cols, seed=rows), fmt, group, symmetric=False)
    t = tile_rows(w)
    assert t.tiled and t.scale is w.scale and t.min is w.min
    assert np.array_equal(t.data.numpy(), _tiled_reference(w.data.numpy()))
    assert torch.equal(untile_rows(t).data, w.data)
    assert torch.equal(t.dequantize(), w.dequantize())


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("fmt, rows, cols, group", TILE_CASES)
def test_linear_on_tiled_weights(ops, fmt, rows, cols, group, symmetric, m):
    w = quantize_reference(_randn(rows, cols, seed=rows * cols), fmt, group, symmetric)
    t = tile_rows(w)
    x = _randn(m, cols, seed=m + cols)
    assert rel_err(ops.linear(x, t), _acts_reference(x), w.dequantize()) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, t, acts="f32"), x, w.dequantize()) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, t, acts="int16"), _acts_reference(x, 32767), w.dequantize()) < QUANT_EXACT_BOUND


@pytest.mark.parametrize("fmt, rows, cols, group", TILE_CASES + [(Format.I4, 4 * 300, 2048, 128)])
def test_native_tiling_equals_the_reference(ops, fmt, rows, cols, group):
    """kernel_layout tiles with the native kt_tile_codes (several pool tasks for the last case)."""
    w = quantize_reference(_randn(rows, cols, seed=rows + 1), fmt, group)
    t = kernel_layout(w, ops.pool)
    assert t.tiled and torch.equal(t.data, tile_rows(w).data)


def test_native_tiling_refuses_bad_shapes(ops):
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    buf = torch.zeros(8, 128, dtype=torch.uint8)
    ptr = ffi.cast("void *", buf.data_ptr())
    for rows, row_bytes in [(6, 128), (8, 96), (0, 128), (8, 0)]:
        assert lib.kt_tile_codes(ops.pool.handle, ptr, ptr, rows, row_bytes) == lib.KT_EINVAL
    assert lib.kt_tile_codes(ops.pool.handle, ffi.NULL, ptr, 8, 128) == lib.KT_EINVAL


def test_kernel_layout_tiles_only_what_can_be_tiled():
    i4 = quantize_reference(_randn(8, 128, seed=1), Format.I4, 32)
    assert kernel_layout(i4).tiled
    odd_rows = quantize_reference(_randn(6, 128, seed=1), Format.I4, 32)
    short_rows = quantize_reference(_randn(8, 96, seed=1), Format.I4, 32)      # 48-byte rows
    f32 = QMatrix(Format.F32, 8, 64, _randn(8, 64, seed=1))
    for m in (odd_rows, short_rows, f32):
        assert not can_tile(m) and kernel_layout(m) is m
    tiled = kernel_layout(i4)
    assert kernel_layout(tiled) is tiled


def test_untileable_matrices_refuse_the_tiled_flag():
    w = quantize_reference(_randn(6, 128, seed=2), Format.I4, 32)
    with pytest.raises(WeightsError, match="cannot be tiled"):
        QMatrix(w.format, w.rows, w.cols, w.data, w.group, w.scale, tiled=True)
    with pytest.raises(WeightsError, match="tiled"):
        untile_rows(w)


def test_tiled_matrices_are_never_written():
    t = tile_rows(quantize_reference(_randn(8, 128, seed=3), Format.I4, 32))
    with pytest.raises(WeightsError, match="in-memory layout"):
        matrix_entry(t)


@pytest.mark.parametrize("rows, cols, fmt", [(6, 128, Format.I4), (8, 96, Format.I4), (8, 64, Format.F32)])
def test_native_check_refuses_impossible_tiled_descriptors(ops, rows, cols, fmt):
    """C verifies the tiled layout's shape itself (rows % 4, 64-byte rows, quantized)."""
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    if fmt == Format.F32:
        data, scale, group = torch.randn(rows, cols), None, 0
    else:
        w = quantize_reference(torch.randn(rows, cols), fmt, 32)
        data, scale, group = w.data, w.scale, 32
    desc = ffi.new("kt_matrix *", {"format": int(fmt), "group": group, "rows": rows, "cols": cols,
                                   "data": ffi.cast("void *", data.data_ptr()), "layout": lib.KT_LAYOUT_TILES,
                                   "scale": ffi.cast("float *", scale.data_ptr()) if scale is not None else ffi.NULL})
    out, x = torch.empty(1, rows), torch.randn(1, cols)
    rc = lib.kt_linear(ops.pool.handle, ffi.cast("float *", out.data_ptr()), ffi.cast("float *", x.data_ptr()),
                       1, desc, lib.KT_ACTS_F32)
    assert rc == lib.KT_EINVAL


def test_native_quantizer_refuses_a_tiled_destination(ops):
    """kt_quantize_matrix_f32 writes the row layout only."""
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    t = tile_rows(quantize_reference(_randn(8, 128, seed=4), Format.I4, 32))
    desc = ffi.new("kt_matrix *", {"format": int(Format.I4), "group": 32, "rows": 8, "cols": 128,
                                   "data": ffi.cast("void *", t.data.data_ptr()), "layout": lib.KT_LAYOUT_TILES,
                                   "scale": ffi.cast("float *", t.scale.data_ptr())})
    w = torch.randn(8, 128)
    assert lib.kt_quantize_matrix_f32(ffi.NULL, desc, ffi.cast("float *", w.data_ptr())) == lib.KT_EINVAL
