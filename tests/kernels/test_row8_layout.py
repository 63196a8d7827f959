"""The 8-row I4 layout (kt.h KT_LAYOUT_ROW8): to_row8 against the byte and scale
formulas of kt.h written out with numpy indexing, and the linear kernels on ROW8
matrices against the same fp64 references as the row layout (bounds and their
reasons: test_linear.py): int8 activations run the 8-row kernel where the build
has it (kt_row8_kernel), and int16 ones too, split into pairs of int8 rows with
KT_SPLIT_MAX levels instead of 32767 (the bound then fails against 32767 levels:
9e-6 > 1e-6); float activations and builds without the kernel read a copy in the
row layout. Scales and mins that are all exact halves (GGUF's) move to float16
(kt.h KT_SCALE_F16), and every kernel path runs on those too. On the amx variant
with its tiles on, rows in full 16-row blocks meet bf16 x on the BF16 tiles from
24 (INT4) or 64 (I8) tokens (int8_linear_error). The MoE operator puts I4 experts in ROW8 by
default where the kernel exists: test_moe.py."""

import numpy as np
import pytest
import torch

from kt_cli.ops import Pool, decode_layout
from kt_cli.ops.linear import linear as linear_on
from kt_weights.errors import WeightsError
from kt_weights.ktformat import matrix_entry
from kt_weights.layout import Format, LayoutError, QMatrix, can_row8, from_row8, quantize_reference, to_row8

from test_linear import (AMX_ROW8_MIN_TOKENS, QUANT_EXACT_BOUND, _acts_reference, _randn, bf16_round, rel_err,
                         tile_weights)

ROW8_CASES = [  # rows, cols, group: one or many 8-row groups, one or many blocks per group
    (8, 64, 32), (16, 128, 64), (24, 192, 64), (40, 256, 128), (8, 512, 256), (64, 2048, 32),
]
SPLIT_MAX = 32639   # kt_internal.h KT_SPLIT_MAX: int16 activations of a ROW8 matrix, as int8 pairs
TOKENS = [1, 2, 3, 5, 8, 9, 16, 37]     # token tiles of 1-8, several tiles, the exact path's GEMM


def _error_with_tiles(out: torch.Tensor, x: torch.Tensor, w: QMatrix, levels: int, tiles: bool) -> float:
    """rel_err against x in int blocks of `levels` @ W, except, with tiles, the full 16-row blocks
    (rows below rows // 16 * 16: kt_linear's tasks start at multiples of 48 rows there), which
    take bf16 x against tile_weights(w) on the amx variant's BF16 tiles"""
    wd = w.dequantize().double()
    expected = _acts_reference(x, levels) @ wd.T
    if tiles:
        n = w.rows // 16 * 16
        expected[:, :n] = bf16_round(x) @ tile_weights(w)[:n].T
    magnitude = (x.double().abs() @ wd.abs().T).norm().clamp_min(1e-30)
    return ((out.double() - expected).norm() / magnitude).item()


def int8_linear_error(pool, out: torch.Tensor, x: torch.Tensor, w: QMatrix) -> float:
    """acts="int8" on ROW8 w: the tiles take it from AMX_ROW8_MIN_TOKENS tokens (pools with them on)"""
    return _error_with_tiles(out, x, w, 127, pool.amx_tiles and x.shape[0] >= AMX_ROW8_MIN_TOKENS[w.format])


def bf16_linear_error(pool, out: torch.Tensor, x: torch.Tensor, w: QMatrix, levels: int) -> float:
    """acts="bf16" (kt.h KT_ACTS_BF16) on ROW8 w: the tiles at any token count on pools with them
    on, the rest (all of it elsewhere) as acts="int16", whose codes have `levels`"""
    return _error_with_tiles(out, x, w, levels, pool.amx_tiles)


def _with_half_scales(w: QMatrix) -> QMatrix:
    """w with its scale (and min) rounded to float16 values, held as float32, as GGUF's are"""
    rounded = [None if t is None else t.half().float() for t in (w.scale, w.min)]
    return QMatrix(w.format, w.rows, w.cols, w.data, w.group, *rounded)


def _with_float32_scales(w: QMatrix) -> QMatrix:
    """w with its scale nudged off the float16 grid (kt quantizes symmetric I4 scales to halves)"""
    return QMatrix(w.format, w.rows, w.cols, w.data, w.group, w.scale * (1 + 2 ** -16), w.min)


