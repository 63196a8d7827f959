"""Dense linear layers on the native kernels: out [m, rows] = x [m, cols] @ W^T."""

import torch

from kt_weights.layout import Format, QMatrix, can_row8, can_tile, fits_i6, to_row8, to_row8_i6

from .ffi_args import OpError, check, check_status, kt_matrix, matrix_2d, pointer
from .pool import Pool


ACTS = ("int8", "int16", "bf16", "f32")
# from this many tokens the float32 path runs a GEMM (native/src/kt_internal.h KT_GEMM_MIN_TOKENS)
GEMM_MIN_TOKENS = 16


def linear(pool: Pool, x: torch.Tensor, w: QMatrix, acts: str = "int8") -> torch.Tensor:
    """The activations I8/I4 weights meet (kt.h, kt_linear): "int8" one scale per
    32 values; "int16" the same in int16 (each value within max|x| / 65534 of its
    block); "bf16" x rounded to bf16 against bf16 copies of a ROW8 matrix's rows on
    the AMX BF16 tiles (pools with tiles on), else "int16"; "f32" float32. Float
    formats always take float32."""
    return BoundLinear(pool, w)(x, acts)


class BoundLinear:
    """linear() for one weight, its native descriptor built once: the layers call
    it for every token, and on small matrices building the descriptor and the
    checks' messages cost 3x the kernel (SmolLM2: ~10 us beside a 3 us kernel).
    x is still checked on every call before C sees it."""

    def __init__(self, pool: Pool, w: QMatrix):
        self.pool, self.w = pool, w
        self.ffi, self.lib = pool.kernels.ffi, pool.kernels.lib
        self.desc = kt_matrix(self.ffi, w)
        self.kinds = {"int8": self.lib.KT_ACTS_INT8, "int16": self.lib.KT_ACTS_INT16,
                      "bf16": self.lib.KT_ACTS_BF16, "f32": self.lib.KT_ACTS_F32}

    def __call__(self, x: torch.Tensor, acts: str = "int8") -> torch.Tensor:
        """x [m, cols] f32 contiguous on the cpu -> [m, rows] f32"""
        kind = self.kinds.get(acts)
        if kind is None:
            raise OpError(f"acts must be one of {ACTS}, not {acts!r}")
        if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype == torch.float32
                and x.device.type == "cpu" and x.shape[0] >= 1 and x.is_contiguous()):
            matrix_2d(x, torch.float32, "x")       # raises the precise error
        m, cols = x.shape
        if cols != self.w.cols:
            raise OpError(f"x has {cols} columns, the weight expects {self.w.cols}")
        out = torch.empty(m, self.w.rows, dtype=torch.float32)
        rc = self.lib.kt_linear(self.pool.handle, self.ffi.cast("float *", out.data_ptr()),
                                self.ffi.cast("const float *", x.data_ptr()), m, self.desc, kind)
        check_status(rc, "kt_linear")
        return out


def kernel_layout(w: QMatrix, pool: Pool | None = None) -> QMatrix:
    """w as the CPU kernels stream it fastest: I8/I4 tiled (kt.h KT_LAYOUT_TILES)
    where the shape allows (a copy of the codes, made by the native kt_tile_codes
    on the pool's threads), else w itself. Decode of one I4 2048 x 2048 matrix
    from DRAM on a 2-core Zen 3 guest: 1.6x faster tiled."""
    if w.in_memory_layout or not can_tile(w):
        return w
    pool = pool if pool is not None else _default_pool()
    ffi, lib = pool.kernels.ffi, pool.kernels.lib
    rows, row_bytes = w.data.shape
    check(w.data.is_contiguous() and w.data.device.type == "cpu", "weight codes must be contiguous on the cpu")
    data = torch.empty_like(w.data)
    rc = lib.kt_tile_codes(pool.handle, pointer(ffi, data, "void *"), pointer(ffi, w.data, "const void *"),
                           rows, row_bytes)
    check_status(rc, "kt_tile_codes")
    return QMatrix(w.format, w.rows, w.cols, data, w.group, w.scale, w.min, tiled=True)


def runs_on_row8_kernel(w: QMatrix, pool: Pool | None = None, prefill: bool = False) -> bool:
    """Whether the pool's build runs w's format on its 8-row kernel (kt.h kt_row8_kernels;
    prefill: INT4 on the 16-row prefill form)."""
    lib = (pool if pool is not None else _default_pool()).kernels.lib
    need = {Format.I8: lib.KT_ROW8_I8, Format.I6: lib.KT_ROW8_I6}.get(
        w.format, lib.KT_ROW8_I4_PREFILL if prefill else lib.KT_ROW8_I4)
    return bool(lib.kt_row8_kernel() & need)


