/* simd_row8.h: the 8-row decode kernel for I4 weights in KT_LAYOUT_ROW8 (kt.h)
 * against int8 activations (kt_acts), included by row8.c only.
 *
 * One 32-byte load of a 32-column block holds 4 bytes of each of 8 rows: the same
 * 8 columns (low nibbles k..k+3, high nibbles k+16..k+19) of all 8 rows. Each
 * 4-byte group of activations is broadcast to the 8 rows (vpbroadcastd), and
 * vpmaddubsw adds code x activation pairs per row, so after the block's 4 loads
 * the 8 rows' int16 sums lie in the lanes of one register: one vpmaddwd, one
 * vcvtdq2ps and one vfmadd with the 8 rows' scales for the whole block, where the
 * row-at-a-time kernels (simd_int.h) spend them per row.
 *
 * Maths (simd_int.h): for token t, block b in group g and 8-row lane i,
 *   acc[i] += s[i, g] * sa[b] * sum_{k in b} qw[i, k] * qa[k]
 * and once per group the zero point, -8 * s[i, g] (symmetric) or mn[i, g], times
 * gsum[g] = sum_{k in g} sa[b(k)] * qa[k] (kt_acts.q_group_sum).
 * int16 bound: a lane adds 8 pair sums of a block, each <= 2 * 15 * 128 = 3840
 * (activations are -127..127, or -128..127 for the low half of a split int16
 * code), so <= 30720 < 32767. */
#ifndef KT_SIMD_ROW8_H
#define KT_SIMD_ROW8_H

#include <string.h>
#include "kt_internal.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KT_ROW8_KERNEL 1

#ifndef KT_INLINE
#define KT_INLINE static inline __attribute__((always_inline))
#endif

enum { ROW8_BLOCK_BYTES = 8 * 16, ROW8_AHEAD = 1024, ROW8_TOKENS = 4, ROW8_CHUNK = 64 };

/* Offset of columns 0-15 of block b in the I4 activations, which kt_acts
 * interleaves per 64 columns ([b 0-15 | b+1 0-15 | b 16-31 | b+1 16-31]);
 * columns 16-31 are 32 bytes further. Needs cols % 64 == 0. */
KT_INLINE int64_t act_piece(int64_t b) { return (b / 2) * 64 + (b % 2) * 16; }

KT_INLINE __m256i broadcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* int32 dot of the block's 8 rows (lanes; codes lo, hi per load) with one token's activations at q.
 * AVX512-VNNI: vpdpbusd adds each lane's 4 code x activation products straight into int32, in two
 * chains (low and high nibbles) to halve the dependency chain; the sums are the same integers as the
 * AVX2 path's, whose int16 partial sums never saturate (bound above). KT_ROW8_EMULATE_DPBUSD runs
 * that path on AVX2 with an exact stand-in for vpdpbusd (codes <= 15), so hosts without VNNI test it. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ROW8_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(KT_ROW8_EMULATE_DPBUSD)
#define ROW8_DPBUSD(acc, u, s) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif

#if defined(ROW8_DPBUSD)
KT_INLINE __m256i block_dot_8rows(const __m256i lo[4], const __m256i hi[4], const int8_t *q)
{
    __m256i lo_acc = _mm256_setzero_si256(), hi_acc = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        lo_acc = ROW8_DPBUSD(lo_acc, lo[j], broadcast4(q + 4 * j));
        hi_acc = ROW8_DPBUSD(hi_acc, hi[j], broadcast4(q + 32 + 4 * j));
    }
    return _mm256_add_epi32(lo_acc, hi_acc);
}
#else
KT_INLINE __m256i block_dot_8rows(const __m256i lo[4], const __m256i hi[4], const int8_t *q)
{
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], broadcast4(q + 4 * j)),
                                     _mm256_maddubs_epi16(hi[j], broadcast4(q + 32 + 4 * j)));
        acc = _mm256_add_epi16(acc, p);
    }
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
}
#endif

/* Prefill form of block_dot_8rows for TT (1-4) tokens of a packed set (row8_set below): the
 * block's 4 loads are the outer loop, so only one load's codes are live beside one block
 * accumulator per token (int16, or int32 with vpdpbusd) and the float ones: 2 * TT + 6
 * registers, no spills on AVX2's 16. The empty asm keeps each token's sum in its register in
 * this order: without it GCC 12 computed all 32 products first and spilled them (MoE prefill
 * 1.2x slower). qs: the block's activations, [TT][32] (columns 0-15 then 16-31), so every
 * broadcast is a constant offset from qs and the loop needs no address arithmetic. */
