"""kt_linear_f32 / kt_linear on each variant vs an fp64 torch reference.

Error measure: ||out - ref|| / || |x| @ |W|^T || over the whole output (fp64):
the size of the sum without cancellation, the scale f32 rounding errors follow.
  float formats: ref = x @ W.dequantize()^T in fp64; bound 1e-5 (f32 accumulation),
                 2e-2 for BF16 where the variant rounds activations to bf16 (vdpbf16ps).
  I8 / I4:       the kernels quantize activations to int8 with one scale per 32
                 values of a row (x ~= sa[k/32] * qa, as torch computes it below,
                 bit for bit), so ref = (sa * qa) @ W.dequantize()^T in fp64;
                 bound 1e-6 (f32 accumulation; measured <= 3.3e-7 on generic
                 and avx2; it was 1e-5 with per-row scales).
                 Against the unquantized x (half a quantum of each block per
                 element) the bound is 5e-3 (measured <= 3.3e-3; it was 1e-2).
                 With outliers (|x| = 1000-2000 among N(0, 1) values) per-row
                 scales give 1.3e-2 > 2x the bound: test_outliers_stay_in_their_block.
  acts="f32":    (kt_linear, KT_ACTS_F32) f32 activations for every format, so
                 ref = x @ W.dequantize()^T, bound 1e-6 for I8/I4 as well; m = 33
                 runs the prefill GEMM (>= 16 tokens) with a partial token tile.
  acts="int16":  (KT_ACTS_INT16) as int8 with int16 codes (scale max/32767): ref
                 = the int16-quantized x @ W.dequantize()^T, bound 1e-6; against
                 the unquantized x 2e-5 (measured <= 8.5e-6, int8 3.2e-3).
  acts="bf16":   (KT_ACTS_BF16) the same as int16 except for ROW8 matrices on pools
                 with AMX tiles (test_row8_layout.py): bit for bit here.
AMX tiles (amx variant, opt-in): the same bounds with the tile path enabled. ROW8
                 INT4 and I8 matrices meet the BF16 tiles there from 24 and 64 tokens,
                 through bf16 copies of x and of their rows (tile_weights;
                 test_row8_layout.py).
"""

import pytest
import torch

from kt_cli.errors import KtError
from kt_cli.ops import Pool
from kt_cli.ops.linear import kernel_layout
from kt_cli.ops.linear import linear as linear_on
from kt_weights.layout import Format, QMatrix, from_row8, quantize_reference, to_row8

BF16_ACT_VARIANTS = {"avx512_bf16", "amx"}
TOKENS = [1, 3, 8, 33]
FLOAT_SHAPES = [(1, 1), (5, 7), (37, 33), (64, 257)]
QUANT_CASES = [  # fmt, rows, cols, group
    (Format.I8, 1, 16, 16), (Format.I8, 37, 48, 16), (Format.I8, 33, 96, 32), (Format.I8, 64, 256, 64),
    (Format.I8, 9, 96, 48), (Format.I8, 20, 192, 32), (Format.I8, 24, 128, 128),
    (Format.I4, 1, 32, 32), (Format.I4, 37, 96, 32), (Format.I4, 33, 128, 64), (Format.I4, 64, 256, 128),
    (Format.I4, 9, 192, 96), (Format.I4, 12, 128, 128),
]
QUANT_EXACT_BOUND = 1e-6
QUANT_X_BOUND = 5e-3
QUANT_X16_BOUND = 2e-5
ACT_BLOCK = 32
FLOAT_DTYPES = {Format.F32: torch.float32, Format.BF16: torch.bfloat16, Format.F16: torch.float16}


def rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    x, w = x.double(), w.double()
    magnitude = (x.abs() @ w.abs().T).norm().clamp_min(1e-30)
    return ((out.double() - x @ w.T).norm() / magnitude).item()


