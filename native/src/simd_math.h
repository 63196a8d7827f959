/* simd_math.h: element-wise functions on VF_N float lanes (simd_float.h's vf), for the
 * kernels' inner loops: exp of non-positive arguments (softmax) and SiLU-gated products. */
#ifndef KT_SIMD_MATH_H
#define KT_SIMD_MATH_H

#include <math.h>
#include "simd_float.h"

/* exp(x) for x <= 0 (e.g. a score minus its running maximum), VF_N lanes at once:
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact to float),
 * exp(r) by its degree-6 Taylor polynomial (truncation < 2e-7 relative), times 2^n
 * put in the exponent bits. x is clamped to -87 (exp ~ 1.6e-38, no subnormal 2^n):
 * such a term is invisible beside the maximum's exp(0) = 1 in a softmax's sum. */
#if defined(__AVX512F__)
KT_INLINE vf vf_exp_nonpos(vf x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682e-6f), r);
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
#elif defined(__AVX2__)
KT_INLINE vf vf_exp_nonpos(vf x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682e-6f), r);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
    static const float taylor[7] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    vf p = vf_set1(taylor[0]);
    for (int i = 1; i < 7; i++)
        p = vf_fma(p, r, vf_set1(taylor[i]));
    return p * (vf)e;
}
#else
KT_INLINE vf vf_exp_nonpos(vf x) { return expf(x); }
#endif

/* out[k] = silu(g[k]) * u[k] = g / (1 + exp(-g)) * u for k < n (out may be g or u).
 * sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) for g < 0, e = exp(-|g|), so exp
 * only ever sees non-positive arguments. Within a few float32 ulps of the scalar form. */
KT_INLINE void silu_mul_f32(float *out, const float *g, const float *u, int64_t n)
{
    int64_t k = 0;
#if defined(__AVX512F__)
    const vf one = vf_set1(1.0f);
    for (; k + VF_N <= n; k += VF_N) {
        vf x = vf_load(g + k);
        vf e = vf_exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
        __mmask16 nonneg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
        vf sig = _mm512_div_ps(_mm512_mask_blend_ps(nonneg, e, one), _mm512_add_ps(one, e));
        vf_store(out + k, _mm512_mul_ps(_mm512_mul_ps(x, sig), vf_load(u + k)));
    }
#elif defined(__AVX2__)
    const vf one = vf_set1(1.0f), sign = vf_set1(-0.0f);
    for (; k + VF_N <= n; k += VF_N) {
        vf x = vf_load(g + k);
        vf e = vf_exp_nonpos(_mm256_or_ps(x, sign));            /* -|x| */
        vf nonneg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
        vf sig = _mm256_div_ps(_mm256_blendv_ps(e, one, nonneg), _mm256_add_ps(one, e));
        vf_store(out + k, _mm256_mul_ps(_mm256_mul_ps(x, sig), vf_load(u + k)));
    }
#endif
    for (; k < n; k++)
        out[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
}

#endif
