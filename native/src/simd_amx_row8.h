/* simd_amx_row8.h: ROW8 INT4 and I8 matrices on the AMX BF16 tiles (amx variant, tiles
 * enabled, from KT_AMX_MIN_TOKENS_ROW8(_I8) tokens), included by linear.c after simd_amx.h.
 * The rows are dequantized 32 at a time into a bf16 panel (one per thread, 64 * cols bytes,
 * L2-resident) that the BF16 tiles multiply with the tokens' bf16 panels. The panel holds
 * A tiles: row i, column 32 b + j at (b * 32 + i) * 32 + j, so each tile is 1 KB in one run
 * (rows of the row layout, 2 cols bytes apart, fell into one L1 set at cols = 2048). Each
 * code is expanded once per call and then serves every token, where the 16-row VNNI kernel
 * spends a multiply on every (row, token) pair again.
 *
 * Values: w = s * c + off, off = -8 s (INT4 symmetric), the group's min, or 0 (I8
 * symmetric); one f32 fma, rounded to bf16 (8 significant bits: within 2^-9 of the value);
 * x rounded to bf16 as for BF16 weights.
 *
 * Block b of an 8-row group (kt.h): dword 8j + r holds bytes 4j..4j+3 of row r's part of the
 * block, j < 4 for INT4 (128 bytes; low nibbles are columns 0-15 of the block, high nibbles
 * 16-31) and j < 8 for I8 (256 bytes). A vpermt2d of two 64-byte loads gathers 4 rows' 16
 * bytes, one row per 128-bit lane. INT4 codes then become words and, by vpermw, entries of
 * their row's 16-value bf16 table for the group, table[c] = bf16(s * c + off) (two rows
 * share a 32-word table); I8 codes go through f32.
 */
#ifndef KT_SIMD_AMX_ROW8_H
#define KT_SIMD_AMX_ROW8_H

#include "simd_amx.h"
#include "simd_row8.h"
#if defined(KT_HAVE_AMX)

#define AMX_PANEL_ROWS 32

/* Weight group g of 8-row group gi: row r's values are s[r] * code + off[r] */
static inline void row8_coeffs(const kt_matrix *w, int64_t gi, int64_t g, float s[8], float off[8])
{
    const row8_at at = row8_weights_at(w, gi);
    const __m256 vs = at_scales8(&at, g);
    __m256 voff = _mm256_setzero_ps();
    if (w->min)
        voff = at_mins8(&at, g);
    else if (w->format == KT_I4)
        voff = _mm256_mul_ps(vs, _mm256_set1_ps(-8.0f));
    _mm256_storeu_ps(s, vs);
    _mm256_storeu_ps(off, voff);
}

/* Index of the vpermt2d that puts dwords r, 8 + r, 16 + r, 24 + r in lane r - first (4 rows) */
static inline __m512i row8_gather_index(int first)
{
    return _mm512_add_epi32(_mm512_set_epi32(27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0),
                            _mm512_set1_epi32(first));
}

/* INT4: bf16 tables of the 8 rows for one weight group, two rows a table: words 0-15 are
 * row 2p's values of codes 0-15, words 16-31 row 2p + 1's */
static inline void row8_i4_tables(__m512i table[4], const float s[8], const float off[8])
{
    const __m512 code = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int p = 0; p < 4; p++) {
        __m512 even = _mm512_fmadd_ps(code, _mm512_set1_ps(s[2 * p]), _mm512_set1_ps(off[2 * p]));
        __m512 odd = _mm512_fmadd_ps(code, _mm512_set1_ps(s[2 * p + 1]), _mm512_set1_ps(off[2 * p + 1]));
        table[p] = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    }
}

/* Two rows' 16 code bytes (a ymm: row a, row b) -> each row's 32 bf16 values, from their
 * table (row8_i4_tables): row b's indices carry 16 */
