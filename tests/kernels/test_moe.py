"""Fused MoE experts (kt_moe_*) on every loadable kernel variant, against a plain
torch reference in float64 built from QMatrix.dequantize().

Error bound: ||out - ref|| / ||ref|| over the whole output.
  float weights (F32, F16, BF16 with f32 activations): < 1e-5 (f32 accumulation);
  integer weights (I8, I4): < 2e-2 against the exact reference - the error of
  quantizing x and the intermediate to symmetric int8 with one scale per 32
  values (kt.h), measured <= 1.3e-2 here (it was ~2e-2, bound 3e-2, with one
  scale per token); the weights add none, since the reference uses their
  dequantized values. They are also checked against a reference that applies
  that same activation quantization: < 1e-3 (was 2e-3), measured <= 3.2e-4
  (f32 vs f64 accumulation, plus the rare intermediate code that rounds the
  other way);
  BF16 on variants whose kernels round activations to bf16: < 3e-2.
  AMX tiles (amx variant, on unless KT_AMX_TILES=0): the same bounds. Units of
  >= 24 (INT4) or 64 (I8) tokens on ROW8 experts run on the BF16 tiles there, through bf16
  copies of x, the intermediate and the experts' rows (tile_weights), and the
  second reference rounds those units' operands so.
"""

from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch

from kt_cli import kernels
from kt_cli.errors import KtError
from kt_cli.ops import Ops
from kt_cli.ops.moe import MoEExperts
from kt_weights.layout import Format, QMatrix, quantize_reference

from test_linear import AMX_ROW8_MIN_TOKENS, bf16_round, tile_weights

E, H, I, K = 8, 384, 256, 4
ACT_BLOCK = 32
UNIT_TOKENS = 128       # moe.c: an expert's (token, k) pairs are cut into units of at most this many
BF16_ACT_VARIANTS = {"avx512_bf16", "amx"}

# name -> (format, group or None (per channel: group = cols), symmetric)
FORMATS = {
    "f32": (Format.F32, 0, True),
    "f16": (Format.F16, 0, True),
    "bf16": (Format.BF16, 0, True),
    "i8_channel": (Format.I8, None, True),
    "i8_g32": (Format.I8, 32, True),
    "i8_g32_asym": (Format.I8, 32, False),
    "i4_g32_sym": (Format.I4, 32, True),
    "i4_g32_asym": (Format.I4, 32, False),
    "i4_g64_sym": (Format.I4, 64, True),
    "i4_g64_asym": (Format.I4, 64, False),
    "i4_g128_sym": (Format.I4, 128, True),
    "i4_g128_asym": (Format.I4, 128, False),
    "i8_g16": (Format.I8, 16, True),
}
# gate and up in one format, down in another, as GGUF files mix them: a layer "a/b" has gate
# and up in format a and down in format b. llama.cpp's Q4_K_M keeps gate and up in Q4_K (kt I4
# g32 with mins) and the down projection of some layers in Q6_K (I8 g16)
MIXED = ["i4_g32_asym/i8_g16", "i4_g32_sym/i8_g32", "i8_g32/i4_g128_asym"]
SOME_FORMATS = ["f32", "bf16", "i8_g32", "i4_g32_asym"]
_FLOAT_DTYPES = {Format.F32: torch.float32, Format.F16: torch.float16, Format.BF16: torch.bfloat16}


@dataclass(frozen=True)
class MoEVariant:
    name: str
    ops: Ops


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The float64 references are small; torch's own threads only fight kt's pool for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=kernels.runnable_built())
def variant(request) -> MoEVariant:
    return MoEVariant(request.param, Ops(kernels.load_variant(request.param), threads=2))


def make_matrix(name: str, rows: int, cols: int, gen: torch.Generator) -> QMatrix:
    fmt, group, symmetric = FORMATS[name]
    w = torch.randn(rows, cols, generator=gen) / cols ** 0.5
    if fmt in _FLOAT_DTYPES:
        return QMatrix(fmt, rows, cols, w.to(_FLOAT_DTYPES[fmt]).contiguous())
    return quantize_reference(w, fmt, group or cols, symmetric)


