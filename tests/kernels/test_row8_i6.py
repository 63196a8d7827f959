"""I6 in the row8 layout (kt.h KT_I6): I8 matrices whose codes fit 6 bits (GGUF's Q6_K and Q5_K)
repacked by to_row8_i6, against kt.h's byte formula written out with numpy indexing; the kernels
on them against fp64 references (bounds and their reasons: test_linear.py, test_row8_layout.py):
the 8-row I6 kernel with int8 and split int16 activations where the build has it (kt.h
KT_ROW8_I6), copies as I8 rows elsewhere and for float activations. Two-level scales with int8
subs (kt.h KT_SCALE_KS), Q6_K's, on every path; and GGUF Q6_K / Q5_K bytes through the loader's
repack against gguf-py's own dequantization."""

import gguf
import numpy as np
import pytest
import torch

from kt_cli.ops import decode_layout
from kt_weights import k_scales
from kt_weights.gguf_repack import repack_q5_k, repack_q6_k
from kt_weights.layout import Format, LayoutError, QMatrix, fits_i6, from_row8, to_row8, to_row8_i6

from test_linear import QUANT_EXACT_BOUND, _acts_reference, _randn, rel_err
from test_row8_layout import SPLIT_MAX, _error_with_tiles

I6_CASES = [  # rows, cols, group: groups of 16 (Q6_K) and of 32 or more (Q5_K), odd 8-row groups
    (8, 64, 16), (16, 128, 32), (24, 256, 16), (40, 256, 64), (8, 512, 256), (64, 2048, 16), (32, 2048, 32),
]
TOKENS = [1, 2, 3, 4, 5, 8, 9, 16, 37, 65, 130]     # token tiles of 2 and 4, a chunk of 64 and past it


def _codes(rows: int, cols: int, symmetric: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-32, 32, (rows, cols), generator=g) if symmetric else torch.randint(0, 64, (rows, cols),
                                                                                             generator=g)


