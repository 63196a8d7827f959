/* simd_row8_pair.h: the prefill form of the 8-row INT4 kernel (simd_row8.h) on
 * AVX512-VNNI, two 8-row groups at a time, included by row8.c only.
 *
 * One 512-bit register holds the same 32-byte load of groups G (low half) and
 * G + 1 (high half): 4 bytes of each of 16 rows. A token's 4 activation bytes
 * broadcast to all 16 lanes, so one vpdpbusd serves both groups, and the
 * unpacking, the float scaling and the stores are shared by 16 rows instead of 8.
 * The 256-bit form ran ~180 instructions per block, 8 rows and 4 tokens, for 32
 * vpdpbusd: issue-bound at about half the vpdpbusd rate. The maths is
 * simd_row8.h's, lane for lane. */
#ifndef KT_SIMD_ROW8_PAIR_H
#define KT_SIMD_ROW8_PAIR_H

#include "simd_row8.h"

#if defined(KT_ROW8_KERNEL) && defined(__AVX512F__) && defined(__AVX512VNNI__)
#define KT_ROW8_PAIR_KERNEL 1

/* from PAIR_MIN_TOKENS rows of activations on; decode keeps the 8-row form, tuned for streaming */
enum { PAIR_TOKENS = 6, PAIR_MIN_TOKENS = 3 };

/* bytes [p0, p0 + 32) in the low half, [p1, p1 + 32) in the high half */
KT_INLINE __m512i load_pair(const uint8_t *p0, const uint8_t *p1)
{
    const __m512i low = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0));
    return _mm512_inserti64x4(low, _mm256_loadu_si256((const __m256i *)p1), 1);
}

/* 8 scales (halves or floats) at p0, then 8 at p1 */
KT_INLINE __m512 load_scales_pair(const char *p0, const char *p1, int half)
{
    if (half) {
        const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                                  _mm_loadu_si128((const __m128i *)p1), 1);
        return _mm512_cvtph_ps(h);
    }
    const __m512d low = _mm512_castpd256_pd512(_mm256_loadu_pd((const double *)p0));
    return _mm512_castpd_ps(_mm512_insertf64x4(low, _mm256_loadu_pd((const double *)p1), 1));
}

/* acc + u (unsigned bytes) . the 4 signed bytes at p in every lane, the broadcast folded into
 * vpdpbusd's memory operand ({1to16}); GCC 12 does not fold _mm512_set1_epi32 there and
 * spends a vpbroadcastd on each */
KT_INLINE __m512i dpbusd_bcast(__m512i acc, __m512i u, const int8_t *p)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}

/* The int32 dots of one block's 16 rows with TT tokens' activations (qb: token 0's piece),
 * two chains a token (low and high nibbles), as block_dots_wide */
KT_INLINE void pair_block_dots(__m512i dot[PAIR_TOKENS], const uint8_t *b0, const uint8_t *b1, const int8_t *qb,
                               int64_t cols, const int TT)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i hi_dot[PAIR_TOKENS];
    for (int t = 0; t < TT; t++)
        dot[t] = hi_dot[t] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i v = load_pair(b0 + 32 * j, b1 + 32 * j);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low4);
        for (int t = 0; t < TT; t++) {
            const int8_t *q = qb + t * cols + 4 * j;
            dot[t] = dpbusd_bcast(dot[t], lo, q);
            hi_dot[t] = dpbusd_bcast(hi_dot[t], hi, q + 32);
        }
    }
    for (int t = 0; t < TT; t++)
        dot[t] = _mm512_add_epi32(dot[t], hi_dot[t]);
}

/* Rows 8G..8G+15 for tokens t0..t0+TT-1 into out (token t at out[t * ldo], 16 floats) */
/* Where a token tile of a pair prefetches: the first streams its own codes ROW8_AHEAD bytes
 * ahead (stream); the later ones fetch lines [first, last) of the next pair's codes from
 * next into L2, per_block lines a block, so that its first tile finds them there instead of
 * waiting on memory (MoE layer, Q4_0, Zen 4: T=128 1.08x, T=512 1.03x). */
typedef struct pair_prefetch {
    int stream;
    const char *next;
    int64_t first, last, per_block;
} pair_prefetch;

KT_INLINE void prefetch_block(const pair_prefetch *pf, const uint8_t *b0, const uint8_t *b1, int64_t b)
{
    if (pf->stream) {
        __builtin_prefetch(b0 + ROW8_AHEAD);
        __builtin_prefetch(b0 + ROW8_AHEAD + 64);
        __builtin_prefetch(b1 + ROW8_AHEAD);
        __builtin_prefetch(b1 + ROW8_AHEAD + 64);
        return;
    }
    for (int64_t line = pf->first + b * pf->per_block, end = line + pf->per_block; line < end; line++)
        if (line < pf->last)
            __builtin_prefetch(pf->next + line * 64, 0, 2);
}