def projection_formats(name: str) -> tuple[str, str, str]:
    """The format names of gate, up and down in layer `name` (one name, or "gate_up/down")"""
    gate_up, _, down = name.partition("/")
    return gate_up, gate_up, down or gate_up


@lru_cache(maxsize=None)
def experts(name: str) -> tuple[list, list, list]:
    gen = torch.Generator().manual_seed(1234)
    shapes = ((I, H), (I, H), (H, I))
    return tuple([make_matrix(fmt, *shape, gen) for _ in range(E)]
                 for fmt, shape in zip(projection_formats(name), shapes))


@lru_cache(maxsize=None)
def dequantized(name: str) -> tuple[list, list, list]:
    return tuple([m.dequantize().double() for m in mats] for mats in experts(name))


def routing(T: int, seed: int, masked: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    ids[torch.rand(T, K, generator=gen) < masked] = -1
    weights = torch.softmax(torch.randn(T, K, generator=gen), dim=1)
    return ids.contiguous(), weights.contiguous()


def activation_ref(g, u, activation, limit, alpha):
    if activation == "silu":
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (u.clamp(-limit, limit) + 1)


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 round trip with one f32 scale per 32 values of a row, as the
    kernels quantize activations (kt.h, kt_linear_f32); x is float64 here, so the
    values are first rounded to the float32 the kernels see."""
    x = x.float()
    m, n = x.shape
    xb = x.reshape(m, n // ACT_BLOCK, ACT_BLOCK)
    scale = xb.abs().amax(dim=2, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(xb / scale).clamp(-127, 127).double() * scale.double()).reshape(m, n)


@lru_cache(maxsize=None)
def on_tiles(name: str) -> tuple[list, list, list]:
    return tuple([tile_weights(m) for m in mats] for mats in experts(name))


def unit_operands(name: str, e: int, n: int, which: int, int8_acts: bool, tiles_from, float_from):
    """(activation rounding, weight) with which a unit of n tokens meets projection `which`
    (0 gate, 1 up, 2 down) of expert e; tiles_from and float_from are (gate and up, down)"""
    part = 0 if which < 2 else 1
    if tiles_from[part] is not None and n >= tiles_from[part]:
        return bf16_round, on_tiles(name)[which][e]
    exact = not int8_acts or (float_from[part] is not None and n >= float_from[part])
    return (lambda v: v) if exact else int8_blocks, dequantized(name)[which][e]


def moe_reference(name, x, ids, weights, activation="silu", limit=0.0, alpha=1.0, int8_acts=False,
                  tiles_from=(None, None), float_from=(None, None)):
    """int8_acts: x and the intermediate in int8 blocks, as the kernels quantize them; with
    tiles_from too, units of at least that many tokens in bf16 against the tiles' bf16 weights;
    with float_from, units of at least that many tokens exact (float32 activations). Both are
    pairs: (gate and up, down), which may differ in format."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)      # (t, k) order: the kernel's units
        for u in range(0, tok.numel(), UNIT_TOKENS):
            t, s = tok[u:u + UNIT_TOKENS], slot[u:u + UNIT_TOKENS]
            (acts, gate), (_, up), (down_acts, down) = (
                unit_operands(name, e, t.numel(), which, int8_acts, tiles_from, float_from) for which in range(3))
            xs = acts(x[t].double())
            h = down_acts(activation_ref(xs @ gate.T, xs @ up.T, activation, limit, alpha))
            out.index_add_(0, t, (h @ down.T) * weights[t, s, None].double())
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tiles_from(moe: MoEExperts) -> tuple[int | None, int | None]:
    """For (gate and up, down): the unit size from which the layer's ROW8 experts go to the BF16
    tiles (AMX tiles on), or None"""
    def one(mats: list) -> int | None:
        if not (moe.pool.amx_tiles and all(m.row8 for m in mats)):
            return None
        return AMX_ROW8_MIN_TOKENS[mats[0].format]
    return one([m for group in moe.weights[:-1] for m in group]), one(moe.weights[-1])


def assert_close(out, moe: MoEExperts, name: str, x, ids, weights, **act) -> None:
    fmts, variant = {FORMATS[f][0] for f in projection_formats(name)}, moe.pool.kernels.variant
    fmt = fmts.pop() if len(fmts) == 1 else Format.I8       # MIXED layers are integer ones
    exact = rel_err(out, moe_reference(name, x, ids, weights, **act))
    if fmt in (Format.I8, Format.I4):
        assert exact < 2e-2
        as_computed = moe_reference(name, x, ids, weights, int8_acts=True, tiles_from=tiles_from(moe),
                                    float_from=moe.float_acts_from, **act)
        assert rel_err(out, as_computed) < 1e-3
    elif fmt == Format.BF16 and variant in BF16_ACT_VARIANTS:
        assert exact < 3e-2
    else:
        assert exact < 1e-5


def layer(name: str, ops, **kwargs) -> MoEExperts:
    return MoEExperts(*experts(name), ops=ops, **kwargs)


def tokens(T: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T", [1, 3, 8, 37, 130])
@pytest.mark.parametrize("name", list(FORMATS))
def test_matches_reference(variant, name, T):
    moe = layer(name, variant.ops)
    x = tokens(T)
    ids, weights = routing(T, seed=T)
    out = moe.forward(x, ids, weights)
    assert out.shape == (T, H) and out.dtype == torch.float32
    assert_close(out, moe, name, x, ids, weights)


@pytest.mark.parametrize("T", [1, 3, 8, 37, 130])
@pytest.mark.parametrize("name", MIXED)
def test_down_in_its_own_format_matches_reference(variant, name, T):
    """GGUF files keep the down projection in another format than gate and up (Q4_K_M: Q4_K and
    Q6_K); each projection computes on its own format and activations"""
    moe = layer(name, variant.ops)
    assert moe.weights[0][0].format != moe.weights[-1][0].format
    x = tokens(T)
    ids, weights = routing(T, seed=T + 2)
    assert_close(moe.forward(x, ids, weights), moe, name, x, ids, weights)


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("name", ["i8_channel", "i8_g32_asym", "i4_g32_sym", "i4_g128_asym"])
def test_row_layout_matches_reference(variant, name, T):
    """MoEExperts puts I8/I4 experts in kernel layouts by default (kt.h KT_LAYOUT_TILES or
    ROW8); kernel_layouts=False keeps the row layout, which the kernels must compute as well."""
    laid, rows = layer(name, variant.ops), layer(name, variant.ops, kernel_layouts=False)
    assert all(m.in_memory_layout for mats in laid.weights for m in mats)
    assert not any(m.in_memory_layout for mats in rows.weights for m in mats)
    x = tokens(T)
    ids, weights = routing(T, seed=T)
    assert_close(rows.forward(x, ids, weights), rows, name, x, ids, weights)


@pytest.mark.parametrize("T", [1, 3, 8, 37, 130])
@pytest.mark.parametrize("row8", [True, False], ids=["row8", "tiled"])
@pytest.mark.parametrize("name", ["i4_g32_sym", "i4_g128_asym"])
def test_i4_layouts_match_reference(variant, name, row8, T):
    """I4 experts in ROW8 (the 8-row kernel, or a copy into rows where the build has no kernel
    and for the prefill GEMM) and tiled, both forced, on every variant."""
    moe = layer(name, variant.ops, row8=row8)
    assert all(m.row8 == row8 and m.tiled != row8 for mats in moe.weights for m in mats)
    x = tokens(T)
    ids, weights = routing(T, seed=T + 1)
    assert_close(moe.forward(x, ids, weights), moe, name, x, ids, weights)


@pytest.mark.parametrize("name", SOME_FORMATS)
def test_all_tokens_on_one_expert(variant, name):
    T = 130
    moe = layer(name, variant.ops)
    x = tokens(T)
    ids = torch.full((T, K), -1, dtype=torch.int32)
    ids[:, 1] = 5
    weights = torch.rand(T, K)
    assert_close(moe.forward(x, ids, weights), moe, name, x, ids, weights)


@pytest.mark.parametrize("name", SOME_FORMATS)
def test_duplicate_ids_in_top_k(variant, name):
    T = 130      # every (t, k) on expert 2: 520 pairs, more than one unit of tokens
    moe = layer(name, variant.ops)
    x = tokens(T)
    ids = torch.full((T, K), 2, dtype=torch.int32)
    ids[::3, 0] = 6
    weights = torch.rand(T, K)
    assert_close(moe.forward(x, ids, weights), moe, name, x, ids, weights)


def test_masked_ids_give_zero_rows(variant):
    T = 9
    moe = layer("i8_g32", variant.ops)
    x = tokens(T)
    ids, weights = routing(T, seed=3, masked=0.0)
    ids[2] = -1
    ids[5, :] = torch.tensor([-1, 3, -1, -7], dtype=torch.int32)
    out = moe.forward(x, ids, weights)
    assert torch.all(out[2] == 0)
    assert_close(out, moe, "i8_g32", x, ids, weights)
    all_masked = moe.forward(x, torch.full_like(ids, -1), weights)
    assert torch.all(all_masked == 0)


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("name", SOME_FORMATS)
def test_swiglu_clamp(variant, name, T):
    limit, alpha = 0.6, 1.702        # small limit so both clamps engage on N(0, 1) inputs
    moe = layer(name, variant.ops, activation="swiglu_clamp", clamp_limit=limit, alpha=alpha)
    x = tokens(T)
    ids, weights = routing(T, seed=11)
    act = dict(activation="swiglu_clamp", limit=limit, alpha=alpha)
    assert_close(moe.forward(x, ids, weights), moe, name, x, ids, weights, **act)
    clamped = moe_reference(name, x, ids, weights, **act)
    assert rel_err(moe_reference(name, x, ids, weights).float(), clamped) > 0.1


@pytest.mark.parametrize("name", ["bf16", "i8_g32"])
def test_silu_far_into_both_tails(variant, name):
    """Gate pre-activations of several tens either way: the vectorised SiLU takes exp of -|g|
    only, and picks 1 / (1 + e) or e / (1 + e) by the sign."""
    moe = layer(name, variant.ops)
    x = tokens(23) * 50
    ids, weights = routing(23, seed=13)
    assert_close(moe.forward(x, ids, weights), moe, name, x, ids, weights)


@pytest.mark.parametrize("name", ["bf16", "i4_g32_sym"])
def test_submit_equals_forward_and_is_deterministic(variant, name):
    moe = layer(name, variant.ops)
    x = tokens(37)
    ids, weights = routing(37, seed=5)
    first = moe.forward(x, ids, weights)
    job = moe.submit(x, ids, weights)
    assert torch.equal(job.wait(), first)
    assert torch.equal(job.wait(), first)
    assert torch.equal(moe.forward(x, ids, weights), first)


def test_bad_ids_are_refused(variant):
    moe = layer("f32", variant.ops)
    x = tokens(3)
    ids, weights = routing(3, seed=1)
    for bad in (E, 1 << 30):
        ids_bad = ids.clone()
        ids_bad[1, 2] = bad
        with pytest.raises(KtError, match="expert id"):
            moe.forward(x, ids_bad, weights)
        with pytest.raises(KtError, match="expert id"):
            moe.submit(x, ids_bad, weights)
    assert torch.isfinite(moe.forward(x, ids, weights)).all()


def test_bad_ids_leave_out_untouched(variant):
    moe = layer("f32", variant.ops)
    ffi, lib = variant.ops.kernels.ffi, variant.ops.kernels.lib
    x = tokens(3)
    ids, weights = routing(3, seed=1)
    ids[2, 3] = E
    out = torch.full((3, H), 7.0)
    ptr = lambda t, ctype: ffi.cast(ctype, t.data_ptr())       # noqa: E731
    for call in (lib.kt_moe_forward, lib.kt_moe_submit):
        rc = call(variant.ops.pool.handle, moe._native.handle, ptr(out, "float *"), ptr(x, "const float *"),
                  ptr(ids, "const int32_t *"), ptr(weights, "const float *"), 3, K)
        assert rc == -1 and torch.all(out == 7.0)


def test_bad_inputs_are_refused(variant):
    moe = layer("f32", variant.ops)
    x = tokens(4)
    ids, weights = routing(4, seed=2)
    bad_calls = [
        (x[:, :-1].contiguous(), ids, weights),          # hidden size
        (x.double(), ids, weights),                      # x dtype
        (x.t().contiguous().t(), ids, weights),          # not contiguous
        (x, ids.long(), weights),                        # ids dtype
        (x, ids[:3], weights),                           # T mismatch
        (x, ids, weights[:, :2].contiguous()),           # K mismatch
        (x, ids, weights.half()),                        # weights dtype
        (x[0], ids, weights),                            # x not 2-D
    ]
    for args in bad_calls:
        with pytest.raises(KtError):
            moe.forward(*args)


def test_bad_layers_are_refused(variant):
    gate, up, down = experts("i8_g32")
    with pytest.raises(KtError, match="experts"):
        MoEExperts(gate, up[:-1], down, ops=variant.ops)
    with pytest.raises(KtError, match="shape"):
        MoEExperts(gate, up, gate, ops=variant.ops)
    with pytest.raises(KtError, match="format"):
        MoEExperts(gate, experts("i4_g32_sym")[1], down, ops=variant.ops)
    with pytest.raises(KtError, match="format"):      # down may differ from gate and up, not within itself
        MoEExperts(gate, up, [experts("i4_g32_sym")[2][0], *down[1:]], ops=variant.ops)
    with pytest.raises(KtError, match="activation"):
        MoEExperts(gate, up, down, activation="gelu", ops=variant.ops)
    with pytest.raises(KtError, match="clamp_limit"):
        MoEExperts(gate, up, down, activation="swiglu_clamp", ops=variant.ops)


@pytest.mark.parametrize("name", ["f32", "i4_g32_asym"])
def test_thread_count_does_not_change_the_result(variant, name):
    x = tokens(130)
    ids, weights = routing(130, seed=9)
    outs = [MoEExperts(*experts(name), ops=Ops(variant.ops.kernels, threads=n)).forward(x, ids, weights)
            for n in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("name", ["bf16", "i8_channel", "i8_g32", "i8_g32_asym", "i4_g32_asym"])
def test_amx_tiles_match_reference(variant, name, monkeypatch):
    """Units of >= 16 tokens on BF16/I8 experts take the AMX tile path once enabled; I8
    experts kept out of ROW8 (which runs on AVX-512) and tiled, as their 16 rows are gathered."""
    if variant.name != "amx":
        pytest.skip(f"AMX tiles: only the amx variant (a CPU with AMX-TILE/INT8/BF16) has them, not {variant.name}")
    monkeypatch.setenv("KT_AMX_TILES", "1")
    ops = Ops(variant.ops.kernels, threads=2)
    assert ops.pool.amx_tiles
    moe = layer(name, ops, row8=False)
    for T in (16, 37, 130):
        x = tokens(T)
        ids, weights = routing(T, seed=T)
        assert_close(moe.forward(x, ids, weights), moe, name, x, ids, weights)
