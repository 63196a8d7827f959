/* simd_float.h: row kernels for the float weight formats (F32, BF16, F16),
 * included by linear.c, gemm.c and dequant.c (weight_f).
 *
 * float_tile computes a tile of RT weight rows (1, 2 or 4) against TT tokens (1..4):
 *   out[t * ldo + r] = dot(W row r, x[t]),  x[t] = x + t * cols
 * Each weight vector is loaded once per tile and used by all TT tokens; each
 * token vector is used by all RT rows. RT, TT and the format are compile-time
 * constants at every call site (always_inline), so the accumulator arrays live
 * in registers. Vector width: 16 floats under AVX-512, 8 under AVX2, scalar
 * otherwise; the cols % width tail is finished in scalar code.
 */
#ifndef KT_SIMD_FLOAT_H
#define KT_SIMD_FLOAT_H

#include <string.h>
#include "kt_internal.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define KT_INLINE static inline __attribute__((always_inline))

/* ---- scalar conversions ------------------------------------------------------- */

KT_INLINE float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

KT_INLINE float weight_f(const void *row, int64_t k, int32_t fmt)
{
    if (fmt == KT_F32)
        return ((const float *)row)[k];
    if (fmt == KT_BF16)
        return bf16_to_f32(((const uint16_t *)row)[k]);
    return kt_f16_to_f32(((const uint16_t *)row)[k]);
}

/* ---- vector loads ----------------------------------------------------------------- */

#if defined(__AVX512F__)
#define VF_N 16
typedef __m512 vf;
#define vf_zero() _mm512_setzero_ps()
#define vf_load(p) _mm512_loadu_ps(p)
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_hsum(v) _mm512_reduce_add_ps(v)
#define vf_set1(v) _mm512_set1_ps(v)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
KT_INLINE vf vf_load_w(const void *row, int64_t k, int32_t fmt)
{
    if (fmt == KT_F32)
        return _mm512_loadu_ps((const float *)row + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k));
    if (fmt == KT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#elif defined(__AVX2__)
#define VF_N 8
typedef __m256 vf;
#define vf_zero() _mm256_setzero_ps()
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_set1(v) _mm256_set1_ps(v)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
KT_INLINE float vf_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
KT_INLINE vf vf_load_w(const void *row, int64_t k, int32_t fmt)
{
    if (fmt == KT_F32)
        return _mm256_loadu_ps((const float *)row + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    if (fmt == KT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
#else
#define VF_N 1
typedef float vf;
#define vf_zero() 0.0f
#define vf_load(p) (*(p))
#define vf_fma(a, b, c) ((a) * (b) + (c))
#define vf_hsum(v) (v)
#define vf_set1(v) (v)
#define vf_store(p, v) (*(p) = (v))
#define vf_load_w(row, k, fmt) weight_f(row, k, fmt)
#endif

/* ---- the tile ----------------------------------------------------------------------- */

/* Called at each 64-byte step `byte` of the rows; *due: the next step's byte
 * offset to prefetch at (starts at phase * 64). */
KT_INLINE void tile_prefetch_rows(const void *const *rows, const int RT, int64_t byte, const kt_tile_prefetch *pf,
                                  int64_t *due)
{
    if (!pf->ahead || byte < *due)
        return;
    *due = byte + pf->every * 64;
    for (int r = 0; r < RT; r++)
        __builtin_prefetch((const char *)rows[r] + byte + pf->ahead, 0, 2);
}

KT_INLINE void float_tile(float *out, int64_t ldo, const char *row0, int64_t row_bytes, const int RT,
                          const float *x, int64_t cols, const int TT, const int32_t fmt, kt_tile_prefetch pf)
{
    const int64_t wbytes = fmt == KT_F32 ? 4 : 2;
    const void *rows[4];
    for (int r = 0; r < RT; r++)
        rows[r] = row0 + r * row_bytes;
    vf acc[4][4];
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++)
            acc[r][t] = vf_zero();
    int64_t k = 0, due = pf.phase * 64;
    for (; k + VF_N <= cols; k += VF_N) {
        vf wv[4];
        if (((k * wbytes) & 63) == 0)
            tile_prefetch_rows(rows, RT, k * wbytes, &pf, &due);
        for (int r = 0; r < RT; r++)
            wv[r] = vf_load_w(rows[r], k, fmt);
        for (int t = 0; t < TT; t++) {
            vf a = vf_load(x + t * cols + k);
            for (int r = 0; r < RT; r++)
                acc[r][t] = vf_fma(wv[r], a, acc[r][t]);
        }
    }
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++) {
            float s = vf_hsum(acc[r][t]);
            for (int64_t j = k; j < cols; j++)
                s += weight_f(rows[r], j, fmt) * x[t * cols + j];
            out[t * ldo + r] = s;
        }
}

#if defined(__AVX512BF16__)
/* BF16 weights against bf16-rounded activations: vdpbf16ps multiplies 32 bf16
 * pairs and adds them into 16 f32 lanes. The tail uses the f32 activations. */
KT_INLINE void bf16_tile_dp(float *out, int64_t ldo, const char *row0, int64_t row_bytes, const int RT,
                            const uint16_t *xb, const float *x, int64_t cols, const int TT, kt_tile_prefetch pf)
{
    const void *rows[4];
    for (int r = 0; r < RT; r++)
        rows[r] = row0 + r * row_bytes;
    __m512 acc[4][4];
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++)
            acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0, due = pf.phase * 64;
    for (; k + 32 <= cols; k += 32) {
        __m512i wv[4];
        tile_prefetch_rows(rows, RT, k * 2, &pf, &due);
        for (int r = 0; r < RT; r++)
            wv[r] = _mm512_loadu_si512((const uint16_t *)rows[r] + k);
        for (int t = 0; t < TT; t++) {
            __m512bh a = (__m512bh)_mm512_loadu_si512(xb + t * cols + k);
            for (int r = 0; r < RT; r++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], a);
        }
    }
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++) {
            float s = _mm512_reduce_add_ps(acc[r][t]);
            for (int64_t j = k; j < cols; j++)
                s += weight_f(rows[r], j, KT_BF16) * x[t * cols + j];
            out[t * ldo + r] = s;
        }
}
#endif

#endif