def decode_layout(w: QMatrix, pool: Pool | None = None, row8: bool | None = None, i6: bool = True) -> QMatrix:
    """w as decode streams it fastest: I4 and I8 in the
    row8 layout (kt.h KT_LAYOUT_ROW8) where the shape allows and the build's 8-row kernel
    takes it (row8=None; True or False forces the choice), else kernel_layout(w). int8
    activations (experts) and int16 ones (dense layers, split into int8 pairs) both run
    the 8-row kernel; see bench/moe_layer.py --layouts and bench/linear.py (-row8 rows).
    I8 matrices whose codes fit 6 bits (GGUF's Q6_K and Q5_K: fits_i6) become I6 there instead
    where the build's kernel takes it (unless row8 or i6 is False): 6.6 bits a weight instead of
    8.6-10."""
    pool = pool if pool is not None else _default_pool()
    lib = pool.kernels.lib
    if row8 is not False and i6 and lib.kt_row8_kernel() & lib.KT_ROW8_I6 and fits_i6(w):
        return to_row8_i6(w)
    if row8 is None:
        row8 = runs_on_row8_kernel(w, pool)
    if row8 and not w.in_memory_layout and can_row8(w):
        return to_row8(w)
    return kernel_layout(w, pool)


def prefill_acts(w: QMatrix, pool: Pool | None = None) -> str:
    """The activations a dense layer gives w from GEMM_MIN_TOKENS tokens (kt_cli.layers.linear):
    "int16" for a ROW8 matrix the build runs on its 16-row VNNI form (INT4 with KT_ROW8_I4_PREFILL,
    I8 with KT_ROW8_I8, both summed by vpdpbusd: KT_ROW8_DPBUSD), as int8 pairs within 1/65278
    of a block's largest value; "f32" (the GEMM on dequantized panels) elsewhere. The pairs
    double the rows the kernel runs: with vpdpbusd that paid, the scaled Qwen3-MoE's Q4_0
    prefill ran 1.15x faster than the GEMM on a 2-core Zen 4 (bench/e2e.py pp512); with
    AVX512BW's vpmaddubsw (an AVX512-only Skylake-class host) it ran 0.8-0.9x, so the
    avx512 build keeps the GEMM. int8 would run it 1.4x faster but moves SmolLM2's logits
    past test_models_smollm2_gguf's bound. On a pool with AMX tiles those matrices take "bf16"
    (kt.h KT_ACTS_BF16): their full 16-row blocks on the BF16 tiles ran a 4096 x 2048 Q4_0-like
    matrix at 512 tokens 5.8x faster than the int16 pairs (2-core Sapphire Rapids-class guest)."""
    pool = pool if pool is not None else _default_pool()
    lib = pool.kernels.lib
    if not lib.kt_row8_kernel() & lib.KT_ROW8_DPBUSD:
        return "f32"
    if not (w.row8 and runs_on_row8_kernel(w, pool, prefill=True)):
        return "f32"
    return "bf16" if pool.amx_tiles else "int16"


# from this many tokens dense layers give ROW8 I8 matrices the float GEMM on builds with the widened
# kernel (kt.h KT_ROW8_I8_WIDE), not int16: 2 threads of a 2-core Zen 3, hot 4096 x 2048,
# 2048 x 4096 and 1536 x 2048 Q8_0-like matrices, int16 against the GEMM: 53-68 vs 28-44 GMAC/s at
# 16 tokens, 54-68 vs 45-59 at 32, 54-70 vs 52-66 at 48, about even at 64
WIDE_INT16_UNTIL = 48


def int16_until(w: QMatrix, pool: Pool | None = None) -> int:
    """The token count from which a dense layer stops giving w its decode activations (int16 for
    8-bit codes, kt_cli.layers.linear.decode_acts) for the prefill ones: WIDE_INT16_UNTIL for a
    ROW8 I8 matrix on a build that widens its codes (KT_ROW8_I8_WIDE, AVX2), else GEMM_MIN_TOKENS."""
    lib = (pool if pool is not None else _default_pool()).kernels.lib
    wide = w.format == Format.I8 and w.row8 and lib.kt_row8_kernel() & lib.KT_ROW8_I8_WIDE
    return WIDE_INT16_UNTIL if wide else GEMM_MIN_TOKENS


def _default_pool() -> Pool:
    from . import default
    return default().pool