# kt_internal.h KT_AMX_MIN_TOKENS_ROW8(_I8): from these token counts ROW8 matrices meet the BF16 tiles
AMX_ROW8_MIN_TOKENS = {Format.I4: 24, Format.I8: 64}


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    """t rounded to float32, then to bfloat16 (nearest even), as float64"""
    return t.float().bfloat16().double()


def tile_weights(w: QMatrix) -> torch.Tensor:
    """An INT4/I8 matrix as the amx variant copies ROW8 rows for the BF16 tiles
    (simd_amx_row8.h): s * c + off rounded once to float32 (one fma), then to bf16."""
    rows = from_row8(w) if w.row8 else w
    mins = None if rows.min is None else rows.min.double()
    return bf16_round(rows._dequantize_codes(rows.data, rows.scale.double(), mins))


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _acts_reference(x: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """Symmetric int8 (levels 127) or int16 (32767) with one f32 scale per 32 values
    of a row (the last block may be shorter)."""
    m, n = x.shape
    blocks = -(-n // ACT_BLOCK)
    xb = torch.nn.functional.pad(x, (0, blocks * ACT_BLOCK - n)).reshape(m, blocks, ACT_BLOCK)
    scale = xb.abs().amax(dim=2, keepdim=True) / float(levels)
    q = torch.round(xb / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(-levels, levels)
    return (q.double() * scale.double()).reshape(m, blocks * ACT_BLOCK)[:, :n]


def _rows_reference(x: torch.Tensor) -> torch.Tensor:
    """One scale per row, what the kernels used before per-block scales."""
    scale = x.abs().amax(dim=1, keepdim=True) / 127.0
    return torch.round(x / scale).clamp(-127, 127).double() * scale.double()


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("rows, cols", FLOAT_SHAPES)
@pytest.mark.parametrize("fmt", [Format.F32, Format.BF16, Format.F16], ids=lambda f: f.name)
def test_float_formats(ops, variant, fmt, rows, cols, m):
    w = QMatrix(fmt, rows, cols, _randn(rows, cols, seed=rows + cols).to(FLOAT_DTYPES[fmt]))
    x = _randn(m, cols, seed=m)
    out = ops.linear(x, w)
    assert out.shape == (m, rows)
    bound = 2e-2 if fmt == Format.BF16 and variant in BF16_ACT_VARIANTS else 1e-5
    assert rel_err(out, x, w.dequantize()) < bound


@pytest.mark.parametrize("m", [4, 15, 16, 17, 32, 33, 47, 70])
@pytest.mark.parametrize("rows, cols", [(45, 256), (8, 64), (3, 96), (29, 80)])
def test_bf16_weights_meet_bf16_rounded_tokens(ops, variant, rows, cols, m):
    """Where the variant rounds activations to bf16 (avx512_bf16, amx), against x rounded so
    (nearest even): the products are exact and only f32 accumulation remains. The row tiles
    run below 16 tokens, the pair GEMM (gemm_bf16.c) from 16 with cols % 32 == 0, across its
    8-row and 16/32-token tiles; cols 80 keeps the row tiles and their f32 tail. Other
    variants take x as it is."""
    w = QMatrix(Format.BF16, rows, cols, _randn(rows, cols, seed=rows * cols).to(torch.bfloat16))
    x = _randn(m, cols, seed=m + cols)
    ref, bound = x, 1e-5
    if variant in BF16_ACT_VARIANTS:
        ref, bound = bf16_round(x), 1e-6
        ref[:, cols // 32 * 32:] = x[:, cols // 32 * 32:].double()
    assert rel_err(ops.linear(x, w), ref, w.dequantize()) < bound


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("fmt, rows, cols, group", QUANT_CASES)
def test_quantized_formats(ops, fmt, rows, cols, group, symmetric, m):
    w = quantize_reference(_randn(rows, cols, seed=rows * cols), fmt, group, symmetric)
    x = _randn(m, cols, seed=m + cols)
    out = ops.linear(x, w)
    assert rel_err(out, _acts_reference(x), w.dequantize()) < QUANT_EXACT_BOUND
    assert rel_err(out, x, w.dequantize()) < QUANT_X_BOUND


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("fmt, rows, cols, group", QUANT_CASES)
def test_quantized_formats_exact_activations(ops, fmt, rows, cols, group, symmetric, m):
    """acts="f32": the activations stay f32 (weights dequantized in registers), so the
    result is x @ W.dequantize()^T to f32 rounding, with no int8 error to allow for."""
    w = quantize_reference(_randn(rows, cols, seed=rows * cols), fmt, group, symmetric)
    x = _randn(m, cols, seed=m + cols)
    x[:, 0] = 1000.0
    assert rel_err(ops.linear(x, w, acts="f32"), x, w.dequantize()) < QUANT_EXACT_BOUND


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("fmt, rows, cols, group", QUANT_CASES)
def test_quantized_formats_int16_activations(ops, fmt, rows, cols, group, symmetric, m):
    """acts="int16": integer products on int16 codes of x, one scale per 32 values,
    also with an outlier column (1000 among N(0, 1) values)."""
    w = quantize_reference(_randn(rows, cols, seed=rows * cols), fmt, group, symmetric)
    x = _randn(m, cols, seed=m + cols)
    assert rel_err(ops.linear(x, w, acts="int16"), x, w.dequantize()) < QUANT_X16_BOUND
    x[:, 0] = 1000.0
    out = ops.linear(x, w, acts="int16")
    assert rel_err(out, _acts_reference(x, 32767), w.dequantize()) < QUANT_EXACT_BOUND
    assert torch.equal(ops.linear(x, w, acts="bf16"), out)     # not ROW8: bf16 is int16


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("fmt", [Format.F32, Format.BF16, Format.F16], ids=lambda f: f.name)
def test_float_formats_take_f32_for_int16_and_bf16(ops, fmt, m):
    w = QMatrix(fmt, 37, 96, _randn(37, 96, seed=2).to(FLOAT_DTYPES[fmt]))
    x = _randn(m, 96, seed=3)
    assert rel_err(ops.linear(x, w, acts="int16"), x, w.dequantize()) < 1e-5
    assert torch.equal(ops.linear(x, w, acts="bf16"), ops.linear(x, w, acts="int16"))


def test_unknown_activation_kind_is_refused(ops):
    w = QMatrix(Format.F32, 4, 8, _randn(4, 8, seed=1))
    with pytest.raises(KtError, match="acts must be one of"):
        ops.linear(_randn(1, 8, seed=1), w, acts="int4")


@pytest.mark.parametrize("m", [5, 37])
@pytest.mark.parametrize("rows, cols", [(37, 96), (13, 33)])
@pytest.mark.parametrize("fmt", [Format.F32, Format.BF16, Format.F16], ids=lambda f: f.name)
def test_float_formats_exact_activations_skip_bf16_rounding(ops, fmt, rows, cols, m):
    """m >= 16 runs the exact path's GEMM (native/src/gemm.c), here with padded row
    panels and a column count no vector width divides."""
    w = QMatrix(fmt, rows, cols, _randn(rows, cols, seed=2).to(FLOAT_DTYPES[fmt]))
    x = _randn(m, cols, seed=3)
    assert rel_err(ops.linear(x, w, acts="f32"), x, w.dequantize()) < 1e-5


@pytest.mark.parametrize("fmt, group, symmetric", [
    (Format.I4, 32, False), (Format.I4, 128, True), (Format.I8, 16, True), (Format.I8, 32, True),
], ids=["i4-g32-asym", "i4-g128", "i8-g16", "i8-g32"])
def test_outliers_stay_in_their_block(ops, fmt, group, symmetric):
    """Real activations carry rare large outliers (|x| ~ 1000 beside values ~ 1): a
    per-row scale rounds the rest of the row to a few levels, a per-block scale only
    the outlier's own 32 values."""
    rows, cols, m = 96, 512, 5
    w = quantize_reference(_randn(rows, cols, seed=5), fmt, group, symmetric)
    x = _randn(m, cols, seed=6)
    x[:, 7] = 1000.0
    x[2, 300] = -2000.0
    out = ops.linear(x, w)
    assert rel_err(out, _acts_reference(x), w.dequantize()) < QUANT_EXACT_BOUND
    assert rel_err(out, x, w.dequantize()) < QUANT_X_BOUND
    per_row = _rows_reference(x) @ w.dequantize().double().T
    assert rel_err(per_row, x, w.dequantize()) > 2 * QUANT_X_BOUND


def test_zero_activations_give_zero(ops):
    w = quantize_reference(_randn(8, 64, seed=1), Format.I4, 32, symmetric=False)
    assert torch.equal(ops.linear(torch.zeros(2, 64), w), torch.zeros(2, 8))


def test_large_decode_and_prefill_shapes(ops):
    w = quantize_reference(_randn(300, 512, seed=3), Format.I4, 64)
    for m in (1, 70):
        x = _randn(m, 512, seed=m)
        assert rel_err(ops.linear(x, w), _acts_reference(x), w.dequantize()) < QUANT_EXACT_BOUND


@pytest.mark.parametrize("acts", ["int8", "f32"])
@pytest.mark.parametrize("row8", [False, True], ids=["rows", "row8"])
def test_long_prefill_splits_rows_into_short_tasks(ops, acts, row8):
    """512 tokens of a 2048-column I8 matrix: each row is ~1 MB of weight-times-token
    work, so linear.c caps a task at MAX_TASK_BYTES (~60 rows) rather than a quarter of
    a thread's share; the last task is a partial one."""
    w = quantize_reference(_randn(312, 2048, seed=7), Format.I8, 32)
    w = to_row8(w) if row8 else w
    x = _randn(512, 2048, seed=8)
    ref = _acts_reference(x) if acts == "int8" else x
    assert rel_err(ops.linear(x, w, acts=acts), ref, w.dequantize()) < QUANT_EXACT_BOUND


def _weight():
    return QMatrix(Format.F32, 4, 8, torch.randn(4, 8))


@pytest.mark.parametrize("x", [
    torch.randn(2, 9),                        # cols mismatch
    torch.randn(0, 8),                        # no tokens
    torch.randn(8),                           # 1-D
    torch.randn(2, 8).double(),               # dtype
    torch.randn(8, 2).T,                      # non-contiguous
    "not a tensor",
])
def test_bad_activations_raise(ops, x):
    with pytest.raises(KtError):
        ops.linear(x, _weight())


def test_weight_mutated_after_construction_raises(ops):
    w = quantize_reference(torch.randn(4, 64), Format.I4, 32)
    w.scale = torch.randn(4, 1)                 # wrong number of groups
    with pytest.raises(KtError):
        ops.linear(torch.randn(1, 64), w)
    with pytest.raises(KtError):
        ops.linear(torch.randn(1, 64), torch.randn(4, 64))


@pytest.mark.parametrize("field, value", [
    ("rows", 0), ("cols", -1), ("format", 9), ("group", 16), ("group", 48), ("rows", 1 << 62),
])
def test_native_check_refuses_bad_descriptors(ops, field, value):
    ffi, lib = ops.kernels.ffi, ops.kernels.lib
    w = quantize_reference(torch.randn(4, 64), Format.I4, 32)
    desc = ffi.new("kt_matrix *", {"format": int(Format.I4), "group": 32, "rows": 4, "cols": 64,
                                   "data": ffi.cast("void *", w.data.data_ptr()),
                                   "scale": ffi.cast("float *", w.scale.data_ptr())})
    setattr(desc, field, value)
    out, x = torch.empty(1, 4), torch.randn(1, 64)
    rc = lib.kt_linear_f32(ops.pool.handle, ffi.cast("float *", out.data_ptr()),
                           ffi.cast("float *", x.data_ptr()), 1, desc)
    assert rc == lib.KT_EINVAL
    assert lib.kt_linear_f32(ops.pool.handle, ffi.NULL, ffi.NULL, 1, desc) == lib.KT_EINVAL


# Shapes that take the AMX tile path on the amx variant with AMX tiles enabled (BF16
# with cols % 32 == 0, I8 with group % 32 == 0, >= 16 tokens), with a tail of rows
# (< 16) and tokens (not a multiple of 16) left to the AVX-512 kernels; plain tiles
# otherwise.
@pytest.fixture(scope="module", params=[False, True], ids=["plain", "amx-tiles"])
def tile_linear(request, variant, ops):
    if request.param and variant != "amx":
        pytest.skip(f"AMX tiles: only the amx variant (a CPU with AMX-TILE/INT8/BF16) has them, not {variant}")
    pool = Pool(ops.kernels, ops.threads, amx_tiles=request.param)
    return lambda x, w: linear_on(pool, x, w)


@pytest.mark.parametrize("m", [5, 16, 37])
@pytest.mark.parametrize("fmt, group, symmetric, tiled", [
    (Format.BF16, 0, True, False), (Format.I8, 32, True, False), (Format.I8, 64, True, False),
    (Format.I8, 128, False, False), (Format.I4, 128, False, False),
    (Format.I8, 32, True, True), (Format.I8, 128, False, True),
], ids=["bf16", "i8-g32", "i8-g64", "i8-g128-asym", "i4-g128-asym", "i8-g32-tiled", "i8-g128-asym-tiled"])
def test_tile_sized_shapes(tile_linear, variant, ops, fmt, group, symmetric, tiled, m):
    """tiled: the codes in KT_LAYOUT_TILES, from which the AMX I8 path gathers its 16 rows."""
    rows, cols = (44 if tiled else 45), 256
    w32 = _randn(rows, cols, seed=rows + m)
    if fmt == Format.BF16:
        w = QMatrix(fmt, rows, cols, w32.to(torch.bfloat16))
    else:
        w = quantize_reference(w32, fmt, group, symmetric)
    if tiled:
        w = kernel_layout(w, ops.pool)
        assert w.tiled
    x = _randn(m, cols, seed=m)
    out = tile_linear(x, w)
    if fmt == Format.BF16:
        bound = 2e-2 if variant in BF16_ACT_VARIANTS else 1e-5
        assert rel_err(out, x, w.dequantize()) < bound
    else:
        assert rel_err(out, _acts_reference(x), w.dequantize()) < QUANT_EXACT_BOUND


def test_amx_tiles_only_on_the_amx_variant(ops, variant, monkeypatch):
    """On by default on the amx variant, off with KT_AMX_TILES=0; refused elsewhere."""
    lib = ops.kernels.lib
    monkeypatch.delenv("KT_AMX_TILES", raising=False)
    if variant == "amx":
        assert lib.kt_pool_set_amx_tiles(ops.pool.handle, 1) == lib.KT_OK
        assert Pool(ops.kernels, 2).amx_tiles
    else:
        assert lib.kt_pool_set_amx_tiles(ops.pool.handle, 1) == lib.KT_EUNSUPPORTED
        assert not Pool(ops.kernels, 2).amx_tiles
        with pytest.raises(KtError, match="AMX"):
            Pool(ops.kernels, 2, amx_tiles=True)
    assert lib.kt_pool_set_amx_tiles(ops.pool.handle, 0) == lib.KT_OK
    monkeypatch.setenv("KT_AMX_TILES", "0")
    assert not Pool(ops.kernels, 2).amx_tiles
    assert lib.kt_pool_set_amx_tiles(ops.pool.handle, int(ops.pool.amx_tiles)) == lib.KT_OK