def _scales(rows: int, groups: int, kind: str, seed: int) -> torch.Tensor:
    """float32 scales: plain, halves (f16), or two-level (k: a half base per 8 groups times 0..63,
    ks: times -128..127, Q6_K's)"""
    g = torch.Generator().manual_seed(seed)
    if kind in ("k", "ks"):
        base = (torch.rand(rows, groups // 8, 1, generator=g) * 1e-3 + 1e-4).half().float()
        low, high = (0, 64) if kind == "k" else (-128, 128)
        sub = torch.randint(low, high, (rows, groups // 8, 8), generator=g).float()
        return (base * sub).reshape(rows, groups)
    s = torch.rand(rows, groups, generator=g) * 0.02 + 0.001
    return s.half().float() if kind == "f16" else s * (1 + 2 ** -16)


def _i8_matrix(rows: int, cols: int, group: int, symmetric: bool, kind: str, seed: int) -> QMatrix:
    groups = cols // group
    mins = None if symmetric else -_scales(rows, groups, "k" if kind == "ks" else kind, seed + 1) * 16
    return QMatrix(Format.I8, rows, cols, _codes(rows, cols, symmetric, seed).to(torch.int8), group,
                   _scales(rows, groups, kind, seed), mins)


def _i6_reference(w: QMatrix) -> np.ndarray:
    """kt.h: per 8-row group, block b at b * 192: low nibble of byte n = 32 j + 4 (r % 8) + i is
    column 32 b + 4 j + i of row r, its high nibble column 32 b + 16 + 4 j + i; high byte p (at
    128 + p) holds from bit 0 the top 2 bits of byte p's low, then high code, then byte p + 64's"""
    u = w.data.numpy().astype(np.int16) + (0 if w.min is not None else 32)
    rows, cols = u.shape
    out = np.zeros((rows // 8, cols // 32 * 192), np.uint8)
    for r in range(rows):
        for k in range(cols):
            b, c = k // 32, k % 32
            half, j, i = c // 16, (c % 16) // 4, c % 4
            n = 32 * j + 4 * (r % 8) + i
            block = out[r // 8, b * 192:(b + 1) * 192]
            block[n] |= (u[r, k] & 15) << (4 * half)
            block[128 + n % 64] |= (u[r, k] >> 4) << (4 * (n // 64) + 2 * half)
    return out.reshape(rows, cols // 4 * 3)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("rows, cols, group", I6_CASES[:5])
def test_to_row8_i6_follows_the_formula_and_round_trips(rows, cols, group, symmetric):
    w = _i8_matrix(rows, cols, group, symmetric, "f32", rows + cols)
    r8 = to_row8_i6(w)
    assert r8.format == Format.I6 and r8.row8 and r8.nbytes() < w.nbytes()
    assert np.array_equal(r8.data.numpy(), _i6_reference(w))
    back = from_row8(r8)
    assert back.format == Format.I8 and not back.row8
    assert torch.equal(back.data, w.data) and torch.equal(back.scale, w.scale)
    assert (back.min is None) == symmetric and (symmetric or torch.equal(back.min, w.min))
    assert torch.equal(r8.dequantize(), w.dequantize())


# two-level scales ("k", "ks") where a row has a multiple of 8 groups (kt.h KT_SCALE_K_GROUPS)
SCALE_CASES = [(*case, kind) for case in I6_CASES for kind in ("f32", "f16", "k", "ks")
               if kind in ("f32", "f16") or (case[1] // case[2]) % 8 == 0]


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("rows, cols, group, kind", SCALE_CASES)
def test_linear_on_i6_row8_weights(ops, rows, cols, group, kind, symmetric, m):
    """int8 and int16 activations on the I6 kernel (int16 as int8 pairs where the build has it),
    float32 ones on copies as I8 rows; bf16 ones as int16 (the AMX tiles do not take I6)"""
    w = _i8_matrix(rows, cols, group, symmetric, kind, rows * cols + m)
    r8 = to_row8_i6(w)
    expected_dtype = {"f32": torch.float32, "f16": torch.float16, "k": torch.uint8,
                      "ks": torch.int8 if symmetric else torch.uint8}[kind]
    if not symmetric and kind == "ks":      # mins factor unsigned, scales only signed: both take int8
        expected_dtype = torch.int8
    assert r8.scale.dtype == expected_dtype
    x = _randn(m, cols, seed=m + cols)
    lib = ops.kernels.lib
    levels = SPLIT_MAX if lib.kt_row8_kernel() & lib.KT_ROW8_I6 else 32767
    assert _error_with_tiles(ops.linear(x, r8), x, w, 127, False) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, r8, acts="f32"), x, w.dequantize()) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, r8, acts="int16"), _acts_reference(x, levels), w.dequantize()) < QUANT_EXACT_BOUND
    assert _error_with_tiles(ops.linear(x, r8, acts="bf16"), x, w, levels, False) < QUANT_EXACT_BOUND


@pytest.mark.parametrize("m", [1, 2, 5, 13])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_i6_extreme_codes_do_not_saturate(ops, m, symmetric):
    """Code 63 (and 0) against activations at their blocks' full scale, both signs, int8 and the
    split pairs' -128: without VNNI the kernel adds two loads' vpmaddubsw pair sums in int16
    (simd_row8_i6.h: at most 32256); adding more before vpmaddwd would saturate and miss the
    reference by far more than the bound"""
    rows, cols, group = 16, 256, 16
    codes = torch.full((rows, cols), 31 if symmetric else 63, dtype=torch.int8)
    codes[1::2] = -32 if symmetric else 0
    scale = torch.full((rows, cols // group), 1 / 64)
    w = QMatrix(Format.I8, rows, cols, codes, group, scale, None if symmetric else torch.full_like(scale, -0.5))
    sign = torch.where(torch.arange(cols) // 32 % 3 == 0, -1.0, 1.0)
    x = torch.stack([sign * (-1.0) ** t * (1 + t / 7) for t in range(m)])
    r8 = to_row8_i6(w)
    lib = ops.kernels.lib
    levels = SPLIT_MAX if lib.kt_row8_kernel() & lib.KT_ROW8_I6 else 32767
    assert _error_with_tiles(ops.linear(x, r8), x, w, 127, False) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, r8, acts="int16"), _acts_reference(x, levels), w.dequantize()) < QUANT_EXACT_BOUND


def test_fits_i6_takes_only_six_bit_codes():
    w = _i8_matrix(16, 128, 16, True, "f32", 3)
    assert fits_i6(w)
    for code, symmetric in ((32, True), (-33, True), (64, False), (-1, False)):
        v = _i8_matrix(16, 128, 16, symmetric, "f32", 3)
        v.data[5, 7] = code
        assert not fits_i6(v), (code, symmetric)
        with pytest.raises(LayoutError, match="does not fit I6"):
            to_row8_i6(v)
    assert not fits_i6(_i8_matrix(12, 128, 16, True, "f32", 3))       # rows % 8
    assert not fits_i6(_i8_matrix(16, 96, 16, True, "f32", 3))        # cols % 64
    assert not fits_i6(_i8_matrix(16, 192, 48, True, "f32", 3))       # group 48
    assert not fits_i6(to_row8(_i8_matrix(16, 128, 32, True, "f32", 3)))


def test_i6_exists_only_in_row8():
    r8 = to_row8_i6(_i8_matrix(16, 128, 16, True, "f32", 3))
    with pytest.raises(LayoutError, match="only in the row8 layout"):
        QMatrix(Format.I6, r8.rows, r8.cols, r8.data, r8.group, r8.scale)
    with pytest.raises(LayoutError, match="data has shape"):
        QMatrix(Format.I6, r8.rows, r8.cols, r8.data[:, :-1].contiguous(), r8.group, r8.scale, row8=True)


def test_native_check_refuses_bad_i6_descriptors(ops):
    """KT_I6: ROW8 only, group 16 or a multiple of 32; KT_SCALE_KS: ROW8 only, with its bases"""
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    w = to_row8_i6(_i8_matrix(8, 256, 16, True, "ks", 4))
    assert w.scale.dtype == torch.int8
    out, x = torch.empty(1, 8), torch.randn(1, 256)
    good = {"format": lib.KT_I6, "group": 16, "rows": 8, "cols": 256, "layout": lib.KT_LAYOUT_ROW8,
            "data": ffi.cast("void *", w.data.data_ptr()), "scale": ffi.cast("float *", w.scale.data_ptr()),
            "scale_type": lib.KT_SCALE_KS, "scale_base": ffi.cast("uint16_t *", w.scale_base.data_ptr())}
    cases = [({}, lib.KT_OK), ({"layout": lib.KT_LAYOUT_ROWS}, lib.KT_EINVAL),
             ({"layout": lib.KT_LAYOUT_TILES}, lib.KT_EINVAL), ({"group": 48}, lib.KT_EINVAL),
             ({"scale_base": ffi.NULL}, lib.KT_EINVAL), ({"rows": 12}, lib.KT_EINVAL), ({"format": 6}, lib.KT_EINVAL)]
    for change, want in cases:
        desc = ffi.new("kt_matrix *", {**good, **change})
        rc = lib.kt_linear(ops.pool.handle, ffi.cast("float *", out.data_ptr()), ffi.cast("float *", x.data_ptr()),
                           1, desc, lib.KT_ACTS_INT8)
        assert rc == want, change


def test_signed_two_level_factors():
    """int8 subs factor scales whose signs change within a block (Q6_K's), which uint8 subs
    refuse; the factors multiply back to the same float32 values"""
    t = _scales(24, 64, "ks", 7)
    assert (t < 0).any() and (t > 0).any()
    assert k_scales.factor(t) is None
    subs, bases = k_scales.factor(t, signed=True)
    assert subs.dtype == torch.int8 and torch.equal(k_scales.expand(subs, bases), t)
    wide = t.clone()
    wide[2, 1] = 200 * wide[2, 0] if wide[2, 0] != 0 else 1.0
    assert k_scales.factor(wide, signed=True) is None


def test_decode_layout_puts_six_bit_i8_in_i6(ops):
    w = _i8_matrix(16, 256, 16, True, "f32", 5)
    lib = ops.kernels.lib
    got = decode_layout(w, ops.pool)
    assert got.format == (Format.I6 if lib.kt_row8_kernel() & lib.KT_ROW8_I6 else Format.I8)
    assert decode_layout(w, ops.pool, i6=False).format == Format.I8
    wide = _i8_matrix(16, 256, 16, True, "f32", 5)
    wide.data[0, 0] = 100
    assert decode_layout(wide, ops.pool).format == Format.I8


def _gguf_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid K-quant bytes [rows, row bytes]: random codes and sub-block scales, f16 super-block
    scales of a realistic size"""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_weights, block_bytes), dtype=np.uint8)
    halves = rng.uniform(2e-4, 2e-3, size=(rows, cols // block_weights, 2)).astype(np.float16)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        blocks[..., 208:210] = halves[..., :1].view(np.uint8)
    else:
        blocks[..., 0:4] = halves.view(np.uint8).reshape(rows, -1, 4)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("m", [1, 2, 7, 70])
@pytest.mark.parametrize("qtype, repack", [(gguf.GGMLQuantizationType.Q6_K, repack_q6_k),
                                           (gguf.GGMLQuantizationType.Q5_K, repack_q5_k)], ids=["q6_k", "q5_k"])
def test_gguf_k_quants_run_as_i6_like_gguf_dequantizes(ops, qtype, repack, m):
    """GGUF Q6_K and Q5_K bytes through the loader's repack and decode_layout (I6 where the build's
    kernel takes it, two-level scales: int8 subs for Q6_K), against gguf-py's dequantization"""
    rows, cols = 64, 1024
    raw = _gguf_blocks(qtype, rows, cols, seed=m)
    w = decode_layout(repack(raw, cols), ops.pool)
    lib = ops.kernels.lib
    if lib.kt_row8_kernel() & lib.KT_ROW8_I6:
        assert w.format == Format.I6
        assert w.scale.dtype == (torch.int8 if qtype == gguf.GGMLQuantizationType.Q6_K else torch.uint8)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(rows, cols)
    assert torch.equal(w.dequantize(), reference)
    x = _randn(m, cols, seed=m)
    levels = SPLIT_MAX if lib.kt_row8_kernel() & lib.KT_ROW8_I6 else 32767
    assert rel_err(ops.linear(x, w, acts="int16"), _acts_reference(x, levels), reference) < QUANT_EXACT_BOUND
    assert rel_err(ops.linear(x, w, acts="f32"), x, reference) < QUANT_EXACT_BOUND
