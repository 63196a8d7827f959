"""Which activations dense layers give quantized weights (kt_cli.layers.linear decode_acts,
dense_acts): in decode int8 against 4-bit codes, int16 against 8-bit ones; from
GEMM_MIN_TOKENS tokens (ROW8 I8 on builds that widen its codes: ops.WIDE_INT16_UNTIL) float32,
or int16 where the build's 8-row kernel runs the matrix in its
VNNI 16-row form, bf16 there on pools with AMX tiles (ops.prefill_acts); checked on the output
against fp64 references of each choice.
A decode plan gives its whole layer one kind (int16 if any projection takes it), and
the modules follow it."""

from types import SimpleNamespace

import pytest
import torch

from kt_cli import ops
from kt_cli.layers.decode_plan import _layer_acts
from kt_cli.layers.linear import GEMM_MIN_TOKENS, Linear, Target, dense_acts
from kt_weights.layout import Format, QMatrix, quantize_reference

CPU = Target(torch.device("cpu"), torch.float32)
BLOCK = 32
SPLIT_MAX = 32639   # kt_internal.h KT_SPLIT_MAX: int16 activations of a ROW8 matrix, as int8 pairs


def acts_reference(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x quantized symmetrically with one scale per 32 values (kt_acts), in fp64"""
    xb = x.double().reshape(x.shape[0], -1, BLOCK)
    scale = xb.abs().amax(dim=2, keepdim=True) / levels
    return (torch.round(xb / scale).clamp(-levels, levels) * scale).reshape(x.shape)


def rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.double() @ w.double().T
    return float((out.double() - ref).norm() / (x.double().abs() @ w.double().abs().T).norm())


def weight_of(fmt: Format, rows: int = 96, cols: int = 256, seed: int = 0) -> QMatrix:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    if fmt.quantized:
        return quantize_reference(w, fmt, 32, fmt == Format.I8)
    return QMatrix(fmt, rows, cols, w.to(torch.bfloat16))


def layer_of(fmt: Format, rows: int = 96, cols: int = 256, seed: int = 0) -> tuple[Linear, torch.Tensor]:
    q = weight_of(fmt, rows, cols, seed)
    return Linear(q, None, CPU), q.dequantize()


def tiles_reference(x: torch.Tensor, q: QMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """x and q as KT_ACTS_BF16 meets them on the BF16 tiles (kt.h): x in bf16, each weight
    s * c + off rounded once to float32 (an fma), then to bf16; all in fp64"""
    mins = None if q.min is None else q.min.double()
    w = q._dequantize_codes(q.data, q.scale.double(), mins)
    return x.float().bfloat16().double(), w.float().bfloat16().double()


@pytest.mark.parametrize("m", [1, 3, GEMM_MIN_TOKENS - 1])
@pytest.mark.parametrize("fmt, acts, levels", [(Format.I4, "int8", 127), (Format.I8, "int16", 32767)],
                         ids=["I4-int8", "I8-int16"])
def test_decode_activations_follow_the_weights(fmt, acts, levels, m):
    """Each within f32 rounding of its own quantized-x reference; I8's also within the int16
    bound of the unquantized x, which int8 activations miss ~100x."""
    linear, w = layer_of(fmt)
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
    assert linear.decode_acts == acts
    if acts == "int16" and linear.qweight.row8:
        levels = SPLIT_MAX          # I8 in ROW8 (AVX-512 builds): int16 as int8 pairs
    assert rel_err(linear(x), acts_reference(x, levels), w) < 1e-6
    if fmt == Format.I8:
        assert rel_err(linear(x), x, w) < 2e-5 < rel_err(acts_reference(x, 127).float() @ w.T, x, w)


@pytest.mark.parametrize("fmt, form", [(Format.I4, "KT_ROW8_I4_PREFILL"), (Format.I8, "KT_ROW8_I8")],
                         ids=["I4", "I8"])
def test_prefill_takes_int16_where_the_16_row_kernel_is(fmt, form):
    """int16 (as int8 pairs, SPLIT_MAX levels) for ROW8 matrices on builds whose 8-row kernel
    runs them in its VNNI 16-row form (kt.h kt_row8_kernels: KT_ROW8_I4_PREFILL for INT4,
    KT_ROW8_I8 for I8, with KT_ROW8_DPBUSD; the AVX512BW-only builds have both forms without
    VNNI and keep float32), float32 elsewhere; either within f32 rounding of its own reference.
    Where the pool runs AMX tiles (amx variant) those matrices take bf16 instead (KT_ACTS_BF16;
    96 rows: all on the tiles), within f32 rounding of the bf16 reference and within bf16's
    rounding (2^-9 of x and of each weight) of the exact one."""
    linear, w = layer_of(fmt)
    x = torch.randn(linear.int16_until + 3, w.shape[1], generator=torch.Generator().manual_seed(5))
    lib = ops.pool().kernels.lib
    vnni_form = bool(lib.kt_row8_kernel() & lib.KT_ROW8_DPBUSD)     # the AVX512BW-only form keeps the GEMM
    has_form = linear.qweight.row8 and vnni_form and bool(lib.kt_row8_kernel() & getattr(lib, form))
    tiles = has_form and ops.pool().amx_tiles
    assert linear.prefill_acts == ("bf16" if tiles else "int16" if has_form else "f32")
    assert dense_acts(x.shape[0], linear.decode_acts, linear.prefill_acts, linear.int16_until) == linear.prefill_acts
    if tiles:
        assert rel_err(linear(x), *tiles_reference(x, weight_of(fmt))) < 1e-6
        assert rel_err(linear(x), x, w) < 3e-3
        return
    reference = acts_reference(x, SPLIT_MAX) if has_form else x
    assert rel_err(linear(x), reference, w) < 1e-6
    assert rel_err(linear(x), x, w) < 2e-5


@pytest.mark.parametrize("m", [1, GEMM_MIN_TOKENS + 3])
def test_float_weights_take_float32(m):
    """BF16 weights: float32 activations at any m (int8 would have kt_linear round them to bf16
    on AVX512-BF16 builds)."""
    linear, w = layer_of(Format.BF16)
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
    assert linear.decode_acts == "f32" and dense_acts(m, linear.decode_acts) == "f32"
    assert rel_err(linear(x), x, w) < 1e-5


def fake_layer(qkv: Format, o: Format, gate_up: Format, down: Format):
    part = lambda fmt: layer_of(fmt, 64, 64)[0]
    attn = SimpleNamespace(qkv=SimpleNamespace(linears=[part(qkv)]), o_proj=part(o))
    return SimpleNamespace(attn=attn, mlp=SimpleNamespace(gate_up=SimpleNamespace(linears=[part(gate_up)]),
                                                          down=part(down)))


def parts(layer) -> list[Linear]:
    return [layer.attn.qkv.linears[0], layer.attn.o_proj, layer.mlp.gate_up.linears[0], layer.mlp.down]


def test_a_layer_takes_one_kind_of_activations():
    """Q4_K_M keeps some down projections in Q6_K (I8): the whole layer then takes int16,
    modules included, up to the fewest tokens any projection keeps it for; an MoE layer's plan
    covers only its attention projections."""
    mixed = fake_layer(Format.I4, Format.I4, Format.I4, Format.I8)
    assert _layer_acts(mixed, dense=True) == ("int16", GEMM_MIN_TOKENS)
    assert [(p.decode_acts, p.int16_until) for p in parts(mixed)] == [("int16", GEMM_MIN_TOKENS)] * 4
    plain = fake_layer(Format.I4, Format.I4, Format.I4, Format.I4)
    assert _layer_acts(plain, dense=True) == ("int8", GEMM_MIN_TOKENS)
    floats = fake_layer(Format.BF16, Format.I4, Format.I4, Format.I4)
    assert _layer_acts(floats, dense=True)[0] == "f32"
    moe = fake_layer(Format.I4, Format.I4, Format.I8, Format.I8)
    assert _layer_acts(moe, dense=False) == ("int8", GEMM_MIN_TOKENS)
    assert [p.decode_acts for p in parts(moe)] == ["int8", "int8", "int16", "int16"]
    eight_bit = fake_layer(Format.I8, Format.I8, Format.I8, Format.I8)
    until = parts(eight_bit)[0].int16_until
    assert _layer_acts(eight_bit, dense=True) == ("int16", until)


def test_i8_keeps_int16_up_to_its_int16_until():
    """On builds that widen I8 codes for int16 activations (kt.h KT_ROW8_I8_WIDE: avx2), a ROW8
    I8 layer keeps int16 (split pairs, SPLIT_MAX levels) up to ops.WIDE_INT16_UNTIL tokens, where
    it beats the float GEMM, and takes float32 from there; every other build switches at
    GEMM_MIN_TOKENS. Checked on the output against each choice's fp64 reference."""
    linear, w = layer_of(Format.I8)
    lib = ops.pool().kernels.lib
    wide = linear.qweight.row8 and bool(lib.kt_row8_kernel() & lib.KT_ROW8_I8_WIDE)
    assert linear.int16_until == (48 if wide else GEMM_MIN_TOKENS)
    for m in (GEMM_MIN_TOKENS, linear.int16_until - 1, linear.int16_until):
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
        int16 = m < linear.int16_until
        assert dense_acts(m, linear.decode_acts, linear.prefill_acts, linear.int16_until) == (
            "int16" if int16 else linear.prefill_acts)
        if linear.prefill_acts == "f32" or int16:
            reference = acts_reference(x, SPLIT_MAX if linear.qweight.row8 else 32767) if int16 else x
            assert rel_err(linear(x), reference, w) < 1e-6