KT_INLINE void block_dots_set(__m256i dot[4], const __m256i low4, const uint8_t *block, const int8_t *qs,
                              const int TT)
{
#if defined(ROW8_DPBUSD)
    /* two chains a token (low and high nibbles), as block_dot_8rows: with one chain of 8
     * vpdpbusd a token the block waited on their latency (MoE layer T=512 on Zen 4 1.05x);
     * 3 * TT + 6 registers, which AVX-512's 32 hold */
    __m256i hi_dot[4];
    for (int t = 0; t < TT; t++)
        dot[t] = hi_dot[t] = _mm256_setzero_si256();
#else
    for (int t = 0; t < TT; t++)
        dot[t] = _mm256_setzero_si256();
#endif
    for (int j = 0; j < 4; j++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
        __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int t = 0; t < TT; t++) {
            const int8_t *q = qs + t * KT_ACT_BLOCK + 4 * j;
#if defined(ROW8_DPBUSD)
            dot[t] = ROW8_DPBUSD(dot[t], lo, broadcast4(q));
            hi_dot[t] = ROW8_DPBUSD(hi_dot[t], hi, broadcast4(q + 16));
            __asm__("" : "+x"(hi_dot[t]));
#else
            dot[t] = _mm256_add_epi16(dot[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(q)),
                                                               _mm256_maddubs_epi16(hi, broadcast4(q + 16))));
#endif
            __asm__("" : "+x"(dot[t]));
        }
    }
#if defined(ROW8_DPBUSD)
    for (int t = 0; t < TT; t++)
        dot[t] = _mm256_add_epi32(dot[t], hi_dot[t]);
#else
    for (int t = 0; t < TT; t++)
        dot[t] = _mm256_madd_epi16(dot[t], _mm256_set1_epi16(1));
#endif
}

/* The int32 dots of one block's 8 rows with TT (1-2) tokens' activations in kt_acts (qb:
 * token 0's piece): the 4 loads' codes are unpacked once and kept for the tokens. */
KT_INLINE void block_dots(__m256i dot[2], const __m256i low4, const uint8_t *block, const int8_t *qb,
                          int64_t cols, const int TT)
{
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; j++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
        lo[j] = _mm256_and_si256(v, low4);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    for (int t = 0; t < TT; t++)
        dot[t] = block_dot_8rows(lo, hi, qb + t * cols);
}

/* The 8 subs of group g (two-level scales: uint8, or int8 for KT_SCALE_KS) as floats */
KT_INLINE __m256 group_subs8(const char *t, int64_t g, int kind)
{
    const __m128i subs = _mm_loadl_epi64((const __m128i *)(t + g * 8));
    return _mm256_cvtepi32_ps(kind == KT_SCALE_KS ? _mm256_cvtepi8_epi32(subs) : _mm256_cvtepu8_epi32(subs));
}

/* The 8 rows' scales (or mins) of group g, t and base pointing at their 8-row group's
 * (kt.h kt_scale_type): floats, halves, or uint8 (int8) subs times the halves of their 8 groups */
KT_INLINE __m256 group_scales8(const char *t, const uint16_t *base, int64_t g, int kind)
{
    if (kt_two_level(kind)) {
        const __m256 sub = group_subs8(t, g, kind);
        const __m128i halves = _mm_loadu_si128((const __m128i *)(base + (g / KT_SCALE_K_GROUPS) * 8));
        return _mm256_mul_ps(sub, _mm256_cvtph_ps(halves));
    }
    if (kind == KT_SCALE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + g * 16)));
    return _mm256_loadu_ps((const float *)(t + g * 32));
}

/* Where 8-row group G's codes, scales and mins (NULL without), and the activations of
 * tokens from t0 (int8 codes, block scales, group sums) lie; next_scale and next_base step
 * from group G's scales (or mins) to group G + 1's */
typedef struct row8_at {
    const uint8_t *codes;
    const char *scale, *min;
    const uint16_t *scale_base, *min_base;
    const int8_t *q;
    const float *sa, *gsum;
    int64_t cols, nb, ng, per_group, next_scale, next_base;
    int kind;
} row8_at;

static inline int64_t scale_bytes(int kind) { return kt_two_level(kind) ? 1 : kind == KT_SCALE_F16 ? 2 : 4; }

