"""kt_linear_f32 on each variant vs an fp64 torch reference.

Error measure: ||out - ref|| / || |x| @ |W|^T || over the whole output (fp64):
the size of the sum without cancellation, the scale f32 rounding errors follow.
  float formats: ref = x @ W.dequantize()^T in fp64; bound 1e-5 (f32 accumulation),
                 2e-2 for BF16 where the variant rounds activations to bf16 (vdpbf16ps).
  I8 / I4:       the kernels use per-token int8 activations (x ~= sa * qa), so
                 ref = (sa * qa) @ W.dequantize()^T in fp64; bound 1e-5.
                 Against the unquantized x (int8 rounding of x: half a quantum per
                 element) the bound is 1e-2.
"""

import pytest
import torch

from kt_cli.errors import KtError
from kt_weights.layout import Format, QMatrix, quantize_reference

BF16_ACT_VARIANTS = {"avx512_bf16", "amx"}
TOKENS = [1, 3, 8, 33]
FLOAT_SHAPES = [(1, 1), (5, 7), (37, 33), (64, 257)]
QUANT_CASES = [  # fmt, rows, cols, group
    (Format.I8, 1, 16, 16), (Format.I8, 37, 48, 16), (Format.I8, 33, 96, 32), (Format.I8, 64, 256, 64),
    (Format.I4, 1, 32, 32), (Format.I4, 37, 96, 32), (Format.I4, 33, 128, 64), (Format.I4, 64, 256, 128),
]
FLOAT_DTYPES = {Format.F32: torch.float32, Format.BF16: torch.bfloat16, Format.F16: torch.float16}


def rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    x, w = x.double(), w.double()
    magnitude = (x.abs() @ w.abs().T).norm().clamp_min(1e-30)
    return ((out.double() - x @ w.T).norm() / magnitude).item()


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _acts_reference(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(x / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(-127, 127)
    return q.double() * scale.double()


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


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("fmt, rows, cols, group", QUANT_CASES)
def test_quantized_formats(ops, fmt, rows, cols, group, symmetric, m):
    w = quantize_reference(_randn(rows, cols, seed=rows * cols), fmt, group, symmetric)
    x = _randn(m, cols, seed=m + cols)
    out = ops.linear(x, w)
    assert rel_err(out, _acts_reference(x), w.dequantize()) < 1e-5
    assert rel_err(out, x, w.dequantize()) < 1e-2


def test_zero_activations_give_zero(ops):
    w = quantize_reference(_randn(8, 64, seed=1), Format.I4, 32, symmetric=False)
    assert torch.equal(ops.linear(torch.zeros(2, 64), w), torch.zeros(2, 8))


def test_large_decode_and_prefill_shapes(ops):
    w = quantize_reference(_randn(300, 512, seed=3), Format.I4, 64)
    for m in (1, 70):
        x = _randn(m, 512, seed=m)
        assert rel_err(ops.linear(x, w), _acts_reference(x), w.dequantize()) < 1e-5


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


# Shapes that take the AMX tile path on the amx variant (BF16 with cols % 32 == 0,
# I8 with group % 64 == 0, >= 16 tokens), with a tail of rows (< 16) and tokens
# (not a multiple of 16) left to the AVX-512 kernels; plain tiles on other variants.
@pytest.mark.parametrize("m", [16, 37])
@pytest.mark.parametrize("fmt, group, symmetric", [
    (Format.BF16, 0, True), (Format.I8, 64, True), (Format.I8, 128, False), (Format.I4, 128, False),
], ids=["bf16", "i8-g64", "i8-g128-asym", "i4-g128-asym"])
def test_tile_sized_shapes(ops, variant, fmt, group, symmetric, m):
    rows, cols = 45, 256
    w32 = _randn(rows, cols, seed=rows + m)
    if fmt == Format.BF16:
        w = QMatrix(fmt, rows, cols, w32.to(torch.bfloat16))
    else:
        w = quantize_reference(w32, fmt, group, symmetric)
    x = _randn(m, cols, seed=m)
    out = ops.linear(x, w)
    if fmt == Format.BF16:
        bound = 2e-2 if variant in BF16_ACT_VARIANTS else 1e-5
        assert rel_err(out, x, w.dequantize()) < bound
    else:
        assert rel_err(out, _acts_reference(x), w.dequantize()) < 1e-5