static inline void row8_i4_two_rows(uint16_t *dst_a, uint16_t *dst_b, __m256i bytes, __m512i table)
{
    const __m512i words = _mm512_cvtepu8_epi16(bytes);
    const __m512i row_b = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    const __m512i low = _mm512_ternarylogic_epi32(words, _mm512_set1_epi16(0x0F), row_b, 0xEA); /* (w & 15) | b */
    const __m512i high = _mm512_or_si512(_mm512_srli_epi16(words, 4), row_b);
    const __m512i codes_a = _mm512_shuffle_i64x2(low, high, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i codes_b = _mm512_shuffle_i64x2(low, high, _MM_SHUFFLE(3, 2, 3, 2));
    _mm512_storeu_si512(dst_a, _mm512_permutexvar_epi16(codes_a, table));
    _mm512_storeu_si512(dst_b, _mm512_permutexvar_epi16(codes_b, table));
}

/* INT4 block (128 bytes) of 8 rows -> dst[r * 32 + k], k < 32 */
static inline void row8_i4_block(uint16_t *dst, const uint8_t *block, const __m512i table[4])
{
    const int64_t step = 32;     /* elements from one row of a panel block to the next */
    const __m512i lo = _mm512_loadu_si512(block), hi = _mm512_loadu_si512(block + 64);
    for (int first = 0; first < KT_ROW8_ROWS; first += 4) {
        const __m512i rows = _mm512_permutex2var_epi32(lo, row8_gather_index(first), hi);
        uint16_t *d = dst + first * step;
        row8_i4_two_rows(d, d + step, _mm512_castsi512_si256(rows), table[first / 2]);
        row8_i4_two_rows(d + 2 * step, d + 3 * step, _mm512_extracti64x4_epi64(rows, 1), table[first / 2 + 1]);
    }
}

/* One I8 row: its 16 bytes of columns 0-15 and of 16-31 -> 32 bf16 values */
static inline void row8_i8_row(uint16_t *dst, __m128i first16, __m128i last16, float s, float off)
{
    const __m512 vs = _mm512_set1_ps(s), voff = _mm512_set1_ps(off);
    const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first16)), vs, voff);
    const __m512 b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(last16)), vs, voff);
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* I8 block (256 bytes) of 8 rows -> dst[r * 32 + k], k < 32 */
static inline void row8_i8_block(uint16_t *dst, const uint8_t *block, const float s[8], const float off[8])
{
    const int64_t step = 32;     /* elements from one row of a panel block to the next */
    const __m512i q0 = _mm512_loadu_si512(block), q1 = _mm512_loadu_si512(block + 64);
    const __m512i q2 = _mm512_loadu_si512(block + 128), q3 = _mm512_loadu_si512(block + 192);
    for (int f = 0; f < KT_ROW8_ROWS; f += 4) {
        const __m512i index = row8_gather_index(f);
        const __m512i a = _mm512_permutex2var_epi32(q0, index, q1), b = _mm512_permutex2var_epi32(q2, index, q3);
        uint16_t *d = dst + f * step;
        row8_i8_row(d, _mm512_extracti32x4_epi32(a, 0), _mm512_extracti32x4_epi32(b, 0), s[f], off[f]);
        row8_i8_row(d + step, _mm512_extracti32x4_epi32(a, 1), _mm512_extracti32x4_epi32(b, 1), s[f + 1],
                    off[f + 1]);
        row8_i8_row(d + 2 * step, _mm512_extracti32x4_epi32(a, 2), _mm512_extracti32x4_epi32(b, 2), s[f + 2],
                    off[f + 2]);
        row8_i8_row(d + 3 * step, _mm512_extracti32x4_epi32(a, 3), _mm512_extracti32x4_epi32(b, 3), s[f + 3],
                    off[f + 3]);
    }
}

/* Weight group g of 8-row group gi (its codes at `group`) -> its blocks of the panel (block 0 at dst) */
static void row8_group_bf16(uint16_t *dst, const kt_matrix *w, const uint8_t *group, int64_t gi, int64_t g)
{
    const int64_t b0 = g * (w->group / 32), b1 = b0 + w->group / 32, block_step = AMX_PANEL_ROWS * 32;
    float s[8], off[8];
    row8_coeffs(w, gi, g, s, off);
    if (w->format == KT_I8) {
        for (int64_t b = b0; b < b1; b++)
            row8_i8_block(dst + b * block_step, group + b * 256, s, off);
        return;
    }
    __m512i table[4];
    row8_i4_tables(table, s, off);
    for (int64_t b = b0; b < b1; b++)
        row8_i4_block(dst + b * block_step, group + b * 128, table);
}

/* Rows [row, row + n) (row, n multiples of 8, n <= 32) into the panel (above) */
static void row8_panel_bf16(uint16_t *panel, const kt_matrix *w, int64_t row, int64_t n)
{
    const int64_t group_bytes = KT_ROW8_ROWS * kt_row_bytes(w), n_groups = w->cols / w->group;
    for (int64_t gi = row / KT_ROW8_ROWS; gi < (row + n) / KT_ROW8_ROWS; gi++)
        for (int64_t g = 0; g < n_groups; g++)
            row8_group_bf16(panel + (gi * KT_ROW8_ROWS - row) * 32, w, (const uint8_t *)w->data + gi * group_bytes,
                            gi, g);
}

/* Rows [b0, b1) (b0 - r0 and b1 - b0 multiples of 16) of a ROW8 matrix against the tokens'
 * bf16 panels (a->amx_bf16); out column 0 is row r0. KT_ENOMEM, nothing written, when the
 * thread's panel could not be allocated. The panel is filled before the tiles read it: the
 * vector units and the tiles did not overlap when interleaved (a column block of the next
 * strip per tile step ran 1.0x on a 2-core Sapphire Rapids-class guest). */
static int amx_row8_rows(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t b0, int64_t b1,
                         const kt_acts *a)
{
    uint16_t *panel = kt_thread_buffer(KT_BUF_AMX_PANEL, (size_t)AMX_PANEL_ROWS * (size_t)w->cols * 2);
    if (!panel)
        return KT_ENOMEM;
    kt_acts tokens = *a;        /* split int16 pairs (KT_ACTS_BF16) count 2 rows a token; the panel 1 */
    tokens.m = a->split ? a->m / 2 : a->m;
    const int64_t n_tb = (tokens.m + 15) / 16;
    const amx_rows_at rows = {panel, AMX_PANEL_ROWS * 32, AMX_ROWS * 32, 64};
    amx_configure(64, 16);
    for (int64_t r = b0; r < b1; r += AMX_PANEL_ROWS) {
        int64_t n = b1 - r < AMX_PANEL_ROWS ? b1 - r : AMX_PANEL_ROWS;
        row8_panel_bf16(panel, w, r, n);
        for (int64_t tb = 0; tb < n_tb; tb += 2)
            amx_bf16_block(out + (r - r0), ldo, &rows, w->cols / 32, n == 2 * AMX_ROWS, &tokens, tb,
                           n_tb - tb >= 2);
    }
    _tile_release();
    return KT_OK;
}

#endif
#endif
