/* acts.c: the activations every matrix-rows kernel consumes (kt_acts,
 * kt_internal.h), prepared once per (tokens, weight format) so every row block of
 * W reuses them.
 *
 * Scratch layout (each part 64-byte aligned), nb = ceil(cols / 32):
 *   integer formats, KT_ACTS_INT8:  q int8 [m, cols] | q_scale f32 [m, nb] | q_group_sum f32 [m, cols/group]
 *   integer formats, KT_ACTS_INT16: q16 int16 [m, cols] | q_scale | q_group_sum, the same
 *   BF16 where the ISA has a bf16 dot product: bf16 [m, cols]
 *   KT_ACTS_F32 from KT_GEMM_MIN_TOKENS tokens: the GEMM's transposed tiles
 *   other float formats: nothing (the kernels read x directly)
 *   then, with AMX tiles, the AMX panels. */
#include <math.h>
#include <string.h>
#include "kt_internal.h"
#include "simd_transpose.h"

#define ALIGN64(n) (((n) + (size_t)63) & ~(size_t)63)

static int uses_bf16_acts(int32_t format)
{
#if defined(__AVX512BF16__)
    return format == KT_BF16;
#else
    (void)format;
    return 0;
#endif
}

/* AMX panels (amx variant, tiles enabled): BF16 needs cols % 32 == 0, I8 group % 32 == 0;
 * ROW8 matrices (INT4 and I8) take bf16 panels for the BF16 tiles (simd_amx_row8.h). */
static int uses_amx(const kt_matrix *w, int64_t m, int amx_tiles)
{
#if defined(KT_AMX_BUILD)
    if (!amx_tiles)
        return 0;
    if (w->layout == KT_LAYOUT_ROW8) {
        if (w->format == KT_I6)     /* its 8-row kernel, not the tiles */
            return 0;
        int64_t least = w->format == KT_I4 ? KT_AMX_MIN_TOKENS_ROW8 : KT_AMX_MIN_TOKENS_ROW8_I8;
        return m >= least && w->group % 32 == 0;
    }
    if (w->format == KT_BF16)
        return m >= KT_AMX_MIN_TOKENS_BF16 && w->cols % 32 == 0;
    return w->format == KT_I8 && m >= KT_AMX_MIN_TOKENS_I8 && w->group % 32 == 0;
#else
    (void)w;
    (void)m;
    (void)amx_tiles;
    return 0;
#endif
}

/* BF16 prefill on AVX512-BF16 builds, where the AMX tiles do not take the tokens: the pair
 * GEMM (gemm_bf16.c) on bf16 panels instead of the row tiles on bf16 rows */
static int uses_pair_gemm(const kt_matrix *w, int64_t m, int amx_tiles)
{
    return uses_bf16_acts(w->format) && m >= KT_BF16_GEMM_MIN_TOKENS && w->cols % 32 == 0 &&
           !uses_amx(w, m, amx_tiles);
}

/* The GEMM serves the exact path (float activations) from KT_GEMM_MIN_TOKENS on.
 * Not the int8 path: on a 2-core Zen 3 its integer tiles ran an MoE layer's
 * prefill (32 tokens per expert) ~20% faster than dequantize-then-GEMM. */
static int uses_gemm(int64_t m)
{
#if defined(KT_GEMM_BUILD)
    return m >= KT_GEMM_MIN_TOKENS;
#else
    (void)m;
    return 0;
#endif
}

/* AVX2 builds (no AVX-512), from KT_GEMM_MIN_TOKENS tokens: I8 with groups of at most 32
 * goes to the GEMM. Its integer tiles spend a vpsignb, a vpmaddwd and a float scaling per
 * 32 products (one MoE layer, Q8_0-like, T=512 on a 2-core Zen 3: 1.15x with the GEMM);
 * per-channel I8 keeps them (0.77x with the GEMM), and so do INT4 and the float formats. */
