/* quant.c: round-to-nearest quantization of weights (I8/I4, kt-q1 layout) and
 * of activations (symmetric int8: per row for kt_quantize_rows_f32_i8, per
 * 32-value block of a row for the kernels), and the per-format activation
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
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define ALIGN64(n) (((n) + (size_t)63) & ~(size_t)63)

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

static float abs_max(const float *x, int64_t n)
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

/* ---- activations prepared for one weight format -------------------------------------
 * Scratch layout (each part 64-byte aligned), nb = ceil(cols / 32):
 *   integer formats: q int8 [m, cols] | q_scale f32 [m, nb] | q_group_sum f32 [m, cols/group]
 *   BF16 where the ISA has a bf16 dot product: bf16 [m, cols]
 *   other float formats: nothing (the kernels read x directly)
 *   then, with AMX tiles, the AMX panels. */

static int uses_bf16_acts(int32_t format)
{
#if defined(__AVX512BF16__)
    return format == KT_BF16;
#else
    (void)format;
    return 0;
#endif
}

/* AMX panels (amx variant, tiles enabled): BF16 needs cols % 32 == 0, I8 group % 32 == 0. */
static int uses_amx(const kt_matrix *w, int64_t m, int amx_tiles)
{
#if defined(KT_AMX_BUILD)
    if (!amx_tiles || m < KT_AMX_MIN_TOKENS)
        return 0;
    return (w->format == KT_BF16 && w->cols % 32 == 0) || (w->format == KT_I8 && w->group % 32 == 0);
#else
    (void)w;
    (void)m;
    (void)amx_tiles;
    return 0;
#endif
}

/* The GEMM serves the exact path (float activations) from KT_GEMM_MIN_TOKENS on.
 * Not the int8 path: on a 2-core Zen 3 its integer tiles ran an MoE layer's
 * prefill (32 tokens per expert) ~20% faster than dequantize-then-GEMM. */
static int uses_gemm(int64_t m, int float_acts)
{
#if defined(KT_GEMM_BUILD)
    return float_acts && m >= KT_GEMM_MIN_TOKENS;
#else
    (void)m;
    (void)float_acts;
    return 0;
#endif
}

static size_t xt_bytes(const kt_matrix *w, int64_t m)
{
    size_t tiles = (size_t)(m + KT_GEMM_TOKENS - 1) / KT_GEMM_TOKENS;
    return ALIGN64(tiles * KT_GEMM_TOKENS * (size_t)w->cols * 4);
}

/* xt[(tile * cols + k) * KT_GEMM_TOKENS + j] = x[tile * KT_GEMM_TOKENS + j, k], 0 past m */
static void fill_xt(float *xt, const float *x, int64_t m, int64_t cols)
{
    for (int64_t t0 = 0; t0 < m; t0 += KT_GEMM_TOKENS) {
        float *tile = xt + t0 * cols;
        int64_t n = m - t0 < KT_GEMM_TOKENS ? m - t0 : KT_GEMM_TOKENS;
        for (int64_t k = 0; k < cols; k++) {
            for (int64_t j = 0; j < n; j++)
                tile[k * KT_GEMM_TOKENS + j] = x[(t0 + j) * cols + k];
            for (int64_t j = n; j < KT_GEMM_TOKENS; j++)
                tile[k * KT_GEMM_TOKENS + j] = 0.0f;
        }
    }
}

static size_t n_act_blocks(int64_t cols)
{
    return (size_t)(cols + KT_ACT_BLOCK - 1) / KT_ACT_BLOCK;
}

static size_t amx_bytes(const kt_matrix *w, int64_t m, int amx_tiles)
{
    if (!uses_amx(w, m, amx_tiles))
        return 0;
    size_t m16 = (size_t)(m + 15) / 16 * 16, cols = (size_t)w->cols;
    if (w->format == KT_BF16)
        return ALIGN64(m16 * cols * 2);
    return ALIGN64(m16 * cols) + ALIGN64(m16 * (cols / (size_t)w->group) * 4) +
           ALIGN64(m16 * n_act_blocks(w->cols) * 4);
}

