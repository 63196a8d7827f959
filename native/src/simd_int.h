/* simd_int.h: row kernels for the integer weight formats (I8, I4), included by
 * linear.c only. Dequantize-free: weight codes meet the int8 activations in
 * integer dot products, one per 32-value activation block, scaled in float.
 *
 * Maths, for token t with x[t, k] ~= sa[b] * qa[k] (kt_acts: one scale sa[b] per
 * block b of 32 values) and row r with, per group g, scale s[g], min mn[g]
 * (asymmetric) and codes qw:
 *   I8 symmetric    w = s*qw          dot = sum_b sa[b] * s[g(b)] * sum_{k in b}(qw*qa)
 *   I8 asymmetric   w = s*qw + mn     dot = (the same) + sum_g mn[g] * gsum[g]
 *   I4 symmetric    w = s*(qw - 8)    dot = (the same) - 8 * sum_g s[g] * gsum[g]
 *   I4 asymmetric   w = s*qw + mn     dot = (the same) + sum_g mn[g] * gsum[g]
 * gsum[g] = sum over group g of sa[b] * qa[k] (kt_acts.q_group_sum), so the result
 * is exactly W . dequantized(qa), up to f32 rounding.
 * Groups are multiples of 32 except for I8 (multiples of 16), where one block can
 * span two groups: its first 16 columns take one group's scale, the last 16 the
 * next one's (s[g(b)] becomes a per-lane vector, see block_scales_256).
 *
 * Per block, row and token: the int32 sum of the block goes to float once
 * (vcvtdq2ps) and is added with its combined scale sa[b] * s[g] (vmulps, vfmadd)
 * into a float accumulator kept across the whole row; the zero-point term is added
 * in scalars, once per group.
 *
 * Integer products (x86): vpmaddubsw multiplies unsigned bytes by signed bytes,
 * adding pairs into int16; I4 codes are 0..15 already unsigned (pair sums
 * <= 2*15*127), I8 codes become |qw| with the sign moved onto qa (vpsignb; pair
 * sums <= 2*128*127 < 32767, no saturation). vpmaddwd by 1 widens to int32.
 * With AVX512-VNNI, vpdpbusd does all three steps in one instruction.
 * Lanes: after either, int32 lane j of a 256-bit block sum holds columns
 * 4j..4j+3 of the block, so lanes 0-3 are its first 16 columns, 4-7 the last 16.
 */
#ifndef KT_SIMD_INT_H
#define KT_SIMD_INT_H

#include "kt_internal.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef KT_INLINE
#define KT_INLINE static inline __attribute__((always_inline))
#endif

/* What one tile reads: RT weight rows (codes, scales, mins) and TT tokens. */
typedef struct int_rows {
    const uint8_t *codes[4];
    const float *scale[4];
    const float *min[4];
} int_rows;

#if defined(__AVX2__)

KT_INLINE float hsum_256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* int32 sums of 4-byte products of unsigned u and signed s (see the lanes above). */
KT_INLINE __m256i block_dot_u8s8(__m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* 32 bytes, or 16 zero-extended for a last block of 16 columns */
KT_INLINE __m256i load_block_i8(const int8_t *p, int half)
{
    return half ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p))
                : _mm256_loadu_si256((const __m256i *)p);
}

/* 16-byte I4 block -> its 32 codes in weight order (low nibbles, then high) */
KT_INLINE __m256i unpack_i4_32(const uint8_t *p)
{
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

/* Weight scales of block [k0, k0 + 32) of one row, per lane: one broadcast when
 * group % 32 == 0, else columns k0..k0+15 and k0+16..k0+31 may be in different
 * groups (I8, group % 32 == 16). A half last block reuses the first scale. */
KT_INLINE __m256 block_scales_256(const float *scale, int64_t k0, int64_t group, int half)
{
    if (group % 32 == 0)
        return _mm256_set1_ps(scale[k0 / group]);
    float hi = half ? scale[k0 / group] : scale[(k0 + 16) / group];
    return _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(scale[k0 / group]));
}

