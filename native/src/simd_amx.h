/* simd_amx.h: AMX tile kernels for BF16 and I8 weights (amx variant only),
 * included by linear.c. Used for full 16-row blocks of W when the activations
 * were prepared in AMX panels (kt_acts.amx_*: AMX tiles enabled on the pool,
 * m >= KT_AMX_MIN_TOKENS_*); the AVX-512 kernels do everything else.
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
 * Tiles: 0-3 = C, 4-5 = A, 6-7 = B (BF16 runs 2 x 2 blocks of 16 rows and 16 tokens;
 * I8 one block, C 0, A 4, B 6). Configuration (palette 1, 64-byte struct) is
 * loaded per call on the calling thread, per format, and released at the end.
 */
#ifndef KT_SIMD_AMX_H
#define KT_SIMD_AMX_H

#include "kt_internal.h"
#if defined(KT_AMX_BUILD)
#include <immintrin.h>
#include <string.h>
#include "simd_transpose.h"

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

/* Tiles 0-3 = C (16 x 64 bytes), 4-5 = A (16 rows x a_bytes), 6-7 = B (b_rows x 64 bytes). */
static void amx_configure(int a_bytes, int b_rows)
{
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    for (int t = 4; t < 6; t++) {
        cfg.colsb[t] = (uint16_t)a_bytes;
        cfg.rows[t] = 16;
    }
    for (int t = 6; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (uint8_t)b_rows;
    }
    _tile_loadconfig(&cfg);
}

/* 16 registers r[i] = weight row i's values for 16 tokens -> out[t * ldo + i], t < n_tok. */
static inline void amx_store_rows(float *out, int64_t ldo, __m512 r[16], int64_t n_tok)
{
    transpose16_ps(r);
    for (int64_t t = 0; t < n_tok && t < 16; t++)
        _mm512_storeu_ps(out + t * ldo, r[t]);
}

/* A stored C tile (16 rows x 16 tokens, f32) -> out, as amx_store_rows. */
static inline void amx_store_c(float *out, int64_t ldo, const float c[16][16], int64_t n_tok)
{
    __m512 r[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_load_ps(c[i]);
    amx_store_rows(out, ldo, r, n_tok);
}

/* Where the A tiles of up to 32 bf16 weight rows lie: rows [16 h, 16 h + 16) by columns
 * [32 kc, 32 kc + 32) at base + kc * kc_step + h * half_step (elements), rows `stride`
 * bytes apart. */
typedef struct amx_rows_at {
    const uint16_t *base;
    int64_t kc_step, half_step, stride;
} amx_rows_at;

/* The BF16 block below, in three steps: C tiles to zero; one column block kc (p0, p1: the
 * two token blocks' panels); the C tiles out. */
static inline void amx_bf16_zero(void)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline void amx_bf16_step(const amx_rows_at *w, const uint16_t *p0, const uint16_t *p1, int64_t kc,
                                 int two_rows, int two_tbs)
{
    amx_load(4, w->base + kc * w->kc_step, w->stride);
    amx_load(6, p0 + kc * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_tbs) {
        amx_load(7, p1 + kc * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (two_rows) {
        amx_load(5, w->base + w->half_step + kc * w->kc_step, w->stride);
        _tile_dpbf16ps(2, 5, 6);
        if (two_tbs)
            _tile_dpbf16ps(3, 5, 7);
    }
}

static inline void amx_bf16_store(float *out, int64_t ldo, const kt_acts *a, int64_t tb, int two_rows, int two_tbs)
{
    float c[16][16] __attribute__((aligned(64)));
    int64_t left = a->m - tb * 16;
    float *o = out + tb * 16 * ldo;
    _tile_stored(0, c, 64);
    amx_store_c(o, ldo, c, left);
    if (two_tbs) {
        _tile_stored(1, c, 64);
        amx_store_c(o + 16 * ldo, ldo, c, left - 16);
    }
    if (two_rows) {
        _tile_stored(2, c, 64);
        amx_store_c(o + 16, ldo, c, left);
        if (two_tbs) {
            _tile_stored(3, c, 64);
            amx_store_c(o + 16 * ldo + 16, ldo, c, left - 16);
        }
    }
}

/* BF16: C += A . B over all n_kc column blocks for up to 2 row blocks (h = 0, 1) and 2 token
 * blocks (tb, tb + 1): four independent accumulators, so the tile multiplies overlap instead
 * of waiting on one C, and each A and B tile load serves two. */
static void amx_bf16_block(float *out, int64_t ldo, const amx_rows_at *w, int64_t n_kc, int two_rows,
                           const kt_acts *a, int64_t tb, int two_tbs)
{
    const uint16_t *p0 = a->amx_bf16 + tb * n_kc * 512, *p1 = p0 + n_kc * 512;
    amx_bf16_zero();
    for (int64_t kc = 0; kc < n_kc; kc++)
        amx_bf16_step(w, p0, p1, kc, two_rows, two_tbs);
    amx_bf16_store(out, ldo, a, tb, two_rows, two_tbs);
}

/* Tile 4 = columns [32 b, 32 b + 32) of the 16 I8 rows from `row`: loaded in
 * place from the rows layout (row stride cols); the tiled layout (kt.h) has no
 * single stride across 16 rows, so those 16 x 32 bytes are gathered first. */
static inline void load_i8_rows_tile(const kt_matrix *w, int64_t row, int64_t b)
{
    if (w->layout != KT_LAYOUT_TILES) {
        amx_load(4, (const int8_t *)w->data + row * w->cols + b * 32, w->cols);
        return;
    }
    int8_t rows[AMX_ROWS][32] __attribute__((aligned(64)));
    int64_t stride = kt_chunk_stride(w);
    for (int i = 0; i < AMX_ROWS; i++)
        memcpy(rows[i], kt_code_at(kt_row_start(w, row + i), stride, b * 32), 32);
    amx_load(4, rows, 32);
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
        amx_load(6, panel + b * 512, 64);
        _tile_dpbssd(0, 4, 6);
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
    amx_store_rows(out + tb * 16 * ldo, ldo, acc, a->m - tb * 16);
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
    if (w->format == KT_BF16) {
        for (int64_t r = b0; r < b1; r += 2 * AMX_ROWS) {
            amx_rows_at rows = {(const uint16_t *)w->data + r * w->cols, 32, AMX_ROWS * w->cols, w->cols * 2};
            for (int64_t tb = 0; tb < n_tb; tb += 2)
                amx_bf16_block(out + (r - r0), ldo, &rows, w->cols / 32, b1 - r >= 2 * AMX_ROWS, a, tb,
                               n_tb - tb >= 2);
        }
    } else {
        for (int64_t r = b0; r < b1; r += AMX_ROWS)
            for (int64_t tb = 0; tb < n_tb; tb++)
                amx_i8_tile(out + (r - r0), ldo, w, r, a, tb);
    }
    _tile_release();
}

#endif
#endif
