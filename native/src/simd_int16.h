/* simd_int16.h: integer weights (I8, I4) against int16 activations
 * (KT_ACTS_INT16), included by simd_int.h for int_tile. The maths is
 * simd_int.h's with qa int16 (kt_acts.q16, in column order) and
 * sa[b] = max |x| over block b / 32767: per 32-column block, row and token,
 *   sum_b sa[b] * s[g(b)] * sum_{k in b}(qw * qa)
 * and int_tile adds the zero-point term from the group sums. I4 codes are used
 * as stored (0..15), I8 codes signed.
 *
 * Dense decode is why this exists: with float32 activations every weight is
 * converted to float before its FMA, and the kernels are compute-bound; here a
 * block of 32 weights is one vpmovzxbw (I4; two vpmovsxbw for I8), two vpmaddwd
 * and one vpaddd per row, then per row and token one vcvtdq2ps and one vfmadd.
 * vpmaddwd multiplies int16 pairs and adds each pair into an int32 lane:
 * |code| <= 128 and |qa| <= 32767, so a block's lane sums stay below 2^24.
 * With AVX512-VNNI, vpdpwssd multiplies and accumulates in one instruction.
 */
#ifndef KT_SIMD_INT16_H
#define KT_SIMD_INT16_H

#if defined(__AVX2__)

/* The 32 codes of the block at p as int16: columns 0-15 in c[0], 16-31 in c[1]
 * (an I4 block's byte j holds column j low and column j + 16 high, kt.h). */
KT_INLINE void codes_i16(__m256i c[2], const uint8_t *p, const int32_t fmt)
{
    if (fmt == KT_I4) {
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
        c[0] = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
        c[1] = _mm256_srli_epi16(b, 4);
    } else {
        c[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        c[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
    }
}

/* int32 lanes summing to the block's dot product with qa[0 .. 32) */
KT_INLINE __m256i dot_i16_block(const __m256i c[2], const int16_t *qa)
{
    __m256i a0 = _mm256_loadu_si256((const __m256i *)qa);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(qa + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), c[0], a0), c[1], a1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(c[0], a0), _mm256_madd_epi16(c[1], a1));
#endif
}

/* Whole 32-column blocks (group % 32 == 0): a row's codes are unpacked once per
 * block and meet every token of the tile. */
KT_INLINE void i16_blocks_256(__m256 acc[4][4], const int_rows *w, const int RT, const int16_t *q,
                              const float *sa, int64_t cols, int64_t group, const int TT, const int32_t fmt)
{
    const int64_t nb = cols / 32;
    for (int64_t g = 0; g < cols / group; g++) {
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
            const int64_t off = fmt == KT_I4 ? k0 / 2 : k0;
            if ((off & 63) == 0)
                prefetch_ahead(w, RT, off);
            __m256 st[4];
            for (int t = 0; t < TT; t++)
                st[t] = _mm256_set1_ps(sa[t * nb + k0 / 32]);
            for (int i = 0; i < RT; i++) {
                __m256i c[2];
                codes_i16(c, row_at(w, i, off), fmt);
                __m256 ws = _mm256_broadcast_ss(w->scale[i] + g);
                for (int t = 0; t < TT; t++) {
                    __m256 sum = _mm256_cvtepi32_ps(dot_i16_block(c, q + t * cols + k0));
                    acc[i][t] = _mm256_fmadd_ps(sum, _mm256_mul_ps(ws, st[t]), acc[i][t]);
                }
            }
        }
    }
}

/* I8 with group % 32 == 16 (a block may span two groups, and the last one may
 * be 16 columns): 16 columns a step, each inside one group and one block. */
KT_INLINE void i16_halves_256(__m256 acc[4][4], const int_rows *w, const int RT, const int16_t *q,
                              const float *sa, int64_t cols, int64_t group, const int TT)
{
    const int64_t nb = (cols + 31) / 32;
    for (int64_t k0 = 0; k0 < cols; k0 += 16) {
        for (int i = 0; i < RT; i++) {
            __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)row_at(w, i, k0)));
            __m256 ws = _mm256_set1_ps(w->scale[i][k0 / group]);
            for (int t = 0; t < TT; t++) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(q + t * cols + k0));
                __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(c, a));
                __m256 st = _mm256_set1_ps(sa[t * nb + k0 / 32]);
                acc[i][t] = _mm256_fmadd_ps(sum, _mm256_mul_ps(ws, st), acc[i][t]);
            }
        }
    }
}

KT_INLINE void int16_tile(float dots[4][4], const int_rows *w, const int RT, const kt_acts *a, int64_t t0,
                          const int TT, const int32_t fmt)
{
    int64_t cols = a->cols, group = a->group, nb = (cols + 31) / 32;
    const int16_t *q = a->q16 + t0 * cols;
    const float *sa = a->q_scale + t0 * nb;
    __m256 acc[4][4];
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            acc[i][t] = _mm256_setzero_ps();
    if (group % 32 == 0)
        i16_blocks_256(acc, w, RT, q, sa, cols, group, TT, fmt);
    else
        i16_halves_256(acc, w, RT, q, sa, cols, group, TT);
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            dots[i][t] = hsum_256(acc[i][t]);
}

#endif /* __AVX2__; the portable build runs int_tile_portable, which reads q16 too */
#endif
