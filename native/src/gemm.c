/* gemm.c: the prefill path of the exact kernels (kt_linear with KT_ACTS_F32;
 * AVX2 and AVX-512 builds), for m >= KT_GEMM_MIN_TOKENS tokens: a float32 GEMM
 * on weights dequantized once per row panel.
 *
 * Why: dequantizing in registers (simd_dequant.h) costs a convert and an FMA per
 * weight vector per token tile of 4; here each weight is dequantized once per
 * call and a register tile reuses it for 16-32 tokens. Measured on a 2-core
 * Zen 3 guest, I4 8192 x 4096 with 64 tokens: 55-61 -> 106-110 GFLOP/s, about
 * as fast as the int8-activation tiles.
 *
 * Per row panel of GEMM_ROWS rows (the last one padded with zero rows):
 *   1. dequantize the rows into a per-thread panel [GEMM_ROWS][cols] f32
 *      (w = s * code + z for I8/I4, simd_dequant.h; converted for BF16/F16);
 *   2. for every token tile of KT_GEMM_TOKENS tokens, a GEMM_ROWS x KT_GEMM_TOKENS
 *      register tile of accumulators runs over all cols: per column k, two
 *      vectors of the tile's tokens (from acts->xt) and one broadcast weight per
 *      row, 2 * GEMM_ROWS FMAs;
 *   3. the tile is stored to out[t * ldo + row] for the real tokens.
 * acts->xt holds x transposed per token tile: xt[(tile * cols + k) * KT_GEMM_TOKENS + j]
 * = x[tile * KT_GEMM_TOKENS + j, k], zero for the padding tokens, so one tile's
 * sweep over k is one sequential stream (kt_acts_prepare fills it).
 *
 * Registers: AVX2 (16) 6 rows x 2 vectors = 12 accumulators + 2 token vectors +
 * 1 broadcast; AVX-512 (32) 12 x 2 = 24 + 3.
 */
#include <string.h>
#include "kt_internal.h"
#include "simd_float.h"
#include "simd_dequant.h"

#if defined(KT_GEMM_BUILD)

#if defined(__AVX512F__)
#define GEMM_ROWS 12
#else
#define GEMM_ROWS 6
#endif

/* Chunks (kt_chunk_stride) a row's dequantization requests ahead of the one it reads: the
 * panel's codes come from DRAM (an MoE expert is read once a call), and without it every
 * load waited on memory (MoE layer, I8, T=512, AVX2: the dequantization took 45% of the
 * GEMM's time). */
enum { DEQUANT_AHEAD = 16 };

/* Row r of W as float32 into dst[0, cols). */
static void dequantize_row(float *dst, const kt_matrix *w, int64_t r)
{
    const int64_t cols = w->cols;
    if (w->format == KT_F32 || w->format == KT_BF16 || w->format == KT_F16) {
        const void *row = (const char *)w->data + r * cols * (w->format == KT_F32 ? 4 : 2);
        int64_t k = 0;
        for (; k + VF_N <= cols; k += VF_N)
            vf_store(dst + k, vf_load_w(row, k, w->format));
        for (; k < cols; k++)
            dst[k] = weight_f(row, k, w->format);
        return;
    }
    const int64_t group = w->group, n_groups = cols / group;
    const int i4 = w->format == KT_I4, asym = w->min != NULL;
    const uint8_t *codes = kt_row_start(w, r);
    const int64_t stride = kt_chunk_stride(w);
    const float *scale = w->scale + r * n_groups, *mins = asym ? w->min + r * n_groups : NULL;
    const int step = i4 ? 32 : 16;
    for (int64_t g = 0; g < n_groups; g++) {
        vf s = vf_set1(scale[g]), z = asym ? vf_set1(mins[g]) : vf_zero();
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += step) {
            const int64_t off = i4 ? k0 / 2 : k0;
            const uint8_t *block = kt_code_at(codes, stride, off);
            if ((off & 63) == 0)
                __builtin_prefetch(block + DEQUANT_AHEAD * stride);
            for (int j0 = 0; j0 < step; j0 += VF_N) {
                vf c = i4 ? (asym ? dq_codes(block, j0, KT_I4, 0) : dq_codes(block, j0, KT_I4, 1))
                          : dq_codes(block, j0, KT_I8, 0);
                vf_store(dst + k0 + j0, vf_fma(c, s, z));
            }
        }
    }
}