int32_t kt_acts_expert_kind(const kt_matrix *w, int64_t m)
{
#if defined(KT_GEMM_BUILD) && !defined(__AVX512F__)
    if (w->format == KT_I8 && w->group <= 32 && w->layout != KT_LAYOUT_ROW8 && uses_gemm(m))
        return KT_ACTS_F32;
#else
    (void)w;
    (void)m;
#endif
    return KT_ACTS_INT8;
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

/* The BF16 panels of m tokens (simd_amx.h), padded to whole token blocks */
static size_t bf16_panel_bytes(const kt_matrix *w, int64_t m)
{
    return ALIGN64((size_t)(m + 15) / 16 * 16 * (size_t)w->cols * 2);
}

static size_t amx_bytes(const kt_matrix *w, int64_t m, int amx_tiles)
{
    if (!uses_amx(w, m, amx_tiles))
        return 0;
    if (w->format == KT_BF16 || w->layout == KT_LAYOUT_ROW8)
        return bf16_panel_bytes(w, m);
    size_t m16 = (size_t)(m + 15) / 16 * 16, cols = (size_t)w->cols;
    return ALIGN64(m16 * cols) + ALIGN64(m16 * (cols / (size_t)w->group) * 4) +
           ALIGN64(m16 * n_act_blocks(w->cols) * 4);
}

/* Whether int8 rows for w carry q_nibble_bias (kt_internal.h) */
static int has_nibble_bias(const kt_matrix *w, size_t code_bytes)
{
#if defined(KT_I8_NIBBLES)
    return code_bytes == 1 && w->format == KT_I8 && w->layout == KT_LAYOUT_ROW8;
#else
    (void)w;
    (void)code_bytes;
    return 0;
#endif
}

/* Where the parts of int_acts lie in scratch, in bytes from its start: codes of code_bytes
 * (1: int8, 2: int16) | block scales | group sums | nibble biases (if any) | end */
typedef struct {
    size_t scales, sums, biases, end;
} int_acts_layout;

static int_acts_layout int_acts_at(const kt_matrix *w, int64_t m, size_t code_bytes)
{
    size_t mm = (size_t)m, cols = (size_t)w->cols, blocks = ALIGN64(mm * n_act_blocks(w->cols) * 4);
    int_acts_layout at;
    at.scales = ALIGN64(mm * cols * code_bytes);
    at.sums = at.scales + blocks;
    at.biases = at.sums + ALIGN64(mm * (cols / (size_t)w->group) * 4);
    at.end = at.biases + (has_nibble_bias(w, code_bytes) ? blocks : 0);
    return at;
}

static size_t int_acts_bytes(const kt_matrix *w, int64_t m, size_t code_bytes)
{
    return int_acts_at(w, m, code_bytes).end;
}

/* INT16 is for integer weights; float formats take float32 activations then */
static int32_t effective_kind(const kt_matrix *w, int32_t kind)
{
    return kind == KT_ACTS_INT16 && !kt_int_format(w->format) ? KT_ACTS_F32 : kind;
}

/* ROW8 matrices take int16 activations split into int8 pairs (kt_internal.h): INT4 always,
 * I8 where the 16-row kernel runs it and I6 where its 8-row kernel does (elsewhere the row
 * kernels, I6's on copies as I8 rows, would meet the pairs' -128, which their sign trick
 * cannot negate, so those keep int16 codes) */
static int splits_int16(const kt_matrix *w, int32_t kind)
{
    if (kind != KT_ACTS_INT16 || w->layout != KT_LAYOUT_ROW8)
        return 0;
    if (w->format == KT_I6)
        return (kt_row8_kernel() & KT_ROW8_I6) != 0;
    return w->format == KT_I4 || (kt_row8_kernel() & KT_ROW8_I8);
}

/* KT_ACTS_BF16 (kt.h): bf16 panels for the BF16 tiles beside the split int16 pairs, which
 * serve the rows the tiles leave; where this is 0 the kind is KT_ACTS_INT16 */
static int bf16_tiles(const kt_matrix *w, int amx_tiles, int32_t kind)
{
#if defined(KT_AMX_BUILD)
    return kind == KT_ACTS_BF16 && amx_tiles && w->layout == KT_LAYOUT_ROW8 && w->group % 32 == 0 && w->format != KT_I6 &&
           splits_int16(w, KT_ACTS_INT16);
#else
    (void)w;
    (void)amx_tiles;
    (void)kind;
    return 0;
#endif
}

size_t kt_acts_scratch_bytes(const kt_matrix *w, int64_t m, int amx_tiles, int32_t kind)
{
    if (m < 1 || kt_matrix_check(w) != KT_OK)
        return 0;
    const int tiles = bf16_tiles(w, amx_tiles, kind);
    kind = effective_kind(w, kind == KT_ACTS_BF16 ? KT_ACTS_INT16 : kind);
    if (kind == KT_ACTS_F32)
        return uses_gemm(m) ? xt_bytes(w, m) : 0;
    if (splits_int16(w, kind))     /* the int8 pairs, then one int16 row being split, then the tiles' panels */
        return int_acts_bytes(w, 2 * m, 1) + ALIGN64((size_t)w->cols * 2) + (tiles ? bf16_panel_bytes(w, m) : 0);
    if (kind == KT_ACTS_INT16)
        return int_acts_bytes(w, m, 2);
    if (kt_int_format(w->format))
        return int_acts_bytes(w, m, 1) + amx_bytes(w, m, amx_tiles);
    if (uses_bf16_acts(w->format))     /* bf16 rows, then the pair GEMM's or the AMX tiles' panels */
        return ALIGN64((size_t)m * (size_t)w->cols * 2) +
               (uses_pair_gemm(w, m, amx_tiles) ? bf16_panel_bytes(w, m) : amx_bytes(w, m, amx_tiles));
    return 0;
}

/* Sums of the dequantized activations s_b * q[k] over each group (group % 16 == 0):
 * integer sums over 16 values, each inside one block, scaled once. q holds
 * int8 (code_bytes 1) or int16 (2) codes. */
static void group_sums(float *sums, const void *q, size_t code_bytes, const float *scale, int64_t cols,
                       int64_t group)
{
    for (int64_t g = 0; g < cols / group; g++) {
        float s = 0.0f;
        for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
            int32_t part = 0;
            for (int j = 0; j < 16; j++)
                part += code_bytes == 2 ? ((const int16_t *)q)[k + j] : ((const int8_t *)q)[k + j];
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

/* Points a's codes (int8 or int16), block scales, group sums and nibble biases into scratch. */
static void place_int_acts(kt_acts *a, int64_t m, const kt_matrix *w, char *scratch, size_t code_bytes)
{
    const int_acts_layout at = int_acts_at(w, m, code_bytes);
    if (code_bytes == 2)
        a->q16 = (int16_t *)scratch;
    else
        a->q = (int8_t *)scratch;
    a->q_scale = (float *)(scratch + at.scales);
    a->q_group_sum = (float *)(scratch + at.sums);
    if (at.end > at.biases)
        a->q_nibble_bias = (int32_t *)(scratch + at.biases);
}

/* One int8 row's q_nibble_bias (kt_internal.h), a block at a time (ROW8: cols % 64 == 0) */
static void nibble_biases(int32_t *bias, const int8_t *q, int64_t cols)
{
    for (int64_t b = 0; b < cols / KT_ACT_BLOCK; b++) {
        const int8_t *block = q + b * KT_ACT_BLOCK;
        int32_t low = 0, high = 0;
        for (int j = 0; j < KT_ACT_BLOCK; j += 4) {
            low += block[j] + block[j + 1];
            high += block[j + 2] + block[j + 3];
        }
        uint32_t low16 = (uint16_t)(int16_t)(-8 * low), high16 = (uint16_t)(int16_t)(-8 * high);
        bias[b] = (int32_t)(low16 | high16 << 16);
    }
}

/* One token row in int16 blocks: q[k] = rint(x[k] / s_b), s_b = max |x| over block
 * b / limit, so |x[k] - s_b * q[k]| <= max |x| / (2 * limit) (NaN becomes 0). */
static void quantize_blocks_i16(int16_t *q, float *scale, const float *x, int64_t n, float limit)
{
    for (int64_t k = 0, b = 0; k < n; k += KT_ACT_BLOCK, b++) {
        int64_t len = n - k < KT_ACT_BLOCK ? n - k : KT_ACT_BLOCK;
        scale[b] = kt_abs_max(x + k, len) / limit;
        float divisor = scale[b] == 0.0f ? 1.0f : scale[b];
        for (int64_t j = 0; j < len; j++) {
            float v = rintf(x[k + j] / divisor);
            q[k + j] = (int16_t)(v != v ? 0.0f : v > limit ? limit : v < -limit ? -limit : v);
        }
    }
}

/* codes of code_bytes (1: int8, 2: int16) for every token row, their block scales
 * and group sums; int8 rows of I4 weights interleaved (interleave_i4) */
static void prepare_int(kt_acts *a, const float *x, int64_t m, const kt_matrix *w, char *scratch,
                        size_t code_bytes)
{
    int64_t cols = w->cols, nb = (int64_t)n_act_blocks(cols), n_groups = cols / w->group;
    place_int_acts(a, m, w, scratch, code_bytes);
    for (int64_t t = 0; t < m; t++) {
        float *st = a->q_scale + t * nb;
        void *qt;
        if (code_bytes == 2) {
            qt = a->q16 + t * cols;
            quantize_blocks_i16(qt, st, x + t * cols, cols, 32767.0f);
        } else {
            qt = a->q + t * cols;
            kt_quantize_blocks_i8(qt, st, x + t * cols, cols);
        }
        group_sums(a->q_group_sum + t * n_groups, qt, code_bytes, st, cols, w->group);
        if (a->q_nibble_bias)
            nibble_biases(a->q_nibble_bias + t * nb, qt, cols);
        if (code_bytes == 1 && w->format == KT_I4)
            interleave_i4(qt, cols);
    }
}

/* Token rows as int8 pairs (kt_internal.h, KT_SPLIT_MAX): row 2t the high digits
 * of the int16 codes with scale 256 * s, row 2t + 1 the low ones with scale s;
 * both interleaved for I4 like any int8 row. */
static void prepare_split(kt_acts *a, const float *x, int64_t m, const kt_matrix *w, char *scratch)
{
    int64_t cols = w->cols, nb = (int64_t)n_act_blocks(cols), n_groups = cols / w->group;
    place_int_acts(a, 2 * m, w, scratch, 1);
    int16_t *q16 = (int16_t *)(scratch + int_acts_bytes(w, 2 * m, 1));
    for (int64_t t = 0; t < m; t++) {
        int8_t *hi = a->q + 2 * t * cols, *lo = hi + cols;
        float *s_hi = a->q_scale + 2 * t * nb, *s_lo = s_hi + nb;
        quantize_blocks_i16(q16, s_lo, x + t * cols, cols, (float)KT_SPLIT_MAX);
        for (int64_t k = 0; k < cols; k++) {
            int32_t h = (q16[k] + 128 + 32768) / 256 - 128;      /* rint(q16 / 256), ties up */
            hi[k] = (int8_t)h;
            lo[k] = (int8_t)(q16[k] - 256 * h);
        }
        for (int64_t b = 0; b < nb; b++)
            s_hi[b] = 256.0f * s_lo[b];
        group_sums(a->q_group_sum + 2 * t * n_groups, hi, 1, s_hi, cols, w->group);
        group_sums(a->q_group_sum + (2 * t + 1) * n_groups, lo, 1, s_lo, cols, w->group);
        if (a->q_nibble_bias) {
            nibble_biases(a->q_nibble_bias + 2 * t * nb, hi, cols);
            nibble_biases(a->q_nibble_bias + (2 * t + 1) * nb, lo, cols);
        }
        if (w->format == KT_I4) {
            interleave_i4(hi, cols);
            interleave_i4(lo, cols);
        }
    }
    a->m = 2 * m;
    a->split = 1;
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

/* dst[i] = x[i] rounded to bf16 (nearest even), 16 at a time where the ISA converts */
static void to_bf16(uint16_t *dst, const float *x, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++)
        dst[i] = f32_to_bf16(x[i]);
}

/* BF16 panels: element (token t, column k) of block (tb, kc) sits at
 * [tb][kc][k/2 % 16][t % 16][k % 2] (see simd_amx.h); padding tokens are 0. */
static void fill_bf16_panels(uint16_t *panel, const float *x, int64_t m, int64_t cols)
{
#if defined(__AVX512BF16__)
    /* a block is 16 tokens' 32 columns as bf16 pairs: a 16 x 16 transpose of dwords */
    int64_t n_tb = (m + 15) / 16, n_kc = cols / 32;
    for (int64_t tb = 0; tb < n_tb; tb++)
        for (int64_t kc = 0; kc < n_kc; kc++) {
            __m512 r[16];
            for (int t = 0; t < 16; t++) {
                int64_t tok = tb * 16 + t;
                const float *src = x + tok * cols + kc * 32;
                r[t] = tok < m ? _mm512_castsi512_ps((__m512i)_mm512_cvtne2ps_pbh(
                                     _mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)))
                               : _mm512_setzero_ps();
            }
            transpose16_ps(r);
            uint16_t *block = panel + (tb * n_kc + kc) * 512;
            for (int p = 0; p < 16; p++)
                _mm512_storeu_ps((float *)(block + p * 32), r[p]);
        }
#else
    (void)panel;
    (void)x;
    (void)m;
    (void)cols;
#endif
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
                    int32_t kind, void *scratch)
{
    if (!acts || !x || m < 1 || kt_matrix_check(w) != KT_OK)
        return KT_EINVAL;
    if (kind != KT_ACTS_INT8 && kind != KT_ACTS_F32 && kind != KT_ACTS_INT16 && kind != KT_ACTS_BF16)
        return KT_EINVAL;
    size_t bytes = kt_acts_scratch_bytes(w, m, amx_tiles, kind);
    const int tiles = bf16_tiles(w, amx_tiles, kind);
    kind = effective_kind(w, kind == KT_ACTS_BF16 ? KT_ACTS_INT16 : kind);
    if (bytes > 0 && !scratch)
        return KT_EINVAL;
    memset(acts, 0, sizeof *acts);
    acts->m = m;
    acts->cols = w->cols;
    acts->format = w->format;
    acts->group = w->group;
    acts->float_acts = kind == KT_ACTS_F32;
    acts->f32 = x;
    if (kind == KT_ACTS_F32) {
        if (uses_gemm(m)) {
            acts->xt = scratch;
            fill_xt(acts->xt, x, m, w->cols);
        }
        return KT_OK;
    }
    if (splits_int16(w, kind)) {
        prepare_split(acts, x, m, w, scratch);
        if (tiles) {
            acts->amx_bf16 = (uint16_t *)((char *)scratch + (bytes - bf16_panel_bytes(w, m)));
            fill_bf16_panels(acts->amx_bf16, x, m, w->cols);
        }
        return KT_OK;
    }
    if (kind == KT_ACTS_INT16) {
        prepare_int(acts, x, m, w, scratch, 2);
        return KT_OK;
    }
    size_t panel_bytes = amx_bytes(w, m, amx_tiles);
    char *panels = panel_bytes ? (char *)scratch + (bytes - panel_bytes) : NULL;   /* the AMX panels go last */
    if (kt_int_format(w->format)) {
        prepare_int(acts, x, m, w, scratch, 1);
        if (uses_amx(w, m, amx_tiles) && w->layout == KT_LAYOUT_ROW8) {
            acts->amx_bf16 = (uint16_t *)panels;
            fill_bf16_panels(acts->amx_bf16, x, m, w->cols);
        } else if (uses_amx(w, m, amx_tiles)) {
            amx_fill_i8(acts, panels, m, w->cols, w->group);
        }
    } else if (uses_bf16_acts(w->format)) {
        acts->bf16 = scratch;
        to_bf16(acts->bf16, x, m * w->cols);
        if (uses_pair_gemm(w, m, amx_tiles)) {     /* the rows serve a last short block (gemm_bf16.c) */
            acts->bf16_pairs = (uint16_t *)((char *)scratch + ALIGN64((size_t)m * (size_t)w->cols * 2));
            fill_bf16_panels(acts->bf16_pairs, x, m, w->cols);
        } else if (uses_amx(w, m, amx_tiles)) {
            acts->amx_bf16 = (uint16_t *)panels;
            fill_bf16_panels(acts->amx_bf16, x, m, w->cols);
        }
    }
    return KT_OK;
}
