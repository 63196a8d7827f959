/* simd_row8_i8.h: the 8-row kernel for I8 weights in KT_LAYOUT_ROW8 (kt.h) against int8
 * activations (kt_acts, plain rows), included by simd_row8_pair.h and row8.c: decode (1-2
 * rows of activations) on every build with the 8-row kernel, and prefill on those without the
 * 16-row AVX-512 form (simd_row8_pair.h), that is AVX2.
 *
 * A block of 8 rows and 32 columns is 8 loads of 32 bytes; load j holds columns 4j..4j+3 of
 * each row, against the 4 activation bytes of those columns broadcast to the 8 rows.
 *
 * Maths: the codes q are signed; each load flips their top bit, u = q + 128, the unsigned
 * operand of vpdpbusd / vpmaddubsw. AVX512-VNNI: vpdpbusd straight into int32 (a lane adds 32
 * products of at most 255 * 128 a block), and the group's zero point takes the 128 back:
 *   acc[i] += s[i, g] * sa[b] * sum_{k in b} u[i, k] * qa[k]      per block
 *   acc[i] += (mn[i, g] or 0) - 128 * s[i, g]) * gsum[g]           per group
 * Without VNNI (KT_I8_NIBBLES), u splits into nibbles, u = 16 uh + ul (the flip leaves the low
 * nibble alone: uh = (q >> 4 & 15) ^ 8 = h + 8, h = q >> 4 the signed high nibble), each summed
 * by vpmaddubsw into int16 over the block's 8 loads, then one vpmaddwd by 1 (ul) and one by 16
 * (uh). The high sums start at the activations' q_nibble_bias, -8 * sum qa over the lane's
 * columns, so they end as sum h * qa and the dot is sum q * qa: no -128 s term, and only mins
 * (asymmetric weights) remain for the zero point:
 *   acc[i] += s[i, g] * sa[b] * sum_{k in b} q[i, k] * qa[k]      per block
 *   acc[i] += mn[i, g] * gsum[g]                                   per group, after the blocks
 * int16 bounds (activations -128..127, the low half of a split int16 code included; a lane adds
 * 16 products): ul sums at most 15 * 128 * 16 = 30720 < 32767; an uh sum is at every step the
 * lane's sum of h * qa over the columns done and of -8 * qa over the others, at most
 * 16 * 8 * 128 = 16384.
 * Prefill keeps an 8-row group's codes as split by a chunk's first pass over them in a thread
 * buffer (a split block: per load j, the 32 bytes of ul at 64 j, of uh at 64 j + 32), and the
 * chunk's later passes load both instead of splitting each load again: 4 of the 20 vector ops
 * a load and 4 tokens. */
#ifndef KT_SIMD_ROW8_I8_H
#define KT_SIMD_ROW8_I8_H

#include "simd_row8.h"

#if defined(KT_ROW8_KERNEL)
#define KT_ROW8_I8_KERNEL 1

/* I8_TOKENS: tokens a pass over an 8-row group takes (at most ROW8_TOKENS, the arrays' size, as
 * simd_row8.h's helpers take them). AVX-512 builds run only decode here (1-2); AVX2 prefill
 * holds, per token, two int16 sums and a float accumulator in its 16 registers. */
#if defined(__AVX512F__)
#define I8_TOKENS 2
#else
#define I8_TOKENS 4
#endif
enum { I8_BLOCK_BYTES = 8 * 32, I8_SPLIT_BLOCK_BYTES = 2 * I8_BLOCK_BYTES };

/* How a pass over an 8-row group takes its codes: it reads them; it reads them and stores them
 * split (header); it reads them split */
enum i8_codes { I8_CODES, I8_SPLIT_CODES, I8_READ_SPLIT };

#if !defined(KT_I8_NIBBLES)     /* AVX512-VNNI (kt_internal.h): the codes as they are */
/* acc + u . the 4 signed bytes at p in every lane of 8, the broadcast folded into vpdpbusd's
 * memory operand ({1to8}); GCC 12 does not fold _mm256_set1_epi32 there */
KT_INLINE __m256i dpbusd_bcast8(__m256i acc, __m256i u, const int8_t *p)
{
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}

/* The int32 dots of one block's 8 rows with TT tokens (q: token 0's block, tokens cols apart),
 * two chains a token */
KT_INLINE void i8_block_dots(__m256i dot[ROW8_TOKENS], const uint8_t *block, const int8_t *q, int64_t cols,
                             const int TT)
{
    const __m256i top = _mm256_set1_epi8((char)0x80);
    __m256i hi_dot[ROW8_TOKENS];
    for (int t = 0; t < TT; t++)
        dot[t] = hi_dot[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        const __m256i u0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(block + 32 * j)), top);
        const __m256i u1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(block + 32 * j + 32)), top);
        for (int t = 0; t < TT; t++) {
            dot[t] = dpbusd_bcast8(dot[t], u0, q + t * cols + 4 * j);
            hi_dot[t] = dpbusd_bcast8(hi_dot[t], u1, q + t * cols + 4 * j + 4);
        }
    }
    for (int t = 0; t < TT; t++)
        dot[t] = _mm256_add_epi32(dot[t], hi_dot[t]);
}
#else
/* The dots of the codes q * qa from the nibble sums (header): of the codes at block (fill: where to
 * store the block split, or NULL), or with split_in, of the split block at block; bias: token 0's
 * q_nibble_bias of the block, tokens nb apart */
