/* simd_row8_i8w.h: I8 weights in KT_LAYOUT_ROW8 against int16 activations (and 1-2 tokens of int8
 * ones) on AVX2, with the codes widened to int16; included by row8.c.
 *
 * The 8-row I8 kernel (simd_row8_i8.h) splits every load of codes into nibbles for vpmaddubsw and
 * runs int16 activations (the dense layers' decode) as two int8 rows, twice its work. Here each
 * 32-byte load (8 rows x 4 columns) is sign-extended to int16 in two halves (rows 0-3, rows 4-7;
 * vpmovsxbw from memory) and vpmaddwd multiplies it by the token's 4 int16 activations of those
 * columns (one 8-byte broadcast): 16 products a vpmaddwd, no flip and no zero point, and int16
 * activations cost what int8 ones do (figures at row8_i8w_takes).
 *
 * Maths: lane pairs of the two int32 sums hold (row, columns 4j..4j+1) and (row, 4j+2..4j+3);
 * vphaddd joins them into the 8 rows in the order P = [0 1 4 5 2 3 6 7] (P is its own inverse),
 * so the scales are permuted to P per group and the sums back at the end:
 *   acc[i] += s[i, g] * sa[b] * sum_{k in b} q[i, k] * x16[k]       per block (|sum| < 2^27)
 *   acc[i] += mn[i, g] * gsum[g]                                     per group, asymmetric I8
 * x16 is the int8 activations sign-extended, or for split int16 ones (kt_internal.h) the two rows
 * joined, 256 * hi + lo, with the low row's scales. */
#ifndef KT_SIMD_ROW8_I8W_H
#define KT_SIMD_ROW8_I8W_H

#include "simd_row8.h"

#if defined(KT_ROW8_KERNEL) && !defined(__AVX512F__)
#define KT_ROW8_I8W_KERNEL 1

enum { I8W_MAX_TOKENS = 4 };

/* Up to I8W_MAX_TOKENS tokens' activations as the kernel reads them: int16 rows, their block
 * scales and group sums */
typedef struct i8w_acts {
    const int16_t *x16[I8W_MAX_TOKENS];
    const float *sa[I8W_MAX_TOKENS], *gsum[I8W_MAX_TOKENS];
} i8w_acts;

KT_INLINE __m256i bcast8_i16(const int16_t *p)
{
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
}

/* The int32 dots of one block's 8 rows (order P) with TT tokens' int16 activations at x[t] */
KT_INLINE void i8w_block_dots(__m256i dot[I8W_MAX_TOKENS], const uint8_t *block, const int16_t *const *x,
                              int64_t col, const int TT)
{
    __m256i lo[I8W_MAX_TOKENS], hi[I8W_MAX_TOKENS];
    for (int t = 0; t < TT; t++)
        lo[t] = hi[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i w03 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 32 * j)));
        const __m256i w47 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 32 * j + 16)));
        for (int t = 0; t < TT; t++) {
            const __m256i xj = bcast8_i16(x[t] + col + 4 * j);
            lo[t] = _mm256_add_epi32(lo[t], _mm256_madd_epi16(w03, xj));
            hi[t] = _mm256_add_epi32(hi[t], _mm256_madd_epi16(w47, xj));
        }
    }
    for (int t = 0; t < TT; t++)
        dot[t] = _mm256_hadd_epi32(lo[t], hi[t]);
}

/* Rows 8G..8G+7 for the TT tokens of x into out (token t at out[t * ldo], 8 floats) */
KT_INLINE void row8_i8w_group_of(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const i8w_acts *x,
                                 const int TT, const int kind)
{
    const row8_at at = row8_weights_at(w, G);
    const __m256i P = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    __m256 acc[I8W_MAX_TOKENS], zacc[I8W_MAX_TOKENS];
    for (int t = 0; t < TT; t++)
        acc[t] = zacc[t] = _mm256_setzero_ps();
    for (int64_t g = 0, b = 0; g < at.ng; g++) {
        const __m256 ws = _mm256_permutevar8x32_ps(group_scales8(at.scale, at.scale_base, g, kind), P);
        for (int64_t end = b + at.per_group; b < end; b++) {
            const uint8_t *block = at.codes + b * I8_BLOCK_BYTES;
            for (int i = 0; i < 4; i++)
                __builtin_prefetch(block + ROW8_AHEAD + 64 * i);
            __m256i dot[I8W_MAX_TOKENS];
            i8w_block_dots(dot, block, x->x16, 32 * b, TT);
            for (int t = 0; t < TT; t++)
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]),
                                         _mm256_mul_ps(ws, _mm256_set1_ps(x->sa[t][b])), acc[t]);
        }
        if (at.min) {
            const __m256 mn = _mm256_permutevar8x32_ps(group_scales8(at.min, at.min_base, g, kind), P);
            for (int t = 0; t < TT; t++)
                zacc[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x->gsum[t][g]), zacc[t]);
        }
    }
    for (int t = 0; t < TT; t++)
        _mm256_storeu_ps(out + t * ldo, _mm256_permutevar8x32_ps(_mm256_add_ps(acc[t], zacc[t]), P));
}

