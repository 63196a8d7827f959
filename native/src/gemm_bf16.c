/* gemm_bf16.c: BF16 weights times bf16 activations in prefill, on AVX512-BF16 builds
 * (kt_matrix_rows_f32 with acts->bf16_pairs: m >= KT_BF16_GEMM_MIN_TOKENS, cols % 32 == 0,
 * and no AMX tiles taking the tokens).
 *
 * The row tiles of linear.c (simd_float.h bf16_tile_dp) take dot products along k: per
 * 32 columns they load a vector from each of 4 rows and each of 4 tokens for 16
 * vdpbf16ps, and read a block of W again from L2 for every 4 tokens. Here a vector holds
 * 16 tokens' column pairs (k, k+1) (the panels of simd_amx.h), and each row's pair
 * W[r, k:k+2], 4 bytes, is broadcast from memory into all 16 lanes:
 *   acc[i][h].lane j += W[r+i, k] x[16h+j, k] + W[r+i, k+1] x[16h+j, k+1]
 * A tile of BG_ROWS rows x 32 tokens takes 2 vector loads and BG_ROWS broadcasts per
 * 2 BG_ROWS vdpbf16ps, and W is read once per 32 tokens where it lies: a row of bf16 is
 * already a row of pairs, so nothing is packed.
 *
 * Panel addressing: the pair p of column block kc for token block tb is the 64 bytes at
 * panel + ((tb * n_kc + kc) * 16 + p) * 32 (uint16), lane j = token 16 tb + j.
 *
 * Prefetch: an MoE expert's W comes from DRAM, once a call. A panel of BG_ROWS rows is one
 * contiguous run of BG_ROWS * n_kc lines, so the first token tile of every panel asks for
 * the next panel's, BG_ROWS lines per column block: each line once, a whole panel ahead,
 * into L2. The first panel of a call asks, row by row, BG_AHEAD lines ahead of its reads.
 *
 * Tokens: the pair tiles take whole blocks of 16; a last block of at most BG_DOT_TOKENS
 * tokens goes to the row tiles on acts->bf16 instead (4 rows x up to 4 tokens, the panel's
 * rows still in L1/L2), where a pair tile would spend 16 lanes on it: an MoE expert at
 * T = 512 holds ~32 +- 6 tokens, so a third of the experts end in such a block. */
#include "kt_internal.h"
#include "simd_float.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define BG_ROWS 8
#define BG_DOT_TOKENS 8
/* Lines ahead of the one a row's broadcasts read that the tile asks for (a 64-byte line
 * is one column block: 32 bf16) */
#define BG_AHEAD 6

/* out[(16 tb + j) * ldo + i] for the tile's tokens; halves 2: tokens of blocks p0 and p1 */
static inline __attribute__((always_inline)) void bf16_pair_tile(
    float *out, int64_t ldo, const uint16_t *const rows[BG_ROWS], int n_rows, const uint16_t *p0,
    const uint16_t *p1, int64_t n_kc, int64_t n_tok, const int halves, const char *next, int first)
{
    __m512 acc[BG_ROWS][2];
    for (int i = 0; i < BG_ROWS; i++)
        for (int h = 0; h < halves; h++)
            acc[i][h] = _mm512_setzero_ps();
    for (int64_t kc = 0; kc < n_kc; kc++) {
        for (int i = 0; next && i < BG_ROWS; i++)
            _mm_prefetch(next + (kc * BG_ROWS + i) * 64, _MM_HINT_T1);
        for (int i = 0; first && i < BG_ROWS; i++)
            _mm_prefetch((const char *)(rows[i] + (kc + BG_AHEAD) * 32), _MM_HINT_T1);
        const uint16_t *x0 = p0 + kc * 512, *x1 = p1 + kc * 512;
        for (int p = 0; p < 16; p++) {
            __m512bh a0 = (__m512bh)_mm512_loadu_si512(x0 + p * 32);
            __m512bh a1 = halves == 2 ? (__m512bh)_mm512_loadu_si512(x1 + p * 32) : a0;
            for (int i = 0; i < BG_ROWS; i++) {
                int32_t pair;
                memcpy(&pair, rows[i] + kc * 32 + 2 * p, 4);
                __m512bh wb = (__m512bh)_mm512_set1_epi32(pair);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], wb, a0);
                if (halves == 2)
                    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], wb, a1);
            }
        }
    }
    float lanes[32];
    for (int i = 0; i < n_rows; i++) {
        for (int h = 0; h < halves; h++)
            _mm512_storeu_ps(lanes + 16 * h, acc[i][h]);
        for (int64_t t = 0; t < n_tok; t++)
            out[t * ldo + i] = lanes[t];
    }
}

