/* simd_int.h: row kernels for the integer weight formats (I8, I4), included by
 * linear.c only. Dequantize-free: weight codes meet the per-token int8
 * activations in integer dot products, scaled once per group.
 *
 * Maths, for token t with x[t] ~= sa * qa (kt_acts) and one weight group g of
 * row r with scale s, min mn (asymmetric) and codes qw:
 *   I8 symmetric    w = s*qw          dot_g = s * sum(qw*qa)
 *   I8 asymmetric   w = s*qw + mn     dot_g = s * sum(qw*qa) + mn * sum(qa)
 *   I4 symmetric    w = s*(qw - 8)    dot_g = s * sum(qw*qa) - 8*s * sum(qa)
 *   I4 asymmetric   w = s*qw + mn     dot_g = s * sum(qw*qa) + mn * sum(qa)
 *   out = sa * sum_g dot_g;  sum(qa) per group is kt_acts.q_group_sum.
 *
 * Integer products (x86): vpmaddubsw multiplies unsigned bytes by signed bytes,
 * adding pairs into int16; I4 codes are 0..15 already unsigned (pair sums
 * <= 2*15*127), I8 codes become |qw| with the sign moved onto qa (vpsignb; pair
 * sums <= 2*128*127 < 32767, no saturation). vpmaddwd by 1 widens to int32.
 * With AVX512-VNNI, vpdpbusd does all three steps in one instruction.
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

#if defined(__AVX2__)
typedef __m256i vi;
typedef __m256 vacc;
#define vacc_zero() _mm256_setzero_ps()

KT_INLINE __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

KT_INLINE float vacc_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KT_INLINE __m256 vacc_add_scaled(__m256 acc, __m256i isum, float scale)
{
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(scale), acc);
}

KT_INLINE void zero_sums(vi isum[4][4], const int RT, const int TT)
{
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++)
            isum[r][t] = _mm256_setzero_si256();
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* 64 weights per step: I4 needs two 16-byte blocks split into nibbles and put
 * back in weight order (lanes: block0 low, block0 high, block1 low, block1 high);
 * I8 moves the weight sign onto the activation with a byte mask. Each weight
 * vector serves TT tokens, each token vector RT rows (up to 16 accumulators). */
KT_INLINE __m256i fold512(__m512i v)
{
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

KT_INLINE __m512i unpack_i4_64(const uint8_t *p)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i b = _mm256_loadu_si256((const __m256i *)p);
    __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
}

KT_INLINE void group_dot_512(vi isum[4][4], const uint8_t *const *rows, const int RT, const int8_t *q,
                             int64_t cols, int64_t k0, int64_t group, const int TT, const int32_t fmt)
{
    __m512i acc[4][4];
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++)
            acc[r][t] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + group; k += 64) {
        __m512i u[4];
        __mmask64 negative[4] = {0, 0, 0, 0};
        for (int r = 0; r < RT; r++) {
            if (fmt == KT_I4) {
                u[r] = unpack_i4_64(rows[r] + k / 2);
            } else {
                __m512i wv = _mm512_loadu_si512((const int8_t *)rows[r] + k);
                u[r] = _mm512_abs_epi8(wv);
                negative[r] = _mm512_movepi8_mask(wv);
            }
        }
        for (int t = 0; t < TT; t++) {
            __m512i a = _mm512_loadu_si512(q + t * cols + k);
            for (int r = 0; r < RT; r++) {
                __m512i ar = fmt == KT_I8 ? _mm512_mask_sub_epi8(a, negative[r], _mm512_setzero_si512(), a) : a;
                acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], u[r], ar);
            }
        }
    }
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++)
            isum[r][t] = fold512(acc[r][t]);
}
#endif

/* I4, 32 weights per step over a span of at most SPAN_I4 weights. Without VNNI
 * the int16 pair sums of vpmaddubsw are added up in int16 over the span
 * (8 blocks * 2*15*127 = 30480 < 32767) and widened once at its end, saving two
 * instructions per block, row and token. */
#define SPAN_I4 256

KT_INLINE void group_dot_i4(vi isum[4][4], const uint8_t *const *rows, const int RT, const int8_t *q,
                            int64_t cols, int64_t k0, int64_t n, const int TT)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i acc[4][4];
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++)
            acc[r][t] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k0 + n; k += 32) {
        __m256i wv[4];
        for (int r = 0; r < RT; r++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(rows[r] + k / 2));
            wv[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4);
        }
        for (int t = 0; t < TT; t++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(q + t * cols + k));
            for (int r = 0; r < RT; r++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                acc[r][t] = _mm256_dpbusd_epi32(acc[r][t], wv[r], a);
#else
                acc[r][t] = _mm256_add_epi16(acc[r][t], _mm256_maddubs_epi16(wv[r], a));
#endif
            }
        }
    }
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            isum[r][t] = acc[r][t];
#else
            isum[r][t] = _mm256_madd_epi16(acc[r][t], _mm256_set1_epi16(1));
#endif
        }
}

