/* quant.c: round-to-nearest quantization of weights (I8/I4, kt-q1 layout) and
 * of activations (symmetric int8: per row for kt_quantize_rows_f32_i8, per
 * 32-value block of a row for the kernels; acts.c prepares the rest).
 *
 * Every code q is computed as clamp(rint((x - offset) / scale + bias)) with
 * IEEE division and round-half-to-even (rint in the default rounding mode), the
 * same float operations in the same order as weights/layout.py
 * quantize_reference, so both give bit-identical codes and scales:
 *   I8 symmetric    scale = amax/127            offset 0   bias 0  q in -127..127
 *   I8 asymmetric   scale = (hi-lo)/255, min = lo + 128*scale
 *                                               offset min bias 0  q in -128..127
 *   I4 symmetric    scale = v/-8 where v is the value of largest magnitude
 *                                               offset 0   bias 8  q in 0..15
 *   I4 asymmetric   scale = (hi-lo)/15, min = lo offset lo bias 0  q in 0..15
 * A zero scale divides by 1 instead (the stored scale stays 0).
 */
#include <math.h>
#include <string.h>
#include "kt_internal.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

struct code_rule {
    float scale;
    float offset;
    float bias;
    float lo, hi;
};

#if defined(__AVX2__)
/* 32 floats -> 32 codes with the same IEEE operations as the scalar loop below:
 * vdivps is correctly rounded like '/', vroundps(nearest) is rint. The codes are
 * already clamped, so the saturating packs only narrow; packs work per 128-bit
 * lane, and the final dword permutation restores the element order. */
static void quantize_32(int8_t *q, const float *x, struct code_rule rule, float divisor)
{
    const __m256 off = _mm256_set1_ps(rule.offset), div = _mm256_set1_ps(divisor);
    const __m256 bias = _mm256_set1_ps(rule.bias), lo = _mm256_set1_ps(rule.lo), hi = _mm256_set1_ps(rule.hi);
    __m256i c[4];
    for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + 8 * i), off), div), bias);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    }
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
}
#endif

static void quantize_span(int8_t *q, const float *x, int64_t n, struct code_rule rule)
{
    float divisor = rule.scale == 0.0f ? 1.0f : rule.scale;
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 32 <= n; i += 32)
        quantize_32(q + i, x + i, rule, divisor);
#endif
    for (; i < n; i++) {
        float v = rintf((x[i] - rule.offset) / divisor + rule.bias);
        v = v < rule.lo ? rule.lo : (v > rule.hi ? rule.hi : v);
        q[i] = (int8_t)(int)v;
    }
}

float kt_abs_max(const float *x, int64_t n)
{
    float m = 0.0f;
    int64_t i = 0;
#if defined(__AVX2__)
    /* max(|x|, m) keeps m when x is NaN, as the scalar comparison does */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mv = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        mv = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), mv);
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int j = 0; j < 8; j++)
        m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; i < n; i++)
        m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
}

static void min_max(const float *x, int64_t n, float *lo, float *hi)
{
    float a = x[0], b = x[0];
    for (int64_t i = 1; i < n; i++) {
        a = x[i] < a ? x[i] : a;
        b = x[i] > b ? x[i] : b;
    }
    *lo = a;
    *hi = b;
}

/* The first value of largest magnitude, sign kept (torch.argmax picks the first). */
static float signed_abs_max(const float *x, int64_t n)
{
    float best = x[0];
    for (int64_t i = 1; i < n; i++)
        if (fabsf(x[i]) > fabsf(best))
            best = x[i];
    return best;
}

/* ---- activations: per-row symmetric int8 -------------------------------------- */

static float quantize_row_i8(int8_t *q, const float *x, int64_t n)
{
    float scale = kt_abs_max(x, n) / 127.0f;
    quantize_span(q, x, n, (struct code_rule){scale, 0.0f, 0.0f, -127.0f, 127.0f});
    return scale;
}

int kt_quantize_rows_f32_i8(int8_t *q, float *scale, const float *x, int64_t rows, int64_t n)
{
    if (!q || !scale || !x || rows < 0 || n < 1)
        return KT_EINVAL;
    for (int64_t r = 0; r < rows; r++)
        scale[r] = quantize_row_i8(q + r * n, x + r * n, n);
    return KT_OK;
}

/* ---- weights: one group of one row ------------------------------------------------ */