/* row8_at's fields of the weights alone */
KT_INLINE row8_at row8_weights_at(const kt_matrix *w, int64_t G)
{
    row8_at at;
    at.cols = w->cols;
    at.nb = w->cols / 32;
    at.ng = w->cols / w->group;
    at.per_group = w->group / 32;
    at.kind = w->scale_type;
    at.next_scale = 8 * at.ng * scale_bytes(at.kind);
    at.next_base = kt_two_level(at.kind) ? at.ng : 0;
    at.codes = (const uint8_t *)w->data + G * 8 * kt_row_bytes(w);
    at.scale = (const char *)w->scale + G * at.next_scale;
    at.min = w->min ? (const char *)w->min + G * at.next_scale : NULL;
    at.scale_base = kt_two_level(at.kind) ? w->scale_base + G * at.next_base : NULL;
    at.min_base = kt_two_level(at.kind) && w->min ? w->min_base + G * at.next_base : NULL;
    return at;
}

KT_INLINE row8_at row8_locate(const kt_matrix *w, int64_t G, const kt_acts *a, int64_t t0)
{
    row8_at at = row8_weights_at(w, G);
    at.q = a->q + t0 * at.cols;
    at.sa = a->q_scale + t0 * at.nb;
    at.gsum = a->q_group_sum + t0 * at.ng;
    return at;
}

KT_INLINE __m256 at_scales8(const row8_at *at, int64_t g) { return group_scales8(at->scale, at->scale_base, g, at->kind); }
KT_INLINE __m256 at_mins8(const row8_at *at, int64_t g) { return group_scales8(at->min, at->min_base, g, at->kind); }

/* acc[t] += (the 8 rows' scales ws) * sa[t * stride] * dot[t], for TT tokens' block dots */
KT_INLINE void accumulate_block(__m256 acc[4], const __m256i dot[4], const __m256 ws, const float *sa,
                                int64_t stride, const int TT)
{
    for (int t = 0; t < TT; t++) {
        const __m256 scale_tb = _mm256_mul_ps(ws, _mm256_set1_ps(sa[t * stride]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), scale_tb, acc[t]);
    }
}

/* acc[t] += (group g's zero point: its mins, or -8 * ws) * gsum[t * stride] */
KT_INLINE void accumulate_zero_point(__m256 acc[4], const row8_at *at, int64_t g, const __m256 ws,
                                     const float *gsum, int64_t stride, const int TT)
{
    const __m256 zero_point = at->min ? at_mins8(at, g) : _mm256_mul_ps(ws, _mm256_set1_ps(-8.0f));
    for (int t = 0; t < TT; t++)
        acc[t] = _mm256_fmadd_ps(zero_point, _mm256_set1_ps(gsum[t * stride]), acc[t]);
}

KT_INLINE void store_rows8(float *out, int64_t ldo, const __m256 acc[4], const int TT)
{
    for (int t = 0; t < TT; t++)
        _mm256_storeu_ps(out + t * ldo, acc[t]);
}

/* row8_group for one scale kind, a constant where it is inlined, so the group loop has no branch
 * on it; zero points go to accumulators of their own, off the blocks' FMA chain, and block b's
 * activations (act_piece(b)) are a pointer stepped 16 and 48 bytes in turn. On AVX2 decode is
 * nearly bound by these instructions: a 4096 x 2048 INT4 g32 matrix from L3 ran at 19-25 GB/s on
 * one pinned core of a 2-core Zen 3 guest, not far above a core's share of its DRAM (~16 GB/s). */
KT_INLINE void row8_group_of(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a,
                             int64_t t0, const int TT, const int kind)
{
    const row8_at at = row8_locate(w, G, a, t0);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[4], zacc[4];
    for (int t = 0; t < TT; t++)
        acc[t] = zacc[t] = _mm256_setzero_ps();
    const int8_t *qb = at.q;
    for (int64_t g = 0, b = 0; g < at.ng; g++) {
        const __m256 ws = group_scales8(at.scale, at.scale_base, g, kind);
        for (int64_t end = b + at.per_group; b < end; b++) {
            const uint8_t *block = at.codes + b * ROW8_BLOCK_BYTES;
            __builtin_prefetch(block + ROW8_AHEAD);
            __builtin_prefetch(block + ROW8_AHEAD + 64);
            __m256i dot[4];
            block_dots(dot, low4, block, qb, at.cols, TT);
            accumulate_block(acc, dot, ws, at.sa + b, at.nb, TT);
            qb += b & 1 ? 48 : 16;
        }
        const __m256 zero_point = at.min ? group_scales8(at.min, at.min_base, g, kind)
                                         : _mm256_mul_ps(ws, _mm256_set1_ps(-8.0f));
        for (int t = 0; t < TT; t++)
            zacc[t] = _mm256_fmadd_ps(zero_point, _mm256_set1_ps(at.gsum[t * at.ng + g]), zacc[t]);
    }
    for (int t = 0; t < TT; t++)
        acc[t] = _mm256_add_ps(acc[t], zacc[t]);
    store_rows8(out, ldo, acc, TT);
}