static size_t int8_bytes(const kt_matrix *w, int64_t m)
{
    size_t mm = (size_t)m, cols = (size_t)w->cols;
    return ALIGN64(mm * cols) + ALIGN64(mm * n_act_blocks(w->cols) * 4) +
           ALIGN64(mm * (cols / (size_t)w->group) * 4);
}

size_t kt_acts_scratch_bytes(const kt_matrix *w, int64_t m, int amx_tiles, int float_acts)
{
    if (m < 1 || kt_matrix_check(w) != KT_OK)
        return 0;
    if (float_acts)
        return uses_gemm(m, float_acts) ? xt_bytes(w, m) : 0;
    if (w->format == KT_I8 || w->format == KT_I4)
        return int8_bytes(w, m) + amx_bytes(w, m, amx_tiles);
    if (uses_bf16_acts(w->format))
        return ALIGN64((size_t)m * (size_t)w->cols * 2) + amx_bytes(w, m, amx_tiles);
    return 0;
}

/* One token row: q[k] = rint(x[k] / s_b), s_b = max |x| over block b / 127. */
static void quantize_blocks_i8(int8_t *q, float *scale, const float *x, int64_t n)
{
    for (int64_t k = 0, b = 0; k < n; k += KT_ACT_BLOCK, b++) {
        int64_t len = n - k < KT_ACT_BLOCK ? n - k : KT_ACT_BLOCK;
        scale[b] = abs_max(x + k, len) / 127.0f;
        quantize_span(q + k, x + k, len, (struct code_rule){scale[b], 0.0f, 0.0f, -127.0f, 127.0f});
    }
}

/* Sums of the dequantized activations s_b * q[k] over each group (group % 16 == 0):
 * integer sums over 16 values, each inside one block, scaled once. */
static void group_sums(float *sums, const int8_t *q, const float *scale, int64_t cols, int64_t group)
{
    for (int64_t g = 0; g < cols / group; g++) {
        float s = 0.0f;
        for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
            int32_t part = 0;
            for (int j = 0; j < 16; j++)
                part += q[k + j];
            s += scale[k / KT_ACT_BLOCK] * (float)part;
        }
        sums[g] = s;
    }
}

/* I4 rows: in every full 64 columns, the 16-column pieces 1 and 2 trade places,
 * [0-15, 32-47, 16-31, 48-63], the order in which the I4 kernels unpack two
 * blocks of codes (low nibbles of both, then high nibbles; simd_int.h). */
static void interleave_i4(int8_t *q, int64_t cols)
{
    int8_t piece[16];
    for (int64_t k = 0; k + 64 <= cols; k += 64) {
        memcpy(piece, q + k + 16, 16);
        memcpy(q + k + 16, q + k + 32, 16);
        memcpy(q + k + 32, piece, 16);
    }
}