/* dots[i][t] = sum over blocks of sa * s * (int32 block sum), 32 columns a step. */
KT_INLINE void int_tile_256(float dots[4][4], const int_rows *w, const int RT, const kt_acts *a,
                            int64_t t0, const int TT, const int32_t fmt)
{
    int64_t cols = a->cols, group = a->group, nb = (cols + 31) / 32;
    const int8_t *q = a->q + t0 * cols;
    const float *sa = a->q_scale + t0 * nb;
    __m256 acc[4][4];
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            acc[i][t] = _mm256_setzero_ps();
    for (int64_t k0 = 0, b = 0; k0 < cols; k0 += 32, b++) {
        int half = cols - k0 < 32;
        __m256i wv[4], u[4];
        __m256 ws[4];
        for (int i = 0; i < RT; i++) {
            if (fmt == KT_I4) {
                u[i] = unpack_i4_32(w->codes[i] + k0 / 2);
            } else {
                wv[i] = load_block_i8((const int8_t *)w->codes[i] + k0, half);
                u[i] = _mm256_sign_epi8(wv[i], wv[i]);
            }
            ws[i] = block_scales_256(w->scale[i], k0, group, half);
        }
        for (int t = 0; t < TT; t++) {
            __m256i av = load_block_i8(q + t * cols + k0, half);
            __m256 st = _mm256_set1_ps(sa[t * nb + b]);
            for (int i = 0; i < RT; i++) {
                __m256i s = fmt == KT_I4 ? av : _mm256_sign_epi8(av, wv[i]);
                __m256 sum = _mm256_cvtepi32_ps(block_dot_u8s8(u[i], s));
                acc[i][t] = _mm256_fmadd_ps(sum, _mm256_mul_ps(ws[i], st), acc[i][t]);
            }
        }
    }
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            dots[i][t] = hsum_256(acc[i][t]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
/* 64 columns (two activation blocks) a step, for cols % 64 == 0 and group % 32 == 0:
 * int32 lanes 0-7 of a step's sum hold its first block, 8-15 the second, so the
 * scales are pairs of broadcasts. I4 puts two 16-byte blocks' nibbles back in
 * weight order (128-bit lanes: block0 low, block0 high, block1 low, block1 high);
 * I8 moves the weight sign onto the activation with a byte mask. */
KT_INLINE __m512 pair_ps(float lo, float hi)
{
    return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

KT_INLINE __m512i unpack_i4_64(const uint8_t *p)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i b = _mm256_loadu_si256((const __m256i *)p);
    __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
}

KT_INLINE void int_tile_512(float dots[4][4], const int_rows *w, const int RT, const kt_acts *a,
                            int64_t t0, const int TT, const int32_t fmt)
{
    int64_t cols = a->cols, group = a->group, nb = cols / 32;
    const int8_t *q = a->q + t0 * cols;
    const float *sa = a->q_scale + t0 * nb;
    __m512 acc[4][4];
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            acc[i][t] = _mm512_setzero_ps();
    for (int64_t k0 = 0, b = 0; k0 < cols; k0 += 64, b += 2) {
        __m512i u[4];
        __m512 ws[4];
        __mmask64 negative[4] = {0, 0, 0, 0};
        for (int i = 0; i < RT; i++) {
            if (fmt == KT_I4) {
                u[i] = unpack_i4_64(w->codes[i] + k0 / 2);
            } else {
                __m512i wv = _mm512_loadu_si512((const int8_t *)w->codes[i] + k0);
                u[i] = _mm512_abs_epi8(wv);
                negative[i] = _mm512_movepi8_mask(wv);
            }
            ws[i] = pair_ps(w->scale[i][k0 / group], w->scale[i][(k0 + 32) / group]);
        }
        for (int t = 0; t < TT; t++) {
            __m512i av = _mm512_loadu_si512(q + t * cols + k0);
            __m512 st = pair_ps(sa[t * nb + b], sa[t * nb + b + 1]);
            for (int i = 0; i < RT; i++) {
                __m512i s = fmt == KT_I8 ? _mm512_mask_sub_epi8(av, negative[i], _mm512_setzero_si512(), av) : av;
                __m512 sum = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[i], s));
                acc[i][t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(ws[i], st), acc[i][t]);
            }
        }
    }
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            dots[i][t] = _mm512_reduce_add_ps(acc[i][t]);
}
#define KT_INT_TILE_512 1
#endif