KT_INLINE void row8_i8w_group(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const i8w_acts *x,
                              const int TT)
{
    switch (w->scale_type) {
    case KT_SCALE_F16: row8_i8w_group_of(out, ldo, w, G, x, TT, KT_SCALE_F16); break;
    case KT_SCALE_K: row8_i8w_group_of(out, ldo, w, G, x, TT, KT_SCALE_K); break;
    case KT_SCALE_KS: row8_i8w_group_of(out, ldo, w, G, x, TT, KT_SCALE_KS); break;
    default: row8_i8w_group_of(out, ldo, w, G, x, TT, KT_SCALE_F32); break;
    }
}

/* Tokens widened at once: 64 int16 rows of 2048 columns (256 KB) stay in L2 while the 8-row
 * groups pass over them */
enum { I8W_CHUNK = 64 };

/* Bytes of the buffer row8_rows_i8w widens a chunk of tokens into: int16 rows, then group sums */
static inline size_t i8w_buffer_bytes(const kt_acts *a)
{
    const int64_t groups = a->cols / a->group;
    return (size_t)I8W_CHUNK * (size_t)(a->cols * 2 + groups * 4);
}

/* Whether the widened kernel takes a for w: I8 with split int16 pairs (any tokens), or 1-2 tokens of
 * int8 rows. Against the nibble kernel, a 49152 x 2048 Q8_0-like matrix from DRAM on 2 threads of a
 * 2-core Zen 3 ran int16 activations 1.13-1.22x (1 token), 1.2-1.46x (2), 1.6x (3-4) faster,
 * int8 ones 1.0-1.07x (1-2 tokens) but 0.88x at 3-4, where the nibble kernel shares each load
 * among more tokens. */
static inline int row8_i8w_takes(const kt_matrix *w, const kt_acts *a)
{
    const int64_t tokens = a->split ? a->m / 2 : a->m;
    return w->format == KT_I8 && a->q && !a->q16 && !a->float_acts && tokens >= 1 && (a->split || tokens <= 2);
}

/* Token t of a widened into slot s of buf: its int8 row, or its split pair joined (group sums
 * added for the mins' term) */
static inline void i8w_widen(uint8_t *buf, const kt_acts *a, int64_t t, int64_t s)
{
    const int64_t cols = a->cols, groups = cols / a->group;
    int16_t *x16 = (int16_t *)buf + s * cols;
    float *gsum = (float *)(buf + (size_t)I8W_CHUNK * (size_t)cols * 2) + s * groups;
    const int64_t row = a->split ? 2 * t : t;
    const int8_t *hi = a->q + row * cols;
    if (a->split) {
        const int8_t *lo = hi + cols;
        for (int64_t k = 0; k < cols; k++)
            x16[k] = (int16_t)(256 * hi[k] + lo[k]);
        for (int64_t g = 0; g < groups; g++)
            gsum[g] = a->q_group_sum[row * groups + g] + a->q_group_sum[(row + 1) * groups + g];
    } else {
        for (int64_t k = 0; k < cols; k++)
            x16[k] = hi[k];
        memcpy(gsum, a->q_group_sum + row * groups, (size_t)groups * sizeof(float));
    }
}

/* The kernel's view of tokens t0..t0+TT-1, widened into slots from s0 */
static inline i8w_acts i8w_view(const uint8_t *buf, const kt_acts *a, int64_t t0, int64_t s0, int TT)
{
    const int64_t cols = a->cols, nb = cols / 32, groups = cols / a->group;
    i8w_acts x;
    for (int t = 0; t < TT; t++) {
        x.x16[t] = (const int16_t *)buf + (s0 + t) * cols;
        x.sa[t] = a->q_scale + (a->split ? 2 * (t0 + t) + 1 : t0 + t) * nb;
        x.gsum[t] = (const float *)(buf + (size_t)I8W_CHUNK * (size_t)cols * 2) + (s0 + t) * groups;
    }
    return x;
}

/* Rows [r0, r1) (multiples of 8) for tokens [c0, c1) (at most I8W_CHUNK), widened into buf */
static inline void row8_chunk_i8w(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                  const kt_acts *a, int64_t c0, int64_t c1, uint8_t *buf)
{
    for (int64_t t = c0; t < c1; t++)
        i8w_widen(buf, a, t, t - c0);
    for (int64_t G = r0 / 8; G < r1 / 8; G++)
        for (int64_t t0 = c0; t0 < c1; t0 += I8W_MAX_TOKENS) {
            float *o = out + t0 * ldo + (G * 8 - r0);
            const int TT = c1 - t0 < I8W_MAX_TOKENS ? (int)(c1 - t0) : I8W_MAX_TOKENS;
            const i8w_acts x = i8w_view(buf, a, t0, t0 - c0, TT);
            switch (TT) {
            case 1: row8_i8w_group(o, ldo, w, G, &x, 1); break;
            case 2: row8_i8w_group(o, ldo, w, G, &x, 2); break;
            case 3: row8_i8w_group(o, ldo, w, G, &x, 3); break;
            default: row8_i8w_group(o, ldo, w, G, &x, 4); break;
            }
        }
}

/* Rows [r0, r1) for every token of a (row8_i8w_takes), in chunks of I8W_CHUNK widened into buf
 * (i8w_buffer_bytes) */
static inline void row8_rows_i8w(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                 const kt_acts *a, uint8_t *buf)
{
    const int64_t m = a->split ? a->m / 2 : a->m;
    for (int64_t c0 = 0; c0 < m; c0 += I8W_CHUNK)
        row8_chunk_i8w(out, ldo, w, r0, r1, a, c0, c0 + I8W_CHUNK < m ? c0 + I8W_CHUNK : m, buf);
}

#endif
#endif