/* I8, 32 weights per step, a 16-wide step when group % 32 == 16. */
KT_INLINE void group_dot_i8(vi isum[4][4], const uint8_t *const *rows, const int RT, const int8_t *q,
                            int64_t cols, int64_t k0, int64_t group, const int TT)
{
    for (int64_t k = k0; k < k0 + group; k += 32) {
        int half = k0 + group - k < 32;
        __m256i wv[4], u[4];
        for (int r = 0; r < RT; r++) {
            const int8_t *w8 = (const int8_t *)rows[r] + k;
            wv[r] = half ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)w8))
                         : _mm256_loadu_si256((const __m256i *)w8);
            u[r] = _mm256_sign_epi8(wv[r], wv[r]);
        }
        for (int t = 0; t < TT; t++) {
            const int8_t *qt = q + t * cols + k;
            __m256i a = half ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)qt))
                             : _mm256_loadu_si256((const __m256i *)qt);
            for (int r = 0; r < RT; r++)
                isum[r][t] = dot_u8s8(isum[r][t], u[r], _mm256_sign_epi8(a, wv[r]));
        }
    }
}

/* One group [k0, k0 + group) of RT rows against TT tokens of q (row stride cols). */
KT_INLINE void group_dot(vi isum[4][4], const uint8_t *const *rows, const int RT, const int8_t *q,
                         int64_t cols, int64_t k0, int64_t group, const int TT, const int32_t fmt)
{
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (group % 64 == 0) {
        group_dot_512(isum, rows, RT, q, cols, k0, group, TT, fmt);
        return;
    }
#endif
    if (fmt == KT_I4) {
        group_dot_i4(isum, rows, RT, q, cols, k0, group, TT);
        return;
    }
    zero_sums(isum, RT, TT);
    group_dot_i8(isum, rows, RT, q, cols, k0, group, TT);
}

#else /* portable */
#define SPAN_I4 INT64_MAX
typedef int32_t vi;
typedef float vacc;
#define vacc_zero() 0.0f
#define vacc_hsum(v) (v)
#define vacc_add_scaled(acc, isum, scale) ((acc) + (float)(isum) * (scale))

KT_INLINE int code_at(const uint8_t *row, int64_t k, int32_t fmt)
{
    if (fmt == KT_I8)
        return ((const int8_t *)row)[k];
    /* 32-weight block: byte j holds q[j] (low nibble) and q[j+16] (high nibble) */
    uint8_t byte = row[(k / 32) * 16 + (k % 16)];
    return (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
}

KT_INLINE void group_dot(vi isum[4][4], const uint8_t *const *rows, const int RT, const int8_t *q,
                         int64_t cols, int64_t k0, int64_t group, const int TT, const int32_t fmt)
{
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++)
            isum[r][t] = 0;
    for (int64_t k = k0; k < k0 + group; k++) {
        for (int r = 0; r < RT; r++) {
            int c = code_at(rows[r], k, fmt);
            for (int t = 0; t < TT; t++)
                isum[r][t] += c * q[t * cols + k];
        }
    }
}
#endif

/* Rows [r, r + RT) of W against tokens [t0, t0 + TT): out[t * ldo + i] for row r + i.
 * Integer sums per group (per span of at most SPAN_I4 weights for I4), scaled
 * into float accumulators once per span. The zero-point term (c * sum(qa) per
 * group) is accumulated in scalars. */
KT_INLINE void int_tile(float *out, int64_t ldo, const kt_matrix *w, int64_t r, const int RT,
                        const kt_acts *a, int64_t t0, const int TT, const int32_t fmt, const int asym)
{
    int64_t cols = w->cols, group = w->group, n_groups = cols / group;
    int64_t row_bytes = fmt == KT_I4 ? cols / 2 : cols;
    int64_t span = fmt == KT_I4 && group > SPAN_I4 ? SPAN_I4 : group;
    const uint8_t *rows[4];
    const float *scale[4], *min[4];
    for (int i = 0; i < RT; i++) {
        rows[i] = (const uint8_t *)w->data + (r + i) * row_bytes;
        scale[i] = w->scale + (r + i) * n_groups;
        min[i] = asym ? w->min + (r + i) * n_groups : NULL;
    }
    const int8_t *q = a->q + t0 * cols;
    const float *gsum = a->q_group_sum + t0 * n_groups;
    const int has_corr = asym || fmt == KT_I4;
    vacc acc[4][4];
    float corr[4][4];
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++) {
            acc[i][t] = vacc_zero();
            corr[i][t] = 0.0f;
        }
    for (int64_t g = 0; g < n_groups; g++) {
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += span) {
            vi isum[4][4];
            int64_t n = (g + 1) * group - k0 < span ? (g + 1) * group - k0 : span;
            group_dot(isum, rows, RT, q, cols, k0, n, TT, fmt);
            for (int i = 0; i < RT; i++)
                for (int t = 0; t < TT; t++)
                    acc[i][t] = vacc_add_scaled(acc[i][t], isum[i][t], scale[i][g]);
        }
        for (int i = 0; i < RT && has_corr; i++) {
            float c = asym ? min[i][g] : -8.0f * scale[i][g];
            for (int t = 0; t < TT; t++)
                corr[i][t] += c * gsum[t * n_groups + g];
        }
    }
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            out[t * ldo + i] = a->q_scale[t0 + t] * (vacc_hsum(acc[i][t]) + corr[i][t]);
}

#endif