/* Panel row stride in floats: cols rounded up to a cache line, plus one line
 * when that is a multiple of 1 KB, so the tile's GEMM_ROWS broadcast streams do
 * not all fall into the same L1 set (4 KB aliasing). */
static int64_t panel_stride(int64_t cols)
{
    int64_t ld = (cols + 15) / 16 * 16;
    return ld % 256 == 0 ? ld + 16 : ld;
}

/* One register tile: panel rows x tokens [t0, t0 + KT_GEMM_TOKENS) of tile xt, or only its
 * first VF_N tokens (halves 1) when no more are real: an MoE unit's last tile often holds a
 * few tokens, and half the FMAs then serve them (per column, 1 load and GEMM_ROWS broadcasts
 * for GEMM_ROWS FMAs: still bound by the FMAs). */
KT_INLINE void gemm_tile_n(float *out, int64_t ldo, const float *panel, int64_t ld, int64_t cols,
                           const float *xt, int64_t t0, int64_t n, int rows, const int halves)
{
    vf acc[GEMM_ROWS][2];
    for (int i = 0; i < GEMM_ROWS; i++)
        for (int h = 0; h < halves; h++)
            acc[i][h] = vf_zero();
    for (int64_t k = 0; k < cols; k++) {
        vf x[2];
        for (int h = 0; h < halves; h++)
            x[h] = vf_load(xt + k * KT_GEMM_TOKENS + h * VF_N);
        for (int i = 0; i < GEMM_ROWS; i++) {
            vf wb = vf_set1(panel[i * ld + k]);
            for (int h = 0; h < halves; h++)
                acc[i][h] = vf_fma(wb, x[h], acc[i][h]);
        }
    }
    float lanes[KT_GEMM_TOKENS];
    for (int i = 0; i < rows; i++) {
        for (int h = 0; h < halves; h++)
            vf_store(lanes + h * VF_N, acc[i][h]);
        for (int64_t t = 0; t < n; t++)
            out[(t0 + t) * ldo + i] = lanes[t];
    }
}

static void gemm_tile(float *out, int64_t ldo, const float *panel, int64_t ld, int64_t cols,
                      const float *xt, int64_t t0, int64_t m, int rows)
{
    int64_t n = m - t0 < KT_GEMM_TOKENS ? m - t0 : KT_GEMM_TOKENS;
    if (n <= VF_N)
        gemm_tile_n(out, ldo, panel, ld, cols, xt, t0, n, rows, 1);
    else
        gemm_tile_n(out, ldo, panel, ld, cols, xt, t0, n, rows, 2);
}

int kt_gemm_rows(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                 const kt_acts *acts)
{
    const int64_t cols = w->cols, ld = panel_stride(cols);
    float *panel = kt_thread_buffer(KT_BUF_GEMM_PANEL, (size_t)GEMM_ROWS * (size_t)ld * 4);
    if (!panel)
        return KT_ENOMEM;
    for (int64_t r = r0; r < r1; r += GEMM_ROWS) {
        int rows = r1 - r < GEMM_ROWS ? (int)(r1 - r) : GEMM_ROWS;
        for (int i = 0; i < rows; i++)
            dequantize_row(panel + i * ld, w, r + i);
        for (int i = rows; i < GEMM_ROWS; i++)
            memset(panel + i * ld, 0, (size_t)cols * 4);
        for (int64_t t0 = 0, tile = 0; t0 < acts->m; t0 += KT_GEMM_TOKENS, tile++)
            gemm_tile(out + (r - r0), ldo, panel, ld, cols, acts->xt + tile * cols * KT_GEMM_TOKENS, t0,
                      acts->m, rows);
    }
    return KT_OK;
}

#else

int kt_gemm_rows(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                 const kt_acts *acts)
{
    (void)out; (void)ldo; (void)w; (void)r0; (void)r1; (void)acts;
    return KT_EUNSUPPORTED;
}

#endif