def _k_factored(t: torch.Tensor | None, signed: bool = False) -> torch.Tensor | None:
    """t [rows, n_groups] snapped to a half base per 8 groups (its block's peak / 63) times a
    6-bit integer (signed: -63..63): the values of GGUF's K-quant scales and mins"""
    if t is None:
        return None
    blocks = t.reshape(t.shape[0], -1, 8)
    peak = blocks.gather(2, blocks.abs().argmax(dim=2, keepdim=True))
    base = (peak / 63).half().float()
    safe = torch.where(base == 0, torch.ones_like(base), base)
    return (base * (blocks / safe).round().clamp(-63 if signed else 0, 63)).reshape(t.shape)


def _with_k_scales(w: QMatrix, signed: bool = False) -> QMatrix:
    """w with its scale (and min) made two-level (kt.h KT_SCALE_K), held as float32, as GGUF's
    Q4_K and Q5_K are; signed: the scales' signs flipped at random first, so only int8 subs
    factor them (kt.h KT_SCALE_KS, as Q6_K's); the codes stay"""
    scale = w.scale
    if signed:
        flips = torch.randint(0, 2, scale.shape, generator=torch.Generator().manual_seed(w.rows)) * 2 - 1
        scale = scale * flips
    return QMatrix(w.format, w.rows, w.cols, w.data, w.group, _k_factored(scale, signed), _k_factored(w.min))


def _quantized(rows: int, cols: int, group: int, symmetric: bool, seed: int, scales: str) -> QMatrix:
    w = quantize_reference(_randn(rows, cols, seed=seed), Format.I4, group, symmetric)
    return _with_half_scales(w) if scales == "f16" else _with_float32_scales(w)


