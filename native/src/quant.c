/* quant.c: round-to-nearest quantization of weights (I8/I4, kt-q1 layout) and
 * of activations (per-row symmetric int8), and the per-format activation
 * preparation every matrix-rows kernel consumes.
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

#define ALIGN64(n) (((n) + (size_t)63) & ~(size_t)63)

struct code_rule {
    float scale;
    float offset;
    float bias;
    float lo, hi;
};

static void quantize_span(int8_t *q, const float *x, int64_t n, struct code_rule rule)
{
    float divisor = rule.scale == 0.0f ? 1.0f : rule.scale;
    for (int64_t i = 0; i < n; i++) {
        float v = rintf((x[i] - rule.offset) / divisor + rule.bias);
        v = v < rule.lo ? rule.lo : (v > rule.hi ? rule.hi : v);
        q[i] = (int8_t)(int)v;
    }
}

static float abs_max(const float *x, int64_t n)
{
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++)
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
    float scale = abs_max(x, n) / 127.0f;
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

static struct code_rule group_rule(const float *g, int64_t n, int32_t format, int asym, float *min)
{
    float lo, hi;
    if (format == KT_I8 && !asym)
        return (struct code_rule){abs_max(g, n) / 127.0f, 0.0f, 0.0f, -127.0f, 127.0f};
    if (format == KT_I4 && !asym)
        return (struct code_rule){signed_abs_max(g, n) / -8.0f, 0.0f, 8.0f, 0.0f, 15.0f};
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
    if (dst->format != KT_I8 && dst->format != KT_I4)
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

/* ---- activations prepared for one weight format -------------------------------------
 * Scratch layout (each part 64-byte aligned):
 *   integer formats: q int8 [m, cols] | q_scale f32 [m] | q_group_sum f32 [m, cols/group]
 *   BF16 where the ISA has a bf16 dot product: bf16 [m, cols]
 *   other float formats: nothing (the kernels read x directly). */

static int uses_bf16_acts(int32_t format)
{
#if defined(__AVX512BF16__)
    return format == KT_BF16;
#else
    (void)format;
    return 0;
#endif
}

size_t kt_acts_scratch_bytes(const kt_matrix *w, int64_t m)
{
    if (m < 1 || kt_matrix_check(w) != KT_OK)
        return 0;
    size_t mm = (size_t)m, cols = (size_t)w->cols;
    if (w->format == KT_I8 || w->format == KT_I4)
        return ALIGN64(mm * cols) + ALIGN64(mm * 4) + ALIGN64(mm * (cols / (size_t)w->group) * 4);
    if (uses_bf16_acts(w->format))
        return ALIGN64(mm * cols * 2);
    return 0;
}

static void group_sums(float *sums, const int8_t *q, int64_t cols, int64_t group)
{
    for (int64_t g = 0; g < cols / group; g++) {
        int32_t s = 0;
        for (int64_t k = 0; k < group; k++)
            s += q[g * group + k];
        sums[g] = (float)s;
    }
}

static void prepare_int8(kt_acts *a, const float *x, int64_t m, const kt_matrix *w, char *scratch)
{
    size_t mm = (size_t)m, cols = (size_t)w->cols;
    a->q = (int8_t *)scratch;
    a->q_scale = (float *)(scratch + ALIGN64(mm * cols));
    a->q_group_sum = (float *)(scratch + ALIGN64(mm * cols) + ALIGN64(mm * 4));
    int64_t n_groups = w->cols / w->group;
    for (int64_t t = 0; t < m; t++) {
        a->q_scale[t] = quantize_row_i8(a->q + t * w->cols, x + t * w->cols, w->cols);
        group_sums(a->q_group_sum + t * n_groups, a->q + t * w->cols, w->cols, w->group);
    }
}

/* f32 -> bf16 bits, round to nearest even (NaN kept quiet) */
static uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int kt_acts_prepare(kt_acts *acts, const float *x, int64_t m, const kt_matrix *w, void *scratch)
{
    if (!acts || !x || m < 1 || kt_matrix_check(w) != KT_OK)
        return KT_EINVAL;
    if (kt_acts_scratch_bytes(w, m) > 0 && !scratch)
        return KT_EINVAL;
    memset(acts, 0, sizeof *acts);
    acts->m = m;
    acts->cols = w->cols;
    acts->format = w->format;
    acts->group = w->group;
    acts->f32 = x;
    if (w->format == KT_I8 || w->format == KT_I4) {
        prepare_int8(acts, x, m, w, scratch);
    } else if (uses_bf16_acts(w->format)) {
        acts->bf16 = scratch;
        for (int64_t i = 0; i < m * w->cols; i++)
            acts->bf16[i] = f32_to_bf16(x[i]);
    }
    return KT_OK;
}
