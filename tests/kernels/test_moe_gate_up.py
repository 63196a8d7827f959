"""Interleaved gate/up experts (kt.h kt_moe_desc.gate_up, kt_cli/ops/gate_up.py): the row
order against its definition, and the fused operator on it, including an intermediate size
that ends in a part chunk, against a float64 torch reference from the loaded matrices."""

import pytest
import torch

from kt_cli import kernels
from kt_cli.ops import Ops, gate_up
from kt_cli.ops.ffi_args import kt_matrix
from kt_cli.ops.moe import MoEExperts
from kt_weights.layout import Format, QMatrix, quantize_reference

E, H, K = 6, 256, 3


@pytest.fixture(scope="module", params=kernels.runnable_built())
def ops(request) -> Ops:
    return Ops(kernels.load_variant(request.param), threads=2)


def matrix(fmt: Format, rows: int, cols: int, gen: torch.Generator, group: int = 32, symmetric=False) -> QMatrix:
    w = torch.randn(rows, cols, generator=gen) / cols ** 0.5
    if fmt == Format.BF16:
        return QMatrix(fmt, rows, cols, w.bfloat16().contiguous())
    return quantize_reference(w, fmt, group, symmetric)


def layer_weights(fmt: Format, inter: int, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((inter, H), (inter, H), (H, inter))
    return tuple([matrix(fmt, *shape, gen) for _ in range(E)] for shape in shapes)


def test_chunk_matches_the_c_header(ops):
    assert gate_up.GATE_UP_CHUNK == ops.pool.kernels.lib.KT_GATE_UP_CHUNK


@pytest.mark.parametrize("inter", [16, 40, 256, 8])
def test_rows_follow_the_documented_order(inter):
    """Row 2c + j of gate_up is gate row c + j, row 2c + n + j up row c + j (n = min(16, inter - c))."""
    gen = torch.Generator().manual_seed(inter)
    gate, up = (matrix(Format.I8, inter, 64, gen) for _ in range(2))
    both = gate_up.interleave(gate, up)
    expect = []
    for c in range(0, inter, 16):
        n = min(16, inter - c)
        expect += [("g", r) for r in range(c, c + n)] + [("u", r) for r in range(c, c + n)]
    for row, (which, r) in enumerate(expect):
        src = gate if which == "g" else up
        assert torch.equal(both.data[row], src.data[r]) and torch.equal(both.scale[row], src.scale[r])
        assert torch.equal(both.min[row], src.min[r])
    g, u = gate_up.split(both.dequantize())
    assert torch.equal(g, gate.dequantize()) and torch.equal(u, up.dequantize())


def reference(weights, x, ids, w) -> torch.Tensor:
    gate, up, down = ([m.dequantize().double() for m in mats] for mats in weights)
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= 0:
                xt = x[t].double()
                h = torch.nn.functional.silu(gate[e] @ xt) * (up[e] @ xt)
                out[t] += w[t, k].double() * (down[e] @ h)
    return out


def routed(T: int):
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    ids[0, 0] = -1
    return x, ids, torch.softmax(torch.randn(T, K, generator=gen), dim=1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("T", [1, 5, 37])
@pytest.mark.parametrize("inter", [64, 256])
@pytest.mark.parametrize("fmt", [Format.I8, Format.I4])
def test_interleaved_experts_match_reference(ops, fmt, inter, T):
    """Quantized experts go to the operator interleaved (by default) in their kernel layout."""
    weights = layer_weights(fmt, inter)
    moe = MoEExperts(*weights, ops=ops)
    assert moe.interleaved and len(moe.weights) == 2
    assert all(m.rows == 2 * inter and m.in_memory_layout for m in moe.weights[0])
    x, ids, w = routed(T)
    assert rel_err(moe.forward(x, ids, w), reference(weights, x, ids, w)) < 2e-2


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("inter", [40, 8])
def test_a_part_chunk_matches_reference(ops, inter, T):
    """An intermediate size that is not a multiple of 16 ends gate_up in a part chunk: only
    float experts can have one (a quantized down's groups make inter a multiple of 16), and
    they are interleaved only when asked."""
    weights = layer_weights(Format.BF16, inter)
    moe = MoEExperts(*weights, ops=ops, interleave=True)
    assert moe.interleaved and all(m.rows == 2 * inter for m in moe.weights[0])
    x, ids, w = routed(T)
    bound = 3e-2 if ops.pool.kernels.variant in ("avx512_bf16", "amx") else 1e-5   # bf16 activations there
    assert rel_err(moe.forward(x, ids, w), reference(weights, x, ids, w)) < bound


def test_float_experts_stay_separate(ops):
    """BF16 experts keep borrowing the loaded matrices: interleaving would copy them all."""
    weights = layer_weights(Format.BF16, 40)
    moe = MoEExperts(*weights, ops=ops)
    assert not moe.interleaved and all(a is b for a, b in zip(moe.weights[0], weights[0]))


@pytest.mark.parametrize("fmt", [Format.I4, Format.BF16])
def test_dequantized_experts_are_the_loaded_ones(ops, fmt):
    """What device placement uploads (MoEExperts.dequantized) is each expert's gate, up and down."""
    weights = layer_weights(fmt, 64)
    moe = MoEExperts(*weights, ops=ops)
    for e in (0, E - 1):
        for got, m in zip(moe.dequantized(e), (mats[e] for mats in weights)):
            assert torch.equal(got, m.dequantize())


def test_a_gate_up_of_the_wrong_shape_is_refused(ops):
    """kt_moe_new checks gate_up's rows (2 inter) itself: C trusts no size it is handed."""
    gate, up, down = layer_weights(Format.I8, 64)
    ffi, lib = ops.pool.kernels.ffi, ops.pool.kernels.lib

    def descriptor(gate_up):
        arrays = [ffi.new("kt_matrix[]", E) for _ in range(2)]
        for e in range(E):
            arrays[0][e] = kt_matrix(ffi, gate_up[e])[0]
            arrays[1][e] = kt_matrix(ffi, down[e])[0]
        desc = ffi.new("kt_moe_desc *")
        desc.n_experts, desc.hidden, desc.inter = E, H, 64
        desc.gate_up, desc.down = arrays
        return desc, arrays

    good, borrowed = descriptor([gate_up.interleave(g, u) for g, u in zip(gate, up)])
    handle = lib.kt_moe_new(good)
    assert handle != ffi.NULL
    lib.kt_moe_free(handle)
    bad, borrowed = descriptor(gate)        # inter rows where 2 inter belong
    assert lib.kt_moe_new(bad) == ffi.NULL