/* x rounded to the nearest half float (ties to even), or x itself where that would overflow:
 * symmetric I4 scales are kept to halves so the ROW8 layout can store them in 16 bits
 * (kt.h KT_SCALE_F16). Halves have 11 significant bits, and steps of 2^-24 below 2^-14. */
static float nearest_half(float x)
{
    float a = fabsf(x);
    if (!(a < 65520.0f))
        return x;
    if (a < 6.103515625e-05f)
        return copysignf(rintf(a * 16777216.0f) / 16777216.0f, x);
    int e;
    frexpf(a, &e);
    float step = ldexpf(1.0f, e - 11);
    return copysignf(rintf(a / step) * step, x);
}

static struct code_rule group_rule(const float *g, int64_t n, int32_t format, int asym, float *min)
{
    float lo, hi;
    if (format == KT_I8 && !asym)
        return (struct code_rule){kt_abs_max(g, n) / 127.0f, 0.0f, 0.0f, -127.0f, 127.0f};
    if (format == KT_I4 && !asym)
        return (struct code_rule){nearest_half(signed_abs_max(g, n) / -8.0f), 0.0f, 8.0f, 0.0f, 15.0f};
    min_max(g, n, &lo, &hi);
    if (format == KT_I8) {
        float scale = (hi - lo) / 255.0f;
        *min = lo + 128.0f * scale;
        return (struct code_rule){scale, *min, 0.0f, -128.0f, 127.0f};
    }
    *min = lo;
    return (struct code_rule){(hi - lo) / 15.0f, lo, 0.0f, 0.0f, 15.0f};
}

/* 32 codes -> 16 bytes: byte j = q[j] | q[j+16] << 4 */
static void pack_i4_block(uint8_t *dst, const int8_t *q)
{
    for (int j = 0; j < 16; j++)
        dst[j] = (uint8_t)((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
}

struct quant_job {
    const kt_matrix *dst;
    const float *w;
};

static void quantize_row_task(void *ctx_, int64_t r, int thread)
{
    (void)thread;
    const struct quant_job *job = ctx_;
    const kt_matrix *d = job->dst;
    int64_t n_groups = d->cols / d->group;
    int asym = d->min != NULL;
    int8_t codes[32];
    for (int64_t g = 0; g < n_groups; g++) {
        const float *src = job->w + r * d->cols + g * d->group;
        float mn = 0.0f;
        struct code_rule rule = group_rule(src, d->group, d->format, asym, &mn);
        ((float *)d->scale)[r * n_groups + g] = rule.scale;
        if (asym)
            ((float *)d->min)[r * n_groups + g] = mn;
        for (int64_t k = 0; k < d->group; k += 32) {
            int64_t col = g * d->group + k;
            int64_t len = d->group - k < 32 ? d->group - k : 32;
            if (d->format == KT_I8) {
                quantize_span((int8_t *)d->data + r * d->cols + col, src + k, len, rule);
                continue;
            }
            quantize_span(codes, src + k, 32, rule);
            pack_i4_block((uint8_t *)d->data + (r * d->cols + col) / 2, codes);
        }
    }
}

int kt_quantize_matrix_f32(kt_pool *pool, const kt_matrix *dst, const float *w)
{
    if (!w || kt_matrix_check(dst) != KT_OK)
        return KT_EINVAL;
    if ((dst->format != KT_I8 && dst->format != KT_I4) || dst->layout != KT_LAYOUT_ROWS)
        return KT_EINVAL;
    struct quant_job job = {dst, w};
    if (pool) {
        kt_pool_run(pool, quantize_row_task, &job, dst->rows);
        return KT_OK;
    }
    for (int64_t r = 0; r < dst->rows; r++)
        quantize_row_task(&job, r, 0);
    return KT_OK;
}

/* ---- activations: per-block symmetric int8 (the kernels' kt_acts) ------------------ */

/* One token row: q[k] = rint(x[k] / s_b), s_b = max |x| over block b / 127. */
void kt_quantize_blocks_i8(int8_t *q, float *scale, const float *x, int64_t n)
{
    for (int64_t k = 0, b = 0; k < n; k += KT_ACT_BLOCK, b++) {
        int64_t len = n - k < KT_ACT_BLOCK ? n - k : KT_ACT_BLOCK;
        scale[b] = kt_abs_max(x + k, len) / 127.0f;
        quantize_span(q + k, x + k, len, (struct code_rule){scale[b], 0.0f, 0.0f, -127.0f, 127.0f});
    }
}
