/* simd_dequant.h: integer weights (I8, I4) against float32 activations, included
 * by linear.c only. This is the exact path (kt_linear with KT_ACTS_F32): the
 * activations are not quantized, so the result is W_dequantized . x up to f32
 * rounding, which the dense layers need where int8 activations would flip a
 * near-tie (see kt.h).
 *
 * Every VF_N columns of a weight row are dequantized in registers,
 *   w = s * c + z
 * with c the codes as floats (symmetric I4: code - 8, subtracted in integers),
 * s the group's scale and z its min (asymmetric) or 0, one FMA for all; then
 * each token of the tile adds w * x into its accumulator. A group never splits a
 * chunk: groups are multiples of 16 (I8) or 32 (I4), chunks 8 or 16 columns.
 *
 * I4 layout (kt.h): a 32-column block is 16 bytes; byte j holds column j in its
 * low nibble and column j + 16 in its high nibble. A chunk at column offset
 * j0 in its block (AVX2: 0, 8, 16, 24; AVX-512: 0, 16) zero-extends bytes
 * (j0 % 16) .. (j0 % 16) + VF_N - 1 to 32-bit lanes and keeps the low nibble
 * (j0 < 16) or shifts the high one down (j0 >= 16). The loops walk one code
 * block at a time (I4 32 columns, I8 16) with constant chunk offsets.
 *
 * The tile is RT rows x TT tokens of vector accumulators, like float_tile; it
 * needs simd_float.h's vf type and helpers.
 */
#ifndef KT_SIMD_DEQUANT_H
#define KT_SIMD_DEQUANT_H

#include "kt_internal.h"
#include "simd_float.h"

#if defined(__AVX512F__)
KT_INLINE vf dq_codes(const uint8_t *block, const int j0, const int32_t fmt, const int minus8)
{
    __m512i c;
    if (fmt == KT_I8) {
        c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + j0)));
    } else {
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)block));
        c = j0 < 16 ? _mm512_and_si512(b, _mm512_set1_epi32(0x0F)) : _mm512_srli_epi32(b, 4);
        if (minus8)
            c = _mm512_sub_epi32(c, _mm512_set1_epi32(8));
    }
    return _mm512_cvtepi32_ps(c);
}
#elif defined(__AVX2__)
KT_INLINE vf dq_codes(const uint8_t *block, const int j0, const int32_t fmt, const int minus8)
{
    __m256i c;
    if (fmt == KT_I8) {
        c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + j0)));
    } else {
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + j0 % 16)));
        c = j0 < 16 ? _mm256_and_si256(b, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(b, 4);
        if (minus8)
            c = _mm256_sub_epi32(c, _mm256_set1_epi32(8));
    }
    return _mm256_cvtepi32_ps(c);
}
#else
KT_INLINE vf dq_codes(const uint8_t *block, const int j0, const int32_t fmt, const int minus8)
{
    if (fmt == KT_I8)
        return (float)((const int8_t *)block)[j0];
    uint8_t byte = block[j0 % 16];
    int c = j0 < 16 ? (byte & 0x0F) : (byte >> 4);
    return (float)(minus8 ? c - 8 : c);
}
#endif


/* Rows [r, r + RT) of W against tokens x[0 .. TT): out[t * ldo + i] for row r + i. */
KT_INLINE void dq_tile(float *out, int64_t ldo, const kt_matrix *w, int64_t r, const int RT,
                       const float *x, const int TT, const int32_t fmt, const int asym)
{
    const int64_t cols = w->cols, group = w->group, n_groups = cols / group;
    const int minus8 = fmt == KT_I4 && !asym;
    const int STEP = fmt == KT_I4 ? 32 : 16;
    const int64_t stride = kt_chunk_stride(w);
    const int64_t ahead = w->layout == KT_LAYOUT_TILES ? KT_PREFETCH_CHUNKS * stride : RT * kt_row_bytes(w);
    const uint8_t *codes[4];
    const float *scale[4], *mins[4];
    for (int i = 0; i < RT; i++) {
        codes[i] = kt_row_start(w, r + i);
        scale[i] = w->scale + (r + i) * n_groups;
        mins[i] = asym ? w->min + (r + i) * n_groups : NULL;
    }
    vf acc[4][4];
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            acc[i][t] = vf_zero();
    for (int64_t g = 0; g < n_groups; g++) {
        vf s[4], z[4];
        for (int i = 0; i < RT; i++) {
            s[i] = vf_set1(scale[i][g]);
            z[i] = asym ? vf_set1(mins[i][g]) : vf_zero();
        }
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += STEP) {
            /* one code block (I4: 32 columns in 16 bytes; I8: 16 columns), its
             * chunks unrolled so every offset is a constant */
            const int64_t off = fmt == KT_I4 ? k0 / 2 : k0;
            if ((off & 63) == 0)          /* prefetch as simd_int.h's prefetch_ahead */
                for (int i = 0; i < RT; i++)
                    __builtin_prefetch(kt_code_at(codes[i], stride, off) + ahead);
            for (int j0 = 0; j0 < STEP; j0 += VF_N) {
                for (int i = 0; i < RT; i++) {
                    vf c = dq_codes(kt_code_at(codes[i], stride, off), j0, fmt, minus8);
                    vf wv = vf_fma(c, s[i], z[i]);
                    for (int t = 0; t < TT; t++)
                        acc[i][t] = vf_fma(wv, vf_load(x + t * cols + k0 + j0), acc[i][t]);
                }
            }
        }
    }
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            out[t * ldo + i] = vf_hsum(acc[i][t]);
}

#endif
