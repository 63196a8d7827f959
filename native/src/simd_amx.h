/* simd_amx.h: AMX tile kernels for BF16 and I8 weights (amx variant only),
 * included by linear.c. Used for full 16-row blocks of W when the activations
 * were prepared in AMX panels (kt_acts.amx_*: AMX tiles enabled on the pool,
 * m >= KT_AMX_MIN_TOKENS); the AVX-512 kernels do everything else.
 * Off unless kt_pool_set_amx_tiles enabled it (Python pools of the amx
 * variant do, unless KT_AMX_TILES=0).
 *
 * Roles: C (16 weight rows x 16 tokens) += A (16 weight rows x K) . B (K x 16 tokens).
 *   A is read straight from W: 16 rows of 64 (bf16) or 32 (int8) bytes, row
 *   stride = the row's bytes.
 *   B is a panel of the activations in the "VNNI" order the tile instructions
 *   expect: rows of 64 bytes, row k holding, for each token n, the 2 (bf16) or
 *   4 (int8) consecutive k-elements that pair with A's dword k:
 *     tdpbf16ps: C[i][n] += sum_{k<16} A[i].bf16[2k+j] * B[k].bf16[2n+j], j < 2
 *     tdpbssd:   C[i][n] += sum_{k<8}  A[i].s8[4k+j]   * B[k].s8[4n+j],   j < 4
 *   quant.c builds the panels: bf16 panel (tb, kc) covers tokens [16tb, 16tb+16)
 *   and columns [32kc, 32kc+32) (16 rows); int8 panel (tb, b) the 32 columns of
 *   activation block b (8 rows). Padding tokens are zero; their outputs are
 *   never stored.
 *
 * I8 (group % 32 == 0): one tdpbssd per 32-column activation block, C restarting
 * at zero, so each block's int32 sums meet their own token scales sa[b] (one per
 * C column, a 16-lane vector) and the row's group scale:
 *   acc[i] += (scale[i][g] * sa[b]) * C[i]                       per block b
 *   acc[i] += min[i][g] * groupsum[g]                            per group, asymmetric W
 *   out[t][i] = acc[i][t]
 *
 * Tiles: 0 = C, 1 = A, 2 = B. Configuration (palette 1, 64-byte struct) is
 * loaded per call on the calling thread, per format, and released at the end.
 */
#ifndef KT_SIMD_AMX_H
#define KT_SIMD_AMX_H

#include "kt_internal.h"
#if defined(KT_AMX_BUILD)
#include <immintrin.h>
#include <string.h>

#define KT_HAVE_AMX 1
#define AMX_ROWS 16

/* GCC's _tile_loadd is an asm statement that names no memory input, so stores to a
 * buffer that only a tile load reads (the gathered rows below) may be dropped or
 * moved past it. The empty asm with a memory clobber keeps them before the load. */
#define amx_load(tile, base, stride)                                              \
    do {                                                                          \
        __asm__ volatile("" ::: "memory");                                        \
        _tile_loadd(tile, base, stride);                                          \
    } while (0)

struct amx_tilecfg {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];     /* bytes per row of tile i */
    uint8_t rows[16];       /* rows of tile i */
};

/* C 16 x 64 bytes; A 16 rows x a_bytes; B b_rows x 64 bytes */
static void amx_configure(int a_bytes, int b_rows)
{
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.colsb[0] = 64;
    cfg.rows[0] = 16;
    cfg.colsb[1] = (uint16_t)a_bytes;
    cfg.rows[1] = 16;
    cfg.colsb[2] = 64;
    cfg.rows[2] = (uint8_t)b_rows;
    _tile_loadconfig(&cfg);
}

/* C tile (16 x 16, f32 or int32) -> out[t * ldo + i] for tokens t < n_tok. */
static void amx_store_f32(float *out, int64_t ldo, const float c[16][16], int n_tok)
{
    for (int t = 0; t < n_tok; t++)
        for (int i = 0; i < AMX_ROWS; i++)
            out[t * ldo + i] = c[i][t];
}