KT_INLINE void i8_nibble_dots(__m256i dot[ROW8_TOKENS], const uint8_t *block, const int8_t *q, int64_t cols,
                              const int32_t *bias, int64_t nb, uint8_t *fill, const int split_in, const int TT)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(0x08);
    __m256i lo_sum[ROW8_TOKENS], hi_sum[ROW8_TOKENS];
    for (int t = 0; t < TT; t++) {
        lo_sum[t] = _mm256_setzero_si256();
        hi_sum[t] = _mm256_set1_epi32(bias[t * nb]);
    }
    for (int j = 0; j < 8; j++) {
        __m256i ul, uh;
        if (split_in) {
            ul = _mm256_load_si256((const __m256i *)(block + 64 * j));
            uh = _mm256_load_si256((const __m256i *)(block + 64 * j + 32));
        } else {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
            ul = _mm256_and_si256(v, low4);
            uh = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi32(v, 4), low4), eight);
            if (fill) {
                _mm256_store_si256((__m256i *)(fill + 64 * j), ul);
                _mm256_store_si256((__m256i *)(fill + 64 * j + 32), uh);
            }
        }
        for (int t = 0; t < TT; t++) {
            const __m256i x = broadcast4(q + t * cols + 4 * j);
            const __m256i lo = _mm256_maddubs_epi16(ul, x), hi = _mm256_maddubs_epi16(uh, x);
            /* the adds written out keep each sum in its register in this order, as simd_row8.h's
             * block_dots_set does with an empty asm, which here left GCC 12 a vmovdqa behind each */
            __asm__("vpaddw %1, %0, %0" : "+x"(lo_sum[t]) : "x"(lo));
            __asm__("vpaddw %1, %0, %0" : "+x"(hi_sum[t]) : "x"(hi));
        }
    }
    for (int t = 0; t < TT; t++)
        dot[t] = _mm256_add_epi32(_mm256_madd_epi16(lo_sum[t], _mm256_set1_epi16(1)),
                                  _mm256_madd_epi16(hi_sum[t], _mm256_set1_epi16(16)));
}
#endif

/* Rows 8G..8G+7 for tokens t0..t0+TT-1 into out (token t at out[t * ldo], 8 floats), one group
 * at a time: two groups a register read two streams 8 rows apart, which ran one MoE layer's
 * decode 0.7x as fast as the row layout on AVX-512; one stream matches it. stream: the first
 * pass over the group's codes, which prefetches them (later token tiles find them in L1/L2).
 * codes: where the pass reads them (i8_codes), split the group's split blocks for the other two.
 * As simd_row8.h's row8_group_of: the scale kind a constant; with VNNI zero points apart, with
 * nibbles only mins, after the blocks (header). */
KT_INLINE void row8_i8_group_of(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a,
                                int64_t t0, int stream, uint8_t *split, const int codes, const int TT,
                                const int kind)
{
    const row8_at at = row8_locate(w, G, a, t0);
    __m256 acc[ROW8_TOKENS];
    for (int t = 0; t < TT; t++)
        acc[t] = _mm256_setzero_ps();
#if defined(KT_I8_NIBBLES)
    const int32_t *bias = a->q_nibble_bias + t0 * at.nb;
#else
    __m256 zacc[ROW8_TOKENS];
    for (int t = 0; t < TT; t++)
        zacc[t] = _mm256_setzero_ps();
#endif
    for (int64_t g = 0, b = 0; g < at.ng; g++) {
        const __m256 ws = group_scales8(at.scale, at.scale_base, g, kind);
        for (int64_t end = b + at.per_group; b < end; b++) {
            const uint8_t *block = at.codes + b * I8_BLOCK_BYTES;
            for (int i = 0; stream && i < 4; i++)
                __builtin_prefetch(block + ROW8_AHEAD + 64 * i);
            __m256i dot[ROW8_TOKENS];
#if defined(KT_I8_NIBBLES)
            uint8_t *split_block = split ? split + b * I8_SPLIT_BLOCK_BYTES : NULL;
            i8_nibble_dots(dot, codes == I8_READ_SPLIT ? split_block : block, at.q + b * 32, at.cols, bias + b,
                           at.nb, codes == I8_SPLIT_CODES ? split_block : NULL, codes == I8_READ_SPLIT, TT);
#else
            (void)split, (void)codes;     /* always I8_CODES: VNNI sums the codes as they are */
            i8_block_dots(dot, block, at.q + b * 32, at.cols, TT);
#endif
            accumulate_block(acc, dot, ws, at.sa + b, at.nb, TT);
        }
#if !defined(KT_I8_NIBBLES)
        __m256 zero_point = _mm256_mul_ps(ws, _mm256_set1_ps(-128.0f));
        if (at.min)
            zero_point = _mm256_add_ps(zero_point, group_scales8(at.min, at.min_base, g, kind));
        for (int t = 0; t < TT; t++)
            zacc[t] = _mm256_fmadd_ps(zero_point, _mm256_set1_ps(at.gsum[t * at.ng + g]), zacc[t]);
#endif
    }
#if defined(KT_I8_NIBBLES)
    for (int64_t g = 0; at.min && g < at.ng; g++) {
        const __m256 mn = group_scales8(at.min, at.min_base, g, kind);
        for (int t = 0; t < TT; t++)
            acc[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(at.gsum[t * at.ng + g]), acc[t]);
    }
#else
    for (int t = 0; t < TT; t++)
        acc[t] = _mm256_add_ps(acc[t], zacc[t]);
#endif
    store_rows8(out, ldo, acc, TT);
}