def _row8_reference(w: QMatrix) -> tuple[np.ndarray, np.ndarray]:
    """kt.h: bytes 4j..4j+3 of row r's block b at (r // 8) * 8 * row_bytes + b * 128 + j * 32 + (r % 8) * 4;
    the scale of row r, group g at (r // 8) * 8 * n_groups + g * 8 + r % 8."""
    data, scale = w.data.numpy(), w.scale.numpy()
    rows, row_bytes = data.shape
    groups = scale.shape[1]
    codes, scales = np.empty(rows * row_bytes, np.uint8), np.empty(rows * groups, np.float32)
    for r in range(rows):
        for b in range(row_bytes // 16):
            for j in range(4):
                at = (r // 8) * 8 * row_bytes + b * 128 + j * 32 + (r % 8) * 4
                codes[at:at + 4] = data[r, b * 16 + 4 * j:b * 16 + 4 * j + 4]
        for g in range(groups):
            scales[(r // 8) * 8 * groups + g * 8 + r % 8] = scale[r, g]
    return codes.reshape(rows, row_bytes), scales.reshape(rows, groups)


@pytest.mark.parametrize("rows, cols, group", ROW8_CASES[:4])
def test_to_row8_follows_the_formulas_and_round_trips(rows, cols, group):
    w = quantize_reference(_randn(rows, cols, seed=rows), Format.I4, group, symmetric=False)
    r8 = to_row8(w)
    codes, scales = _row8_reference(w)
    assert r8.row8 and not r8.tiled
    assert np.array_equal(r8.data.numpy(), codes) and np.array_equal(r8.scale.numpy(), scales)
    back = from_row8(r8)
    assert torch.equal(back.data, w.data) and torch.equal(back.scale, w.scale) and torch.equal(back.min, w.min)
    assert torch.equal(r8.dequantize(), w.dequantize())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_to_row8_moves_exact_half_scales_to_float16_only(symmetric):
    w = _with_float32_scales(quantize_reference(_randn(16, 128, seed=9), Format.I4, 32, symmetric))
    assert to_row8(w).scale.dtype == torch.float32         # scales that are not all halves stay float32
    half = _with_half_scales(w)
    r8 = to_row8(half)
    codes, scales = _row8_reference(half)
    assert r8.scale.dtype == torch.float16 and (symmetric or r8.min.dtype == torch.float16)
    assert np.array_equal(r8.scale.float().numpy(), scales)
    back = from_row8(r8)
    assert back.scale.dtype == torch.float32 and torch.equal(back.scale, half.scale)
    assert torch.equal(r8.dequantize(), half.dequantize())
    if not symmetric:       # one min that is not a half keeps both in float32: C takes one type for both
        mins = half.min.clone()
        mins[3, 1] += 1e-6
        mixed = QMatrix(w.format, w.rows, w.cols, w.data, w.group, half.scale, mins)
        assert to_row8(mixed).scale.dtype == torch.float32


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("scales", ["f32", "f16"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("rows, cols, group", ROW8_CASES)
def test_linear_on_row8_weights(ops, rows, cols, group, symmetric, scales, m):
    w = _quantized(rows, cols, group, symmetric, rows * cols + m, scales)
    r8 = to_row8(w)
    assert r8.scale.dtype == (torch.float16 if scales == "f16" else torch.float32)
    x = _randn(m, cols, seed=m + cols)
    assert int8_linear_error(ops.pool, ops.linear(x, r8), x, w) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, r8, acts="f32"), x, w.dequantize()) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, r8, acts="int16"), _acts_reference(x, SPLIT_MAX), w.dequantize()) < QUANT_EXACT_BOUND
    assert bf16_linear_error(ops.pool, ops.linear(x, r8, acts="bf16"), x, w, SPLIT_MAX) < QUANT_EXACT_BOUND


K_CASES = [  # rows, cols, group: n_groups a multiple of 8 (kt.h KT_SCALE_K_GROUPS), one or more bases a row
    (8, 256, 32), (24, 512, 32), (16, 1024, 64), (40, 2048, 256), (64, 2048, 32),
]


@pytest.mark.parametrize("fmt", [Format.I4, Format.I8], ids=["i4", "i8"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("rows, cols, group", K_CASES[:3])
def test_to_row8_factors_k_quant_scales_exactly(rows, cols, group, symmetric, fmt):
    """Scales (and mins) that are half bases times small integers go to uint8 subs and float16 bases,
    at kt.h's indices, with exactly the float32 values; one value off that grid keeps float32."""
    w = _with_k_scales(quantize_reference(_randn(rows, cols, seed=rows + cols), fmt, group, symmetric))
    r8 = to_row8(w)
    assert r8.scale.dtype == torch.uint8 and r8.scale_base.dtype == torch.float16
    assert (r8.min is None) == symmetric and (r8.min_base is None) == symmetric
    ng = cols // group
    for values, subs, bases in ((w.scale, r8.scale, r8.scale_base), (w.min, r8.min, r8.min_base)):
        if values is None:
            continue
        sub, base = subs.flatten().float(), bases.flatten().float()
        for r, g in [(r, g) for r in range(rows) for g in range(ng)]:
            at, at_base = (r // 8) * 8 * ng + g * 8 + r % 8, (r // 8) * ng + (g // 8) * 8 + r % 8
            assert base[at_base] * sub[at] == values[r, g]
    back = from_row8(r8)
    assert torch.equal(back.scale, w.scale) and (symmetric or torch.equal(back.min, w.min))
    assert torch.equal(r8.dequantize(), w.dequantize())
    off = w.scale.clone()
    off[rows - 1, ng - 1] = torch.nextafter(off[rows - 1, ng - 1], torch.tensor(1.0))
    assert to_row8(QMatrix(fmt, rows, cols, w.data, group, off, w.min)).scale.dtype == torch.float32


@pytest.mark.parametrize("m", TOKENS + [65])
@pytest.mark.parametrize("signed", [False, True], ids=["k", "ks"])
@pytest.mark.parametrize("fmt", [Format.I4, Format.I8], ids=["i4", "i8"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("rows, cols, group", K_CASES)
def test_linear_on_k_scale_row8_weights(ops, rows, cols, group, symmetric, fmt, signed, m):
    """Two-level scales, uint8 subs (KT_SCALE_K) and int8 ones (KT_SCALE_KS), on every kernel path:
    the 8-row and 16-row kernels, the row-layout copy, int8, int16, float and bf16 activations"""
    q = quantize_reference(_randn(rows, cols, seed=rows * cols + m), fmt, group, symmetric)
    w = _with_k_scales(q, signed)
    r8 = to_row8(w)
    assert r8.scale.dtype == (torch.int8 if signed else torch.uint8)
    assert torch.equal(r8.dequantize(), w.dequantize())
    x = _randn(m, cols, seed=m + cols)
    assert int8_linear_error(ops.pool, ops.linear(x, r8), x, w) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, r8, acts="f32"), x, w.dequantize()) < QUANT_EXACT_BOUND
    lib = ops.kernels.lib
    levels = SPLIT_MAX if fmt == Format.I4 or lib.kt_row8_kernel() & lib.KT_ROW8_I8 else 32767
    assert rel_err(ops.linear(x, r8, acts="int16"), _acts_reference(x, levels), w.dequantize()) < QUANT_EXACT_BOUND
    assert bf16_linear_error(ops.pool, ops.linear(x, r8, acts="bf16"), x, w, levels) < QUANT_EXACT_BOUND


def test_two_level_factors_keep_zero_blocks_and_take_mixed_signs_as_int8():
    """A block of zero scales factors (base 0); a block whose values differ in sign takes int8 subs
    for the whole matrix (kt.h KT_SCALE_KS); one whose peak needs a sub above 255 keeps the whole
    matrix in float32"""
    w = _with_k_scales(quantize_reference(_randn(16, 512, seed=2), Format.I4, 32, symmetric=False))
    zeros = w.min.clone()
    zeros[3, 8:16] = 0.0
    r8 = to_row8(QMatrix(w.format, w.rows, w.cols, w.data, w.group, w.scale, zeros))
    assert r8.min.dtype == torch.uint8 and torch.equal(from_row8(r8).min, zeros)
    flipped, wide = w.scale.clone(), w.scale.clone()
    flipped[5, 1] = -flipped[5, 1]
    wide[7, 1] = 256 * wide[7, 0]
    signed = to_row8(QMatrix(w.format, w.rows, w.cols, w.data, w.group, flipped, w.min))
    assert signed.scale.dtype == torch.int8 and torch.equal(from_row8(signed).scale, flipped)
    assert to_row8(QMatrix(w.format, w.rows, w.cols, w.data, w.group, wide, w.min)).scale.dtype == torch.float32


def test_native_check_refuses_bad_k_scale_descriptors(ops):
    """KT_SCALE_K: ROW8 only, with its bases (and min's where there is a min), n_groups % 8 == 0"""
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    w = to_row8(_with_k_scales(quantize_reference(_randn(8, 256, seed=4), Format.I4, 32, symmetric=False)))
    out, x = torch.empty(1, 8), torch.randn(1, 256)
    good = {"format": int(Format.I4), "group": 32, "rows": 8, "cols": 256, "layout": lib.KT_LAYOUT_ROW8,
            "data": ffi.cast("void *", w.data.data_ptr()), "scale": ffi.cast("float *", w.scale.data_ptr()),
            "min": ffi.cast("float *", w.min.data_ptr()), "scale_type": lib.KT_SCALE_K,
            "scale_base": ffi.cast("uint16_t *", w.scale_base.data_ptr()),
            "min_base": ffi.cast("uint16_t *", w.min_base.data_ptr())}
    cases = [({}, lib.KT_OK), ({"layout": lib.KT_LAYOUT_ROWS}, lib.KT_EINVAL), ({"scale_base": ffi.NULL}, lib.KT_EINVAL),
             ({"min_base": ffi.NULL}, lib.KT_EINVAL), ({"group": 64}, lib.KT_EINVAL)]
    for change, want in cases:
        desc = ffi.new("kt_matrix *", {**good, **change})
        rc = lib.kt_linear(ops.pool.handle, ffi.cast("float *", out.data_ptr()), ffi.cast("float *", x.data_ptr()),
                           1, desc, lib.KT_ACTS_INT8)
        assert rc == want, change


def test_two_level_scales_are_checked_in_python():
    w = to_row8(_with_k_scales(quantize_reference(_randn(8, 256, seed=4), Format.I4, 32, symmetric=False)))
    with pytest.raises(LayoutError, match="scale_base"):
        QMatrix(w.format, w.rows, w.cols, w.data, w.group, w.scale, w.min, row8=True, min_base=w.min_base)
    with pytest.raises(LayoutError, match="min_base"):
        QMatrix(w.format, w.rows, w.cols, w.data, w.group, w.scale, w.min, row8=True, scale_base=w.scale_base)
    with pytest.raises(LayoutError, match="uint8"):
        QMatrix(w.format, w.rows, w.cols, w.data, w.group, w.scale.float(), w.min.float(), row8=True,
                scale_base=w.scale_base, min_base=w.min_base)


@pytest.mark.parametrize("m", [64, 65, 130])      # kt's 8-row kernel walks tokens in chunks of 64
@pytest.mark.parametrize("scales", ["f32", "f16"])
@pytest.mark.parametrize("rows, cols, group", [ROW8_CASES[1], ROW8_CASES[3], ROW8_CASES[5]])
def test_linear_on_row8_weights_past_a_token_chunk(ops, rows, cols, group, scales, m):
    w = _quantized(rows, cols, group, False, rows + m, scales)
    x = _randn(m, cols, seed=m)
    assert int8_linear_error(ops.pool, ops.linear(x, to_row8(w)), x, w) < QUANT_EXACT_BOUND


@pytest.mark.parametrize("extra", [0, 13, 66], ids=["at", "past", "far"])
@pytest.mark.parametrize("scales", ["f32", "f16", "k"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("fmt", [Format.I4, Format.I8], ids=["i4", "i8"])
def test_amx_tiles_take_row8_prefill(ops, fmt, symmetric, scales, extra):
    """amx variant, from AMX_ROW8_MIN_TOKENS tokens: 40 rows, so 32 go to the BF16 tiles and 8 to
    the 8-row kernel; each part against its own reference, the tiles' part far from the int8
    one (so the tiles ran), and the same matrix on a pool without tiles back on int8."""
    if ops.kernels.variant != "amx":
        pytest.skip(f"AMX tiles: only the amx variant (a CPU with AMX-TILE/INT8/BF16) has them, not {ops.kernels.variant}")
    m = AMX_ROW8_MIN_TOKENS[fmt] + extra
    q = quantize_reference(_randn(40, 512, seed=40 + m), fmt, 64, symmetric)
    w = {"f16": _with_half_scales, "k": _with_k_scales}.get(scales, _with_float32_scales)(q)
    x = _randn(m, 512, seed=m)
    tiles, plain = (Pool(ops.kernels, ops.threads, amx_tiles=on) for on in (True, False))
    r8 = to_row8(w)
    out = linear_on(tiles, x, r8)
    assert int8_linear_error(tiles, out, x, w) < QUANT_EXACT_BOUND
    int8_rows = _acts_reference(x) @ w.dequantize().double()[:32].T
    assert (out[:, :32].double() - int8_rows).norm() / int8_rows.norm() > 1e-4
    assert int8_linear_error(plain, linear_on(plain, x, r8), x, w) < QUANT_EXACT_BOUND
    # acts="bf16": the tiles from one token on, int16 for the other 8 rows; without tiles all int16
    few = x[:3]
    on_tiles, int16 = linear_on(tiles, few, r8, "bf16"), linear_on(tiles, few, r8, "int16")
    assert bf16_linear_error(tiles, on_tiles, few, w, SPLIT_MAX) < QUANT_EXACT_BOUND
    assert torch.equal(on_tiles[:, 32:], int16[:, 32:]) and not torch.equal(on_tiles[:, :32], int16[:, :32])
    assert torch.equal(linear_on(plain, few, r8, "bf16"), linear_on(plain, few, r8, "int16"))


def test_decode_layout_picks_row8_where_the_kernel_is(ops):
    """kt.h kt_row8_kernels: INT4, I8 and I6 on every SIMD build, INT4's prefill form on the
    AVX-512 ones, summed by vpdpbusd on the AVX512-VNNI ones, amx included; I8 widened on avx2"""
    bits = {"generic": 0, "avx2": 53, "avx512": 23}.get(ops.kernels.variant, 31)
    assert ops.kernels.lib.kt_row8_kernel() == bits
    w = quantize_reference(_randn(16, 128, seed=5), Format.I4, 32)
    assert decode_layout(w, ops.pool).row8 == bool(bits & 1)
    assert decode_layout(w, ops.pool, row8=True).row8
    assert decode_layout(w, ops.pool, row8=False).tiled
    odd = quantize_reference(_randn(12, 128, seed=6), Format.I4, 32)      # 12 rows: tiles, not row8
    assert decode_layout(odd, ops.pool, row8=True).tiled
    i8 = quantize_reference(_randn(16, 128, seed=7), Format.I8, 32)
    assert decode_layout(i8, ops.pool).row8 == bool(bits & 4)
    assert decode_layout(i8, ops.pool, row8=True).row8


@pytest.mark.parametrize("rows, cols, fmt, group", [(12, 128, Format.I4, 32), (8, 96, Format.I4, 32),
                                                   (8, 96, Format.I8, 32), (16, 128, Format.I8, 16)])
def test_row8_refuses_other_shapes_and_formats(rows, cols, fmt, group):
    w = quantize_reference(_randn(rows, cols, seed=1), fmt, group)
    assert not can_row8(w)
    with pytest.raises(LayoutError, match="cannot be row8"):
        to_row8(w)
    with pytest.raises(LayoutError, match="cannot be row8"):
        QMatrix(w.format, w.rows, w.cols, w.data, w.group, w.scale, row8=True)


@pytest.mark.parametrize("rows, cols, fmt, group", [(12, 128, Format.I4, 32), (8, 96, Format.I4, 32),
                                                   (8, 96, Format.I8, 32), (8, 128, Format.I8, 16),
                                                   (8, 128, Format.BF16, 32)])
def test_native_check_refuses_impossible_row8_descriptors(ops, rows, cols, fmt, group):
    """C verifies the ROW8 layout's shape itself (I4 or I8, rows % 8, cols % 64, group % 32)."""
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    w = quantize_reference(torch.randn(rows, cols), fmt if fmt.quantized else Format.I8, group)
    desc = ffi.new("kt_matrix *", {"format": int(fmt), "group": group, "rows": rows, "cols": cols,
                                   "data": ffi.cast("void *", w.data.data_ptr()), "layout": lib.KT_LAYOUT_ROW8,
                                   "scale": ffi.cast("float *", w.scale.data_ptr())})
    out, x = torch.empty(1, rows), torch.randn(1, cols)
    for acts in (lib.KT_ACTS_INT8, lib.KT_ACTS_F32):
        rc = lib.kt_linear(ops.pool.handle, ffi.cast("float *", out.data_ptr()), ffi.cast("float *", x.data_ptr()),
                           1, desc, acts)
        assert rc == lib.KT_EINVAL


def test_row8_matrices_are_never_written():
    r8 = to_row8(quantize_reference(_randn(8, 128, seed=3), Format.I4, 32))
    with pytest.raises(WeightsError, match="in-memory layout"):
        matrix_entry(r8)


def test_to_row8_takes_codes_that_start_off_a_word_boundary():
    """Codes mapped from a file may start at any byte; to_row8 moves 4-byte words."""
    w = quantize_reference(_randn(16, 128, seed=8), Format.I4, 32)
    buf = torch.empty(w.data.numel() + 1, dtype=torch.uint8)
    buf[1:].copy_(w.data.flatten())
    shifted = QMatrix(w.format, w.rows, w.cols, buf[1:].view(w.rows, -1), w.group, w.scale)
    assert np.array_equal(to_row8(shifted).data.numpy(), _row8_reference(w)[0])


def test_native_check_refuses_half_scales_outside_row8(ops):
    """KT_SCALE_F16 is a ROW8-only descriptor: the row layout's kernels read float32 scales."""
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    w = _with_half_scales(quantize_reference(torch.randn(8, 128), Format.I4, 32))
    half = w.scale.half()
    out, x = torch.empty(1, 8), torch.randn(1, 128)
    cases = ((lib.KT_LAYOUT_ROWS, lib.KT_SCALE_F16, lib.KT_EINVAL), (lib.KT_LAYOUT_ROWS, 7, lib.KT_EINVAL),
             (lib.KT_LAYOUT_ROWS, lib.KT_SCALE_F32, lib.KT_OK))
    for layout, scale_type, want in cases:
        scale = half if scale_type == lib.KT_SCALE_F16 else w.scale
        desc = ffi.new("kt_matrix *", {"format": int(Format.I4), "group": 32, "rows": 8, "cols": 128,
                                       "data": ffi.cast("void *", w.data.data_ptr()), "layout": layout,
                                       "scale": ffi.cast("float *", scale.data_ptr()), "scale_type": scale_type})
        rc = lib.kt_linear(ops.pool.handle, ffi.cast("float *", out.data_ptr()), ffi.cast("float *", x.data_ptr()),
                           1, desc, lib.KT_ACTS_INT8)
        assert rc == want


def _row8_i8_reference(w: QMatrix) -> np.ndarray:
    """kt.h for I8: bytes 4j..4j+3 of row r's block b (32 bytes a row) at
    (r // 8) * 8 * row_bytes + b * 256 + j * 32 + (r % 8) * 4"""
    data = w.data.numpy()
    rows, row_bytes = data.shape
    codes = np.empty(rows * row_bytes, np.int8)
    for r in range(rows):
        for b in range(row_bytes // 32):
            for j in range(8):
                at = (r // 8) * 8 * row_bytes + b * 256 + j * 32 + (r % 8) * 4
                codes[at:at + 4] = data[r, b * 32 + 4 * j:b * 32 + 4 * j + 4]
    return codes.reshape(rows, row_bytes)


I8_ROW8_CASES = [  # rows, cols, group: odd 8-row groups (24, 40), per-channel groups (group = cols)
    (8, 64, 32), (16, 128, 64), (24, 192, 192), (40, 256, 128), (64, 2048, 32),
]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("rows, cols, group", I8_ROW8_CASES[:4])
def test_i8_to_row8_follows_the_formulas_and_round_trips(rows, cols, group, symmetric):
    w = quantize_reference(_randn(rows, cols, seed=rows), Format.I8, group, symmetric)
    r8 = to_row8(w)
    assert r8.row8 and r8.data.dtype == torch.int8
    assert np.array_equal(r8.data.numpy(), _row8_i8_reference(w))
    back = from_row8(r8)
    assert torch.equal(back.data, w.data) and torch.equal(back.scale, w.scale)
    assert torch.equal(r8.dequantize(), w.dequantize())


@pytest.mark.parametrize("m", [1, 2, 6, 13])
def test_i8_row8_extreme_codes_do_not_saturate(ops, m):
    """Codes 127 and -128 against activations at the block's full scale, both signs: the
    largest sums the 16-row form adds. Without VNNI it sums the codes' nibbles in int16
    (simd_row8_pair.h: at most 30720 a lane); summing whole flipped codes there would
    saturate and miss the reference by far more than the bound."""
    rows, cols, group = 32, 256, 32
    codes = torch.full((rows, cols), 127, dtype=torch.int8)
    codes[1::2] = -128
    codes[2::4, 64:128] = -128
    scale = torch.full((rows, cols // group), 1 / 128)
    w = QMatrix(Format.I8, rows, cols, codes, group, scale)
    sign = torch.where(torch.arange(cols) // 32 % 3 == 0, -1.0, 1.0)
    x = torch.stack([sign * (-1.0) ** t * (1 + t / 7) for t in range(m)])
    r8 = to_row8(w)
    assert int8_linear_error(ops.pool, ops.linear(x, r8), x, w) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, r8, acts="int16"), _acts_reference(x, SPLIT_MAX), w.dequantize()) < QUANT_EXACT_BOUND


@pytest.mark.parametrize("m", TOKENS + [65, 130])
@pytest.mark.parametrize("scales", ["f32", "f16"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("rows, cols, group", I8_ROW8_CASES)
def test_linear_on_i8_row8_weights(ops, rows, cols, group, symmetric, scales, m):
    """I8 in ROW8: the 16-row kernel where the build has it (odd last groups as a pair of
    themselves), the row-layout copy elsewhere; int8, int16 and float activations. int16 ones
    split into int8 pairs only where the build runs I8 on the kernel (kt.h KT_ROW8_I8)."""
    q = quantize_reference(_randn(rows, cols, seed=rows * cols + m), Format.I8, group, symmetric)
    w = _with_half_scales(q) if scales == "f16" else q
    r8 = to_row8(w)
    x = _randn(m, cols, seed=m + cols)
    assert int8_linear_error(ops.pool, ops.linear(x, r8), x, w) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, r8, acts="f32"), x, w.dequantize()) < QUANT_EXACT_BOUND
    lib = ops.kernels.lib
    levels = SPLIT_MAX if lib.kt_row8_kernel() & lib.KT_ROW8_I8 else 32767
    assert rel_err(ops.linear(x, r8, acts="int16"), _acts_reference(x, levels), w.dequantize()) < QUANT_EXACT_BOUND
    assert bf16_linear_error(ops.pool, ops.linear(x, r8, acts="bf16"), x, w, levels) < QUANT_EXACT_BOUND