/* BF16: 16 rows starting at `row` against token block tb (all of K). */
static void amx_bf16_tile(float *out, int64_t ldo, const kt_matrix *w, int64_t row,
                          const kt_acts *a, int64_t tb)
{
    int64_t cols = w->cols, n_kc = cols / 32;
    const uint16_t *wrow = (const uint16_t *)w->data + row * cols;
    const uint16_t *panel = a->amx_bf16 + tb * n_kc * 512;
    float c[16][16] __attribute__((aligned(64)));
    _tile_zero(0);
    for (int64_t kc = 0; kc < n_kc; kc++) {
        amx_load(1, wrow + kc * 32, cols * 2);
        amx_load(2, panel + kc * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, 64);
    int64_t left = a->m - tb * 16;
    amx_store_f32(out + tb * 16 * ldo, ldo, (const float (*)[16])c, left < 16 ? (int)left : 16);
}

/* Tile 1 = columns [32 b, 32 b + 32) of the 16 I8 rows from `row`: loaded in
 * place from the rows layout (row stride cols); the tiled layout (kt.h) has no
 * single stride across 16 rows, so those 16 x 32 bytes are gathered first. */
static inline void load_i8_rows_tile(const kt_matrix *w, int64_t row, int64_t b)
{
    if (w->layout != KT_LAYOUT_TILES) {
        amx_load(1, (const int8_t *)w->data + row * w->cols + b * 32, w->cols);
        return;
    }
    int8_t rows[AMX_ROWS][32] __attribute__((aligned(64)));
    int64_t stride = kt_chunk_stride(w);
    for (int i = 0; i < AMX_ROWS; i++)
        memcpy(rows[i], kt_code_at(kt_row_start(w, row + i), stride, b * 32), 32);
    amx_load(1, rows, 32);
}

/* I8 (group % 32 == 0): 16 rows starting at `row` against token block tb. */
static void amx_i8_tile(float *out, int64_t ldo, const kt_matrix *w, int64_t row,
                        const kt_acts *a, int64_t tb)
{
    int64_t cols = w->cols, nb = cols / 32, n_groups = cols / w->group;
    const int8_t *panel = a->amx_q + tb * nb * 512;
    const float *sa = a->amx_scale + tb * nb * 16;
    const float *gsum = a->amx_gsum + tb * n_groups * 16;
    int32_t c[16][16] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int i = 0; i < AMX_ROWS; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        int64_t g = b * 32 / w->group;
        _tile_zero(0);
        load_i8_rows_tile(w, row, b);
        amx_load(2, panel + b * 512, 64);
        _tile_dpbssd(0, 1, 2);
        _tile_stored(0, c, 64);
        __m512 sab = _mm512_loadu_ps(sa + b * 16);
        for (int i = 0; i < AMX_ROWS; i++) {
            __m512 ci = _mm512_cvtepi32_ps(_mm512_load_si512(c[i]));
            __m512 s = _mm512_mul_ps(sab, _mm512_set1_ps(w->scale[(row + i) * n_groups + g]));
            acc[i] = _mm512_fmadd_ps(ci, s, acc[i]);
        }
    }
    for (int64_t g = 0; g < n_groups && w->min; g++) {
        __m512 gs = _mm512_loadu_ps(gsum + g * 16);
        for (int i = 0; i < AMX_ROWS; i++)
            acc[i] = _mm512_fmadd_ps(gs, _mm512_set1_ps(w->min[(row + i) * n_groups + g]), acc[i]);
    }
    float res[16][16] __attribute__((aligned(64)));
    for (int i = 0; i < AMX_ROWS; i++)
        _mm512_store_ps(res[i], acc[i]);
    int64_t left = a->m - tb * 16;
    amx_store_f32(out + tb * 16 * ldo, ldo, (const float (*)[16])res, left < 16 ? (int)left : 16);
}

/* Rows [b0, b1) (b1 - b0 a multiple of 16) of W, all tokens; out column 0 is row r0. */
static void amx_rows(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t b0,
                     int64_t b1, const kt_acts *a)
{
    int64_t n_tb = (a->m + 15) / 16;
    if (w->format == KT_BF16)
        amx_configure(64, 16);
    else
        amx_configure(32, 8);
    for (int64_t r = b0; r < b1; r += AMX_ROWS) {
        for (int64_t tb = 0; tb < n_tb; tb++) {
            if (w->format == KT_BF16)
                amx_bf16_tile(out + (r - r0), ldo, w, r, a, tb);
            else
                amx_i8_tile(out + (r - r0), ldo, w, r, a, tb);
        }
    }
    _tile_release();
}

#endif
#endif