KT_INLINE void row8_i8_group(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a, int64_t t0,
                             int stream, uint8_t *split, const int codes, const int TT)
{
    switch (w->scale_type) {
    case KT_SCALE_F16: row8_i8_group_of(out, ldo, w, G, a, t0, stream, split, codes, TT, KT_SCALE_F16); break;
    case KT_SCALE_K: row8_i8_group_of(out, ldo, w, G, a, t0, stream, split, codes, TT, KT_SCALE_K); break;
    case KT_SCALE_KS: row8_i8_group_of(out, ldo, w, G, a, t0, stream, split, codes, TT, KT_SCALE_KS); break;
    default: row8_i8_group_of(out, ldo, w, G, a, t0, stream, split, codes, TT, KT_SCALE_F32); break;
    }
}

/* One pass: n tokens from t0 (I8_TOKENS at most), codes read as row8_i8_group_of says */
KT_INLINE void row8_i8_pass(float *o, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a, int64_t t0,
                            int64_t n, int stream, uint8_t *split, const int codes)
{
    switch (n < I8_TOKENS ? n : I8_TOKENS) {
    case 1: row8_i8_group(o, ldo, w, G, a, t0, stream, split, codes, 1); break;
#if I8_TOKENS > 2
    case 2: row8_i8_group(o, ldo, w, G, a, t0, stream, split, codes, 2); break;
    case 3: row8_i8_group(o, ldo, w, G, a, t0, stream, split, codes, 3); break;
#endif
    default: row8_i8_group(o, ldo, w, G, a, t0, stream, split, codes, I8_TOKENS); break;
    }
}

/* Tokens [c0, c1) of rows 8G..8G+7, I8_TOKENS at a time; split: a buffer for the group's split
 * blocks, which the first pass fills and the others read, or NULL */
KT_INLINE void row8_i8_tokens(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a, int64_t c0,
                              int64_t c1, uint8_t *split)
{
    (void)split;     /* NULL where the build has no split (KT_I8_NIBBLES) */
    for (int64_t t0 = c0; t0 < c1; t0 += I8_TOKENS) {
        float *o = out + t0 * ldo;
#if defined(KT_I8_NIBBLES)
        if (split) {
            if (t0 == c0)
                row8_i8_pass(o, ldo, w, G, a, t0, c1 - t0, 1, split, I8_SPLIT_CODES);
            else
                row8_i8_pass(o, ldo, w, G, a, t0, c1 - t0, 0, split, I8_READ_SPLIT);
            continue;
        }
#endif
        row8_i8_pass(o, ldo, w, G, a, t0, c1 - t0, t0 == c0, NULL, I8_CODES);
    }
}

/* A thread buffer for one group's split codes when the build splits them and a chunk of tokens
 * [c0, c1) takes more than one pass; else NULL (the passes read the codes) */
static inline uint8_t *i8_split_buffer(const kt_matrix *w, int64_t c0, int64_t c1)
{
#if defined(KT_I8_NIBBLES)
    if (c1 - c0 > I8_TOKENS)
        return kt_thread_buffer(KT_BUF_ROW8_SPLIT, (size_t)(w->cols / 32) * I8_SPLIT_BLOCK_BYTES);
#else
    (void)w, (void)c0, (void)c1;
#endif
    return NULL;
}

/* Rows [r0, r1) (multiples of 8) for every token, in chunks of ROW8_CHUNK tokens whose
 * activations stay in L2 while each 8-row group (8 KB a 1024 columns, in L1 after the chunk's
 * first tokens; split, 16 KB) passes over them */
static inline void row8_rows_i8(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                const kt_acts *a)
{
    for (int64_t c0 = 0; c0 < a->m; c0 += ROW8_CHUNK) {
        const int64_t c1 = c0 + ROW8_CHUNK < a->m ? c0 + ROW8_CHUNK : a->m;
        uint8_t *split = i8_split_buffer(w, c0, c1);
        for (int64_t G = r0 / 8; G < r1 / 8; G++)
            row8_i8_tokens(out + (G * 8 - r0), ldo, w, G, a, c0, c1, split);
    }
}

#endif
#endif