static void prepare_int8(kt_acts *a, const float *x, int64_t m, const kt_matrix *w, char *scratch)
{
    size_t mm = (size_t)m, cols = (size_t)w->cols, nb = n_act_blocks(w->cols);
    a->q = (int8_t *)scratch;
    a->q_scale = (float *)(scratch + ALIGN64(mm * cols));
    a->q_group_sum = (float *)(scratch + ALIGN64(mm * cols) + ALIGN64(mm * nb * 4));
    int64_t n_groups = w->cols / w->group;
    for (int64_t t = 0; t < m; t++) {
        int8_t *qt = a->q + t * w->cols;
        float *st = a->q_scale + t * (int64_t)nb;
        quantize_blocks_i8(qt, st, x + t * w->cols, w->cols);
        group_sums(a->q_group_sum + t * n_groups, qt, st, w->cols, w->group);
        if (w->format == KT_I4)
            interleave_i4(qt, w->cols);
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

/* BF16 panels: element (token t, column k) of block (tb, kc) sits at
 * [tb][kc][k/2 % 16][t % 16][k % 2] (see simd_amx.h); padding tokens are 0. */
static void amx_fill_bf16(uint16_t *panel, const float *x, int64_t m, int64_t cols)
{
    int64_t m16 = (m + 15) / 16 * 16, n_kc = cols / 32;
    for (int64_t t = 0; t < m16; t++)
        for (int64_t k = 0; k < cols; k++) {
            int64_t at = (((t / 16) * n_kc + k / 32) * 16 + (k % 32) / 2) * 32 + (t % 16) * 2 + k % 2;
            panel[at] = t < m ? f32_to_bf16(x[t * cols + k]) : 0;
        }
}

/* int8 panels, one per 32-column block b: (token t, column k) at
 * [tb][b][k/4 % 8][t % 16][k % 4]; block scales and group sums transposed to
 * [tb][b][t % 16] and [tb][g][t % 16]; zeros for the padding tokens. */
static void amx_fill_i8(kt_acts *a, char *base, int64_t m, int64_t cols, int64_t group)
{
    int64_t m16 = (m + 15) / 16 * 16, nb = cols / 32, n_groups = cols / group;
    a->amx_q = (int8_t *)base;
    a->amx_gsum = (float *)(base + ALIGN64((size_t)(m16 * cols)));
    a->amx_scale = (float *)((char *)a->amx_gsum + ALIGN64((size_t)(m16 * n_groups * 4)));
    for (int64_t t = 0; t < m16; t++) {
        int64_t tb = t / 16, tl = t % 16;
        for (int64_t k = 0; k < cols; k++) {
            int64_t at = ((tb * nb + k / 32) * 8 + (k % 32) / 4) * 64 + tl * 4 + k % 4;
            a->amx_q[at] = t < m ? a->q[t * cols + k] : 0;
        }
        for (int64_t b = 0; b < nb; b++)
            a->amx_scale[(tb * nb + b) * 16 + tl] = t < m ? a->q_scale[t * nb + b] : 0.0f;
        for (int64_t g = 0; g < n_groups; g++)
            a->amx_gsum[(tb * n_groups + g) * 16 + tl] = t < m ? a->q_group_sum[t * n_groups + g] : 0.0f;
    }
}

int kt_acts_prepare(kt_acts *acts, const float *x, int64_t m, const kt_matrix *w, int amx_tiles,
                    int float_acts, void *scratch)
{
    if (!acts || !x || m < 1 || kt_matrix_check(w) != KT_OK)
        return KT_EINVAL;
    size_t bytes = kt_acts_scratch_bytes(w, m, amx_tiles, float_acts);
    if (bytes > 0 && !scratch)
        return KT_EINVAL;
    memset(acts, 0, sizeof *acts);
    acts->m = m;
    acts->cols = w->cols;
    acts->format = w->format;
    acts->group = w->group;
    acts->float_acts = float_acts ? 1 : 0;
    acts->f32 = x;
    if (float_acts) {
        if (uses_gemm(m, float_acts)) {
            acts->xt = scratch;
            fill_xt(acts->xt, x, m, w->cols);
        }
        return KT_OK;
    }
    size_t panel_bytes = amx_bytes(w, m, amx_tiles);
    char *panels = panel_bytes ? (char *)scratch + (bytes - panel_bytes) : NULL;   /* the AMX panels go last */
    if (w->format == KT_I8 || w->format == KT_I4) {
        prepare_int8(acts, x, m, w, scratch);
        if (uses_amx(w, m, amx_tiles))
            amx_fill_i8(acts, panels, m, w->cols, w->group);
    } else if (uses_bf16_acts(w->format)) {
        acts->bf16 = scratch;
        for (int64_t i = 0; i < m * w->cols; i++)
            acts->bf16[i] = f32_to_bf16(x[i]);
        if (uses_amx(w, m, amx_tiles)) {
            acts->amx_bf16 = (uint16_t *)panels;
            amx_fill_bf16(acts->amx_bf16, x, m, w->cols);
        }
    }
    return KT_OK;
}