#define DOT_TILE(RT, TT) bf16_tile_dp(out + t * ldo + r, ldo, row0 + r * cols * 2, cols * 2, RT, xb + t * cols, \
                                     NULL, cols, TT, none)
#define DOT_TT(RT, tt)                                                        \
    switch (tt) {                                                             \
    case 1: DOT_TILE(RT, 1); break;                                           \
    case 2: DOT_TILE(RT, 2); break;                                           \
    case 3: DOT_TILE(RT, 3); break;                                           \
    default: DOT_TILE(RT, 4); break;                                          \
    }

/* out[t * ldo + r] for rows [0, n_rows) from row0 and tokens [0, n) of xb (bf16 rows) */
static void dot_tokens(float *out, int64_t ldo, const char *row0, int n_rows, int64_t cols, const uint16_t *xb,
                       int64_t n)
{
    const kt_tile_prefetch none = {0, 1, 0};
    for (int64_t t = 0; t < n; t += 4) {
        int tt = n - t < 4 ? (int)(n - t) : 4;
        int r = 0;
        for (; r + 4 <= n_rows; r += 4)
            DOT_TT(4, tt)
        for (; r < n_rows; r++)
            DOT_TT(1, tt)
    }
}

void kt_bf16_gemm_rows(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                       const kt_acts *acts)
{
    const int64_t cols = w->cols, n_kc = cols / 32, m = acts->m;
    const uint16_t *data = w->data;
    const int64_t pair_end = m % 16 && m % 16 <= BG_DOT_TOKENS ? m / 16 * 16 : m;
    for (int64_t r = r0; r < r1; r += BG_ROWS) {
        int n_rows = r1 - r < BG_ROWS ? (int)(r1 - r) : BG_ROWS;
        const uint16_t *rows[BG_ROWS];
        for (int i = 0; i < BG_ROWS; i++)
            rows[i] = data + (r + (i < n_rows ? i : 0)) * cols;     /* missing rows: computed, not stored */
        const char *next_panel = r + 2 * BG_ROWS <= r1 ? (const char *)(data + (r + BG_ROWS) * cols) : NULL;
        for (int64_t t0 = 0; t0 < pair_end; t0 += 32) {
            const uint16_t *p0 = acts->bf16_pairs + (t0 / 16) * n_kc * 512;
            int64_t n_tok = pair_end - t0 < 32 ? pair_end - t0 : 32;
            float *o = out + t0 * ldo + (r - r0);
            const char *next = t0 == 0 ? next_panel : NULL;
            int first = t0 == 0 && r == r0;
            if (n_tok > 16)
                bf16_pair_tile(o, ldo, rows, n_rows, p0, p0 + n_kc * 512, n_kc, n_tok, 2, next, first);
            else
                bf16_pair_tile(o, ldo, rows, n_rows, p0, p0, n_kc, n_tok, 1, next, first);
        }
        if (pair_end < m)
            dot_tokens(out + pair_end * ldo + (r - r0), ldo, (const char *)(data + r * cols), n_rows, cols,
                       acts->bf16 + pair_end * cols, m - pair_end);
    }
}

#else

void kt_bf16_gemm_rows(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                       const kt_acts *acts)
{
    (void)out; (void)ldo; (void)w; (void)r0; (void)r1; (void)acts;
}

#endif