KT_INLINE void row8_pair(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a, int64_t t0,
                         const pair_prefetch *pf, const int TT)
{
    const int64_t cols = w->cols, nb = cols / 32, ng = cols / w->group, per_group = w->group / 32;
    const uint8_t *codes0 = (const uint8_t *)w->data + G * 8 * (cols / 2), *codes1 = codes0 + 8 * (cols / 2);
    const int half = w->scale_type == KT_SCALE_F16;
    const size_t scale_bytes = half ? 2 : 4, next_group = (size_t)(8 * ng) * scale_bytes;
    const char *scale = (const char *)w->scale + (size_t)(G * 8 * ng) * scale_bytes;
    const char *min = w->min ? (const char *)w->min + (size_t)(G * 8 * ng) * scale_bytes : NULL;
    const int8_t *q = a->q + t0 * cols;
    const float *sa = a->q_scale + t0 * nb, *gsum = a->q_group_sum + t0 * ng;
    __m512 acc[PAIR_TOKENS];
    for (int t = 0; t < TT; t++)
        acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0, b = 0; g < ng; g++) {
        const char *sg = scale + g * 8 * scale_bytes;
        const __m512 ws = load_scales_pair(sg, sg + next_group, half);
        for (int64_t end = b + per_group; b < end; b++) {
            const uint8_t *b0 = codes0 + b * ROW8_BLOCK_BYTES, *b1 = codes1 + b * ROW8_BLOCK_BYTES;
            prefetch_block(pf, b0, b1, b);
            __m512i dot[PAIR_TOKENS];
            pair_block_dots(dot, b0, b1, q + act_piece(b), cols, TT);
            for (int t = 0; t < TT; t++) {
                const __m512 scale_tb = _mm512_mul_ps(ws, _mm512_set1_ps(sa[t * nb + b]));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), scale_tb, acc[t]);
            }
        }
        const char *mg = min ? min + g * 8 * scale_bytes : NULL;
        const __m512 zero_point = mg ? load_scales_pair(mg, mg + next_group, half)
                                     : _mm512_mul_ps(ws, _mm512_set1_ps(-8.0f));
        for (int t = 0; t < TT; t++)
            acc[t] = _mm512_fmadd_ps(zero_point, _mm512_set1_ps(gsum[t * ng + g]), acc[t]);
    }
    for (int t = 0; t < TT; t++)
        _mm512_storeu_ps(out + t * ldo, acc[t]);
}

/* Rows [r0, r1) (multiples of 8) for tokens [c0, c1): pairs of 8-row groups, then
 * the odd group, if any, through the 8-row form */
/* The prefetch plan of token tile `tile` of `tiles` over pair G (pair_prefetch) */
KT_INLINE pair_prefetch pair_plan(const kt_matrix *w, int64_t G, int64_t r1, int64_t tile, int64_t tiles)
{
    const int64_t pair_bytes = 16 * (w->cols / 2), lines = pair_bytes / 64, nb = w->cols / 32;
    pair_prefetch pf = {tile == 0, NULL, 0, 0, 0};
    if (tile == 0 || G + 3 >= r1 / 8)
        return pf;
    const int64_t per_tile = (lines + tiles - 2) / (tiles - 1);
    pf.next = (const char *)w->data + (G + 2) * 8 * (w->cols / 2);
    pf.first = (tile - 1) * per_tile;
    pf.last = pf.first + per_tile < lines ? pf.first + per_tile : lines;
    pf.per_block = (per_tile + nb - 1) / nb;
    return pf;
}

/* Rows [r0, r1) (multiples of 8) for tokens [c0, c1): pairs of 8-row groups, then
 * the odd group, if any, through the 8-row form */
KT_INLINE void row8_pair_chunk_i4(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                  const kt_acts *a, int64_t c0, int64_t c1)
{
    const int64_t tiles = (c1 - c0 + PAIR_TOKENS - 1) / PAIR_TOKENS;
    int64_t G = r0 / 8;
    for (; G + 1 < r1 / 8; G += 2) {
        for (int64_t t0 = c0, tile = 0; t0 < c1; t0 += PAIR_TOKENS, tile++) {
            float *o = out + t0 * ldo + (G * 8 - r0);
            const pair_prefetch pf = pair_plan(w, G, r1, tile, tiles);
            switch (c1 - t0 < PAIR_TOKENS ? c1 - t0 : PAIR_TOKENS) {
            case 1: row8_pair(o, ldo, w, G, a, t0, &pf, 1); break;
            case 2: row8_pair(o, ldo, w, G, a, t0, &pf, 2); break;
            case 3: row8_pair(o, ldo, w, G, a, t0, &pf, 3); break;
            case 4: row8_pair(o, ldo, w, G, a, t0, &pf, 4); break;
            case 5: row8_pair(o, ldo, w, G, a, t0, &pf, 5); break;
            default: row8_pair(o, ldo, w, G, a, t0, &pf, 6); break;
            }
        }
    }
    if (G < r1 / 8)
        row8_chunk_i4(out + (G * 8 - r0), ldo, w, G * 8, r1, a, c0, c1);
}

/* Every token, in chunks of ROW8_CHUNK, as row8_rows_i4 */
static inline void row8_pair_rows_i4(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                     const kt_acts *a)
{
    for (int64_t c0 = 0; c0 < a->m; c0 += ROW8_CHUNK)
        row8_pair_chunk_i4(out, ldo, w, r0, r1, a, c0, c0 + ROW8_CHUNK < a->m ? c0 + ROW8_CHUNK : a->m);
}

#endif
#endif