/* Decode: rows 8G..8G+7 for tokens t0..t0+TT-1 (TT 1-2) of kt_acts into out (token t at
 * out[t * ldo], 8 floats) */
KT_INLINE void row8_group(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a,
                          int64_t t0, const int TT)
{
    switch (w->scale_type) {
    case KT_SCALE_F16: row8_group_of(out, ldo, w, G, a, t0, TT, KT_SCALE_F16); break;
    case KT_SCALE_K: row8_group_of(out, ldo, w, G, a, t0, TT, KT_SCALE_K); break;
    case KT_SCALE_KS: row8_group_of(out, ldo, w, G, a, t0, TT, KT_SCALE_KS); break;
    default: row8_group_of(out, ldo, w, G, a, t0, TT, KT_SCALE_F32); break;
    }
}

/* Prefill: up to ROW8_TOKENS tokens' activations packed by block (row8_pack_set), so that the
 * inner loop finds them at constant offsets: q [nb][TT][32] (each block's columns 0-15, then
 * 16-31), sa [nb][TT] block scales, gsum [ng][TT] group sums. */
typedef struct row8_set {
    int8_t *q;
    float *sa, *gsum;
} row8_set;

static inline void row8_pack_set(row8_set s, const kt_acts *a, int64_t t0, int TT)
{
    const int64_t cols = a->cols, nb = cols / KT_ACT_BLOCK, ng = cols / a->group;
    for (int64_t b = 0; b < nb; b++)
        for (int t = 0; t < TT; t++) {
            const int8_t *src = a->q + (t0 + t) * cols + act_piece(b);
            int8_t *dst = s.q + (b * TT + t) * KT_ACT_BLOCK;
            memcpy(dst, src, 16);
            memcpy(dst + 16, src + 32, 16);
            s.sa[b * TT + t] = a->q_scale[(t0 + t) * nb + b];
        }
    for (int64_t g = 0; g < ng; g++)
        for (int t = 0; t < TT; t++)
            s.gsum[g * TT + t] = a->q_group_sum[(t0 + t) * ng + g];
}

/* Rows 8G..8G+7 for the TT (1-4) tokens of packed set s into out, as row8_group */
KT_INLINE void row8_group_set(float *out, int64_t ldo, const kt_matrix *w, int64_t G, row8_set s, const int TT)
{
    const row8_at at = row8_locate(w, G, &(kt_acts){.q = s.q, .q_scale = s.sa, .q_group_sum = s.gsum}, 0);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[4];
    for (int t = 0; t < TT; t++)
        acc[t] = _mm256_setzero_ps();
    const uint8_t *block = at.codes;
    const int8_t *qs = s.q;
    const float *sa = s.sa;
    for (int64_t g = 0; g < at.ng; g++) {
        const __m256 ws = at_scales8(&at, g);
        for (int64_t i = 0; i < at.per_group; i++, block += ROW8_BLOCK_BYTES, qs += TT * KT_ACT_BLOCK, sa += TT) {
            __builtin_prefetch(block + ROW8_AHEAD);
            __builtin_prefetch(block + ROW8_AHEAD + 64);
            __m256i dot[4];
            block_dots_set(dot, low4, block, qs, TT);
            accumulate_block(acc, dot, ws, sa, 1, TT);
        }
        accumulate_zero_point(acc, &at, g, ws, s.gsum + g * TT, 1, TT);
    }
    store_rows8(out, ldo, acc, TT);
}

/* Bytes of one chunk's packed sets: ROW8_CHUNK tokens' q, sa and gsum */
static inline size_t row8_sets_bytes(const kt_matrix *w)
{
    return (size_t)ROW8_CHUNK * (size_t)(w->cols + 4 * (w->cols / KT_ACT_BLOCK + w->cols / w->group));
}