#else /* portable */

KT_INLINE int code_at(const uint8_t *row, int64_t k, int32_t fmt)
{
    if (fmt == KT_I8)
        return ((const int8_t *)row)[k];
    /* 32-weight block: byte j holds q[j] (low nibble) and q[j+16] (high nibble) */
    uint8_t byte = row[(k / 32) * 16 + (k % 16)];
    return (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
}

/* 16 columns a step: each inside one activation block and one weight group. */
KT_INLINE void int_tile_portable(float dots[4][4], const int_rows *w, const int RT, const kt_acts *a,
                                 int64_t t0, const int TT, const int32_t fmt)
{
    int64_t cols = a->cols, group = a->group, nb = (cols + 31) / 32;
    const int8_t *q = a->q + t0 * cols;
    const float *sa = a->q_scale + t0 * nb;
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            dots[i][t] = 0.0f;
    for (int64_t k0 = 0; k0 < cols; k0 += 16) {
        for (int i = 0; i < RT; i++) {
            for (int t = 0; t < TT; t++) {
                int32_t s = 0;
                for (int64_t k = k0; k < k0 + 16; k++)
                    s += code_at(w->codes[i], k, fmt) * q[t * cols + k];
                dots[i][t] += (float)s * (sa[t * nb + k0 / 32] * w->scale[i][k0 / group]);
            }
        }
    }
}
#endif

/* Rows [r, r + RT) of W against tokens [t0, t0 + TT): out[t * ldo + i] for row r + i. */
KT_INLINE void int_tile(float *out, int64_t ldo, const kt_matrix *w, int64_t r, const int RT,
                        const kt_acts *a, int64_t t0, const int TT, const int32_t fmt, const int asym)
{
    int64_t cols = w->cols, group = w->group, n_groups = cols / group;
    int64_t row_bytes = fmt == KT_I4 ? cols / 2 : cols;
    int_rows rows;
    for (int i = 0; i < RT; i++) {
        rows.codes[i] = (const uint8_t *)w->data + (r + i) * row_bytes;
        rows.scale[i] = w->scale + (r + i) * n_groups;
        rows.min[i] = asym ? w->min + (r + i) * n_groups : NULL;
    }
    float dots[4][4];
#if defined(KT_INT_TILE_512)
    if (cols % 64 == 0 && group % 32 == 0)
        int_tile_512(dots, &rows, RT, a, t0, TT, fmt);
    else
        int_tile_256(dots, &rows, RT, a, t0, TT, fmt);
#elif defined(__AVX2__)
    int_tile_256(dots, &rows, RT, a, t0, TT, fmt);
#else
    int_tile_portable(dots, &rows, RT, a, t0, TT, fmt);
#endif
    if (asym || fmt == KT_I4) {
        const float *gsum = a->q_group_sum + t0 * n_groups;
        for (int64_t g = 0; g < n_groups; g++)
            for (int i = 0; i < RT; i++) {
                float c = asym ? rows.min[i][g] : -8.0f * rows.scale[i][g];
                for (int t = 0; t < TT; t++)
                    dots[i][t] += c * gsum[t * n_groups + g];
            }
    }
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            out[t * ldo + i] = dots[i][t];
}

#endif