/* Set i (tokens 4i.. of a chunk) in buf, laid out as row8_sets_bytes counts */
static inline row8_set row8_set_at(uint8_t *buf, const kt_matrix *w, int64_t i)
{
    const int64_t nb = w->cols / KT_ACT_BLOCK, ng = w->cols / w->group;
    float *sa = (float *)(buf + (size_t)ROW8_CHUNK * (size_t)w->cols);
    return (row8_set){(int8_t *)buf + i * ROW8_TOKENS * w->cols, sa + i * ROW8_TOKENS * nb,
                      sa + ROW8_CHUNK * nb + i * ROW8_TOKENS * ng};
}

/* Rows [r0, r1) (multiples of 8) for tokens [c0, c1) (at most ROW8_CHUNK), ROW8_TOKENS at a
 * time (4: MoE prefill 1.1-1.2x faster than 8 spilling ones, one layer at T=128 and 512,
 * same-process A/B on a 2-core Zen 3 guest; 6 was no faster), packed into buf first */
KT_INLINE void row8_chunk_i4(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                             const kt_acts *a, int64_t c0, int64_t c1, uint8_t *buf)
{
    for (int64_t t0 = c0; t0 < c1; t0 += ROW8_TOKENS)
        row8_pack_set(row8_set_at(buf, w, (t0 - c0) / ROW8_TOKENS), a, t0,
                      c1 - t0 < ROW8_TOKENS ? (int)(c1 - t0) : ROW8_TOKENS);
    for (int64_t G = r0 / 8; G < r1 / 8; G++) {
        for (int64_t t0 = c0; t0 < c1; t0 += ROW8_TOKENS) {
            float *o = out + t0 * ldo + (G * 8 - r0);
            const row8_set s = row8_set_at(buf, w, (t0 - c0) / ROW8_TOKENS);
            switch (c1 - t0 < ROW8_TOKENS ? c1 - t0 : ROW8_TOKENS) {
            case 1: row8_group_set(o, ldo, w, G, s, 1); break;
            case 2: row8_group_set(o, ldo, w, G, s, 2); break;
            case 3: row8_group_set(o, ldo, w, G, s, 3); break;
            default: row8_group_set(o, ldo, w, G, s, 4); break;
            }
        }
    }
}

/* Rows [r0, r1) for tokens [c0, c1) in twos straight from kt_acts: decode, and prefill without a
 * buffer */
static inline void row8_pairs_i4(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                 const kt_acts *a, int64_t c0, int64_t c1)
{
    for (int64_t G = r0 / 8; G < r1 / 8; G++)
        for (int64_t t0 = c0; t0 < c1; t0 += 2) {
            float *o = out + t0 * ldo + (G * 8 - r0);
            if (c1 - t0 >= 2)
                row8_group(o, ldo, w, G, a, t0, 2);
            else
                row8_group(o, ldo, w, G, a, t0, 1);
        }
}

/* Tokens [c0, c1) (at most ROW8_CHUNK): from 3 of them packed (row8_chunk_i4), else in twos */
static inline void row8_tokens_i4(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                  const kt_acts *a, int64_t c0, int64_t c1)
{
    uint8_t *buf = c1 - c0 > 2 ? kt_thread_buffer(KT_BUF_ROW8_SETS, row8_sets_bytes(w)) : NULL;
    if (buf)
        row8_chunk_i4(out, ldo, w, r0, r1, a, c0, c1, buf);
    else
        row8_pairs_i4(out, ldo, w, r0, r1, a, c0, c1);
}

/* Every token, in chunks of ROW8_CHUNK whose packed activations (128 KB at 2048 columns) stay
 * in L2 while the rows pass over them (512 tokens at once, 1 MB, spilled to L3). Packing per
 * call costs about 1-2% of the chunk's products (one 2048 x 256 block of a gate or up matrix:
 * 128 16-byte copies a token against 2048 8-row blocks). */
static inline void row8_rows_i4(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                const kt_acts *a)
{
    for (int64_t c0 = 0; c0 < a->m; c0 += ROW8_CHUNK)
        row8_tokens_i4(out, ldo, w, r0, r1, a, c0, c0 + ROW8_CHUNK < a->m ? c0 + ROW8_CHUNK : a->m);
}

#endif
#endif
