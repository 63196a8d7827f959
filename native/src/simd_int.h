/* simd_int.h: row kernels for the integer weight formats (I8, I4), included by
 * linear.c only. Dequantize-free: weight codes meet the int8 activations in
 * integer dot products, one per 32-value activation block, scaled in float.
 *
 * Maths, for token t with x[t, k] ~= sa[b] * qa[k] (kt_acts: one scale sa[b] per
 * block b of 32 values) and row r with, per group g, scale s[g], min mn[g]
 * (asymmetric) and codes qw:
 *   I8 symmetric    w = s*qw          dot = sum_b sa[b] * s[g(b)] * sum_{k in b}(qw*qa)
 *   I8 asymmetric   w = s*qw + mn     dot = (the same) + sum_g mn[g] * gsum[g]
 *   I4 symmetric    w = s*(qw - 8)    dot = (the same) - 8 * sum_g s[g] * gsum[g]
 *   I4 asymmetric   w = s*qw + mn     dot = (the same) + sum_g mn[g] * gsum[g]
 * gsum[g] = sum over group g of sa[b] * qa[k] (kt_acts.q_group_sum), so the result
 * is exactly W . dequantized(qa), up to f32 rounding.
 * Groups are multiples of 32 except for I8 (multiples of 16), where one block can
 * span two groups: its first 16 columns take one group's scale, the last 16 the
 * next one's (s[g(b)] becomes a per-lane vector, see block_scales_256).
 *
 * Per block, row and token: the int32 sum of the block goes to float once
 * (vcvtdq2ps) and is added with its combined scale sa[b] * s[g] (vmulps, vfmadd)
 * into a float accumulator kept across the whole row; the zero-point term is one
 * dot product over the groups per row and token (dot_f32).
 *
 * Integer products (x86): vpmaddubsw multiplies unsigned bytes by signed bytes,
 * adding pairs into int16; I4 codes are 0..15 already unsigned (pair sums
 * <= 2*15*127), I8 codes become |qw| with the sign moved onto qa (vpsignb; pair
 * sums <= 2*128*127 < 32767, no saturation). vpmaddwd by 1 widens to int32.
 * With AVX512-VNNI, vpdpbusd does all three steps in one instruction.
 * Lanes: after either, int32 lane j of a 256-bit block sum holds columns
 * 4j..4j+3 of the block, so lanes 0-3 are its first 16 columns, 4-7 the last 16.
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

/* What one tile reads: RT weight rows (codes, scales, mins) and TT tokens. */
typedef struct int_rows {
    int64_t chunk_stride;     /* kt_chunk_stride: byte b of row i at row_at(w, i, b) */
    kt_tile_prefetch pf;      /* prefetch_ahead's plan (ahead: bytes from row_at) */
    int64_t *due;             /* the next row offset to prefetch at */
    const uint8_t *codes[4];
    const float *scale[4];
    const float *min[4];
} int_rows;

KT_INLINE const uint8_t *row_at(const int_rows *w, int i, int64_t off)
{
    return kt_code_at(w->codes[i], w->chunk_stride, off);
}

/* A block's first token tile streams each weight row once, RT rows side by
 * side (decode: the only tile). Row layout: runs of 2-4 KB per row that the
 * hardware prefetchers barely ramp up on, so while a tile reads byte `off` of
 * its rows, the same bytes of the next tile's rows (contiguous after them) are
 * requested (+20-40% per thread, I4 from DRAM on a 2-core Zen 3 guest). Tiled
 * layout (kt.h): the tile is one sequential run; its lines KT_PREFETCH_CHUNKS
 * (kt_internal.h) chunks ahead are requested. Later token tiles fetch the next
 * block into L2 (linear.c's tile_prefetch). Call once per 64 bytes of a row. */
KT_INLINE void prefetch_ahead(const int_rows *w, const int RT, int64_t off)
{
    if (!w->pf.ahead || off < *w->due)
        return;
    *w->due = off + w->pf.every * 64;
    for (int i = 0; i < RT; i++)
        __builtin_prefetch(row_at(w, i, off) + w->pf.ahead, 0, 2);
}

#if defined(__AVX2__)

KT_INLINE float hsum_256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* int32 sums of 4-byte products of unsigned u and signed s (see the lanes above). */
KT_INLINE __m256i block_dot_u8s8(__m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* 32 bytes, or 16 zero-extended for a last block of 16 columns */
KT_INLINE __m256i load_block_i8(const int8_t *p, int half)
{
    return half ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p))
                : _mm256_loadu_si256((const __m256i *)p);
}

/* 16-byte I4 block -> its 32 codes in weight order (low nibbles, then high) */
KT_INLINE __m256i unpack_i4_32(const uint8_t *p)
{
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

/* Weight scales of block [k0, k0 + 32) of one row, per lane: one broadcast when
 * group % 32 == 0, else columns k0..k0+15 and k0+16..k0+31 may be in different
 * groups (I8, group % 32 == 16). A half last block reuses the first scale. */
KT_INLINE __m256 block_scales_256(const float *scale, int64_t k0, int64_t group, int half)
{
    if (group % 32 == 0)
        return _mm256_set1_ps(scale[k0 / group]);
    float hi = half ? scale[k0 / group] : scale[(k0 + 16) / group];
    return _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(scale[k0 / group]));
}

/* Two consecutive floats p[0], p[1] as lanes 0-3 and 4-7 */
KT_INLINE __m256 pair_256(const float *p)
{
    __m128 two = _mm_castpd_ps(_mm_load_sd((const double *)p));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* Weight scales of columns [k0, k0 + 64) in the lanes of i4_steps_64's sums.
 * kind: GROUP_WIDE (group % 64 == 0), GROUP_32, or GROUP_OTHER, a constant at
 * each call site so the choice is made outside the loops. */
enum { GROUP_OTHER = 0, GROUP_32 = 1, GROUP_WIDE = 2 };

KT_INLINE int group_kind(int64_t group)
{
    return group % 64 == 0 ? GROUP_WIDE : group == 32 ? GROUP_32 : GROUP_OTHER;
}

KT_INLINE __m256 scales_64_256(const float *scale, int64_t k0, int64_t group, const int kind)
{
    if (kind == GROUP_WIDE)
        return _mm256_set1_ps(scale[k0 / group]);
    if (kind == GROUP_32)
        return pair_256(scale + k0 / 32);
    const float two[2] = {scale[k0 / group], scale[(k0 + 32) / group]};
    return pair_256(two);
}

/* I4, 64 columns (blocks b, b+1) a step, on the interleaved activations (kt_acts):
 * the 32 code bytes' low nibbles are [b cols 0-15 | b+1 cols 0-15], the high
 * nibbles [b 16-31 | b+1 16-31], the order of the two activation vectors. The
 * int16 pair sums of both halves add without overflow (2 * 2*15*127 < 32767);
 * int32 lanes 0-3 then hold block b, 4-7 block b+1. */
KT_INLINE int64_t i4_steps_64(__m256 acc[4][4], const int_rows *w, const int RT, const int8_t *q,
                              const float *sa, int64_t cols, int64_t group, const int TT, const int kind)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const int64_t nb = (cols + 31) / 32;
    int64_t k0 = 0;
    for (; k0 + 64 <= cols; k0 += 64) {
        __m256i lo[4], hi[4];
        __m256 ws[4];
        if ((k0 & 127) == 0)
            prefetch_ahead(w, RT, k0 / 2);
        for (int i = 0; i < RT; i++) {
            __m256i c = _mm256_loadu_si256((const __m256i *)row_at(w, i, k0 / 2));
            lo[i] = _mm256_and_si256(c, low4);
            hi[i] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
            ws[i] = scales_64_256(w->scale[i], k0, group, kind);
        }
        for (int t = 0; t < TT; t++) {
            __m256i a_lo = _mm256_loadu_si256((const __m256i *)(q + t * cols + k0));
            __m256i a_hi = _mm256_loadu_si256((const __m256i *)(q + t * cols + k0 + 32));
            __m256 st = pair_256(sa + t * nb + k0 / 32);
            for (int i = 0; i < RT; i++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                __m256i s = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo[i], a_lo), hi[i], a_hi);
#else
                __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[i], a_lo), _mm256_maddubs_epi16(hi[i], a_hi));
                __m256i s = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
                acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(ws[i], st), acc[i][t]);
            }
        }
    }
    return k0;
}

/* I8 with group % 32 == 0, one block a step: each group's blocks are summed with
 * their activation scales alone (vfmadd) into gacc, which meets the group's
 * weight scale once, so a block costs one vcvtdq2ps and one vfmadd per row and
 * token. */
KT_INLINE void i8_groups(__m256 acc[4][4], const int_rows *w, const int RT, const int8_t *q,
                         const float *sa, int64_t cols, int64_t group, const int TT)
{
    const int64_t nb = cols / 32;
    for (int64_t g = 0; g < cols / group; g++) {
        __m256 gacc[4][4];
        for (int i = 0; i < RT; i++)
            for (int t = 0; t < TT; t++)
                gacc[i][t] = _mm256_setzero_ps();
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
            __m256i wv[4], u[4];
            if ((k0 & 63) == 0)
                prefetch_ahead(w, RT, k0);
            for (int i = 0; i < RT; i++) {
                wv[i] = _mm256_loadu_si256((const __m256i *)row_at(w, i, k0));
                u[i] = _mm256_sign_epi8(wv[i], wv[i]);
            }
            for (int t = 0; t < TT; t++) {
                __m256i av = _mm256_loadu_si256((const __m256i *)(q + t * cols + k0));
                __m256 st = _mm256_set1_ps(sa[t * nb + k0 / 32]);
                for (int i = 0; i < RT; i++) {
                    __m256i s = block_dot_u8s8(u[i], _mm256_sign_epi8(av, wv[i]));
                    gacc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), st, gacc[i][t]);
                }
            }
        }
        for (int i = 0; i < RT; i++) {
            __m256 sw = _mm256_set1_ps(w->scale[i][g]);
            for (int t = 0; t < TT; t++)
                acc[i][t] = _mm256_fmadd_ps(gacc[i][t], sw, acc[i][t]);
        }
    }
}

/* dots[i][t] = sum over blocks of sa * s * (int32 block sum): I4 two blocks a
 * step, I8 by groups when group % 32 == 0; then (I8 with group % 32 == 16, or
 * the last block of I4) one block a step with combined scales. */
KT_INLINE void int_tile_256(float dots[4][4], const int_rows *w, const int RT, const kt_acts *a,
                            int64_t t0, const int TT, const int32_t fmt)
{
    int64_t cols = a->cols, group = a->group, nb = (cols + 31) / 32;
    const int8_t *q = a->q + t0 * cols;
    const float *sa = a->q_scale + t0 * nb;
    __m256 acc[4][4];
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            acc[i][t] = _mm256_setzero_ps();
    int64_t k0 = 0;
    if (fmt == KT_I4) {
        switch (group_kind(group)) {
        case GROUP_WIDE: k0 = i4_steps_64(acc, w, RT, q, sa, cols, group, TT, GROUP_WIDE); break;
        case GROUP_32: k0 = i4_steps_64(acc, w, RT, q, sa, cols, group, TT, GROUP_32); break;
        default: k0 = i4_steps_64(acc, w, RT, q, sa, cols, group, TT, GROUP_OTHER); break;
        }
    } else if (group % 32 == 0) {
        i8_groups(acc, w, RT, q, sa, cols, group, TT);
        k0 = cols;
    }
    for (; k0 < cols; k0 += 32) {
        int half = cols - k0 < 32;
        __m256i wv[4], u[4];
        __m256 ws[4];
        for (int i = 0; i < RT; i++) {
            if (fmt == KT_I4) {
                u[i] = unpack_i4_32(row_at(w, i, k0 / 2));
            } else {
                wv[i] = load_block_i8((const int8_t *)row_at(w, i, k0), half);
                u[i] = _mm256_sign_epi8(wv[i], wv[i]);
            }
            ws[i] = block_scales_256(w->scale[i], k0, group, half);
        }
        for (int t = 0; t < TT; t++) {
            __m256i av = load_block_i8(q + t * cols + k0, half);
            __m256 st = _mm256_set1_ps(sa[t * nb + k0 / 32]);
            for (int i = 0; i < RT; i++) {
                __m256i s = fmt == KT_I4 ? av : _mm256_sign_epi8(av, wv[i]);
                __m256 sum = _mm256_cvtepi32_ps(block_dot_u8s8(u[i], s));
                acc[i][t] = _mm256_fmadd_ps(sum, _mm256_mul_ps(ws[i], st), acc[i][t]);
            }
        }
    }
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            dots[i][t] = hsum_256(acc[i][t]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
/* 64 columns (blocks b, b+1) a step, for cols % 64 == 0 and group % 32 == 0.
 * I8 (natural order): int32 lanes 0-7 of a step's sum hold block b, 8-15 block b+1.
 * I4 (interleaved activations): the 32 code bytes' low nibbles then high nibbles
 * give [b 0-15 | b+1 0-15 | b 16-31 | b+1 16-31], the activations' order, so
 * lanes 0-3 and 8-11 hold block b, 4-7 and 12-15 block b+1.
 * I8 from two tokens on: the codes become unsigned by a flipped top bit (qw + 128),
 * and each lane's 128 * (sum of its 4 activations) is taken off by starting that
 * token's vpdpbusd from minus it, so a row and token cost one vpdpbusd, as for I4
 * (T = 512 of an MoE layer 1.3x faster on Zen 4; the group-sum correction I4 uses
 * instead measured 0.9x). One token (decode) moves the weight sign onto the
 * activation with a byte mask: the offset form measured 0.87x there.
 * GROUP_ROW (one scale per row, from two tokens: one ran 0.87x): the weight scale
 * multiplies the finished sum. */
enum { GROUP_ROW = 3 };

KT_INLINE __m512 pair_512(const float *p, const int32_t fmt)
{
    const __m512i i4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i i8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 two = _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)p)));
    return _mm512_permutexvar_ps(fmt == KT_I4 ? i4 : i8, two);
}

/* Weight scales of columns [k0, k0 + 64) in the lanes of a step's sums (kind as
 * in scales_64_256) */
KT_INLINE __m512 scales_64_512(const float *scale, int64_t k0, int64_t group, const int32_t fmt,
                               const int kind)
{
    if (kind == GROUP_WIDE)
        return _mm512_set1_ps(scale[k0 / group]);
    if (kind == GROUP_32)
        return pair_512(scale + k0 / 32, fmt);
    const float two[2] = {scale[k0 / group], scale[(k0 + 32) / group]};
    return pair_512(two, fmt);
}

KT_INLINE __m512i unpack_i4_64(const uint8_t *p)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i b = _mm256_loadu_si256((const __m256i *)p);
    __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* I8: the vpdpbusd start that cancels the +128 of the codes, -128 * (4-activation lane sums) */
KT_INLINE __m512i i8_offset_512(__m512i av)
{
    const __m512i c128 = _mm512_set1_epi8((char)0x80);
    return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, av));
}

KT_INLINE void int_steps_512(float dots[4][4], const int_rows *w, const int RT, const kt_acts *a,
                             int64_t t0, const int TT, const int32_t fmt, const int kind)
{
    int64_t cols = a->cols, group = a->group, nb = cols / 32;
    const int8_t *q = a->q + t0 * cols;
    const float *sa = a->q_scale + t0 * nb;
    __m512 acc[4][4];
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            acc[i][t] = _mm512_setzero_ps();
    const int offset = fmt == KT_I8 && TT > 1;
    for (int64_t k0 = 0, b = 0; k0 < cols; k0 += 64, b += 2) {
        __m512i u[4];
        __m512 ws[4];
        __mmask64 negative[4] = {0, 0, 0, 0};
        if (fmt == KT_I8 || (k0 & 127) == 0)
            prefetch_ahead(w, RT, fmt == KT_I4 ? k0 / 2 : k0);
        for (int i = 0; i < RT; i++) {
            if (fmt == KT_I4) {
                u[i] = unpack_i4_64(row_at(w, i, k0 / 2));
            } else if (offset) {
                u[i] = _mm512_xor_si512(_mm512_loadu_si512(row_at(w, i, k0)), _mm512_set1_epi8((char)0x80));
            } else {
                __m512i wv = _mm512_loadu_si512(row_at(w, i, k0));
                u[i] = _mm512_abs_epi8(wv);
                negative[i] = _mm512_movepi8_mask(wv);
            }
            if (kind != GROUP_ROW)
                ws[i] = scales_64_512(w->scale[i], k0, group, fmt, kind);
        }
        for (int t = 0; t < TT; t++) {
            __m512i av = _mm512_loadu_si512(q + t * cols + k0);
            __m512i start = offset ? i8_offset_512(av) : _mm512_setzero_si512();
            __m512 st = pair_512(sa + t * nb + b, fmt);
            for (int i = 0; i < RT; i++) {
                __m512i s = fmt == KT_I8 && !offset ? _mm512_mask_sub_epi8(av, negative[i], _mm512_setzero_si512(), av) : av;
                __m512 sum = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, u[i], s));
                acc[i][t] = _mm512_fmadd_ps(sum, kind == GROUP_ROW ? st : _mm512_mul_ps(ws[i], st), acc[i][t]);
            }
        }
    }
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            dots[i][t] = _mm512_reduce_add_ps(acc[i][t]) * (kind == GROUP_ROW ? w->scale[i][0] : 1.0f);
}

KT_INLINE void int_tile_512(float dots[4][4], const int_rows *w, const int RT, const kt_acts *a,
                            int64_t t0, const int TT, const int32_t fmt)
{
    if (TT > 1 && a->group == a->cols) {
        int_steps_512(dots, w, RT, a, t0, TT, fmt, GROUP_ROW);
        return;
    }
    switch (group_kind(a->group)) {
    case GROUP_WIDE: int_steps_512(dots, w, RT, a, t0, TT, fmt, GROUP_WIDE); break;
    case GROUP_32: int_steps_512(dots, w, RT, a, t0, TT, fmt, GROUP_32); break;
    default: int_steps_512(dots, w, RT, a, t0, TT, fmt, GROUP_OTHER); break;
    }
}
#define KT_INT_TILE_512 1
#endif

#else /* portable */

KT_INLINE int code_at(const int_rows *w, int i, int64_t k, int32_t fmt)
{
    if (fmt == KT_I8)
        return *(const int8_t *)row_at(w, i, k);
    /* 32-weight block: byte j holds q[j] (low nibble) and q[j+16] (high nibble) */
    uint8_t byte = *row_at(w, i, (k / 32) * 16 + (k % 16));
    return (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
}

/* Where column k's activation sits in q: I4 rows are interleaved per full 64
 * columns (kt_acts), i.e. their 16-column pieces 1 and 2 swapped. */
KT_INLINE int64_t act_at(int64_t k, int64_t cols, int32_t fmt)
{
    int64_t piece = (k % 64) / 16;
    if (fmt != KT_I4 || k - k % 64 + 64 > cols || piece == 0 || piece == 3)
        return k;
    return piece == 1 ? k + 16 : k - 16;
}

/* Token t's activation code for column k: int16 (KT_ACTS_INT16) or int8 */
KT_INLINE int32_t act_code(const kt_acts *a, int64_t t, int64_t k, int32_t fmt)
{
    if (a->q16)
        return a->q16[t * a->cols + k];
    return a->q[t * a->cols + act_at(k, a->cols, fmt)];
}

/* 16 columns a step: each inside one activation block and one weight group. */
KT_INLINE void int_tile_portable(float dots[4][4], const int_rows *w, const int RT, const kt_acts *a,
                                 int64_t t0, const int TT, const int32_t fmt)
{
    int64_t cols = a->cols, group = a->group, nb = (cols + 31) / 32;
    const float *sa = a->q_scale + t0 * nb;
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            dots[i][t] = 0.0f;
    for (int64_t k0 = 0; k0 < cols; k0 += 16) {
        for (int i = 0; i < RT; i++) {
            for (int t = 0; t < TT; t++) {
                int32_t s = 0;
                for (int64_t k = k0; k < k0 + 16; k++)
                    s += code_at(w, i, k, fmt) * act_code(a, t0 + t, k, fmt);
                dots[i][t] += (float)s * (sa[t * nb + k0 / 32] * w->scale[i][k0 / group]);
            }
        }
    }
}
#endif

#include "simd_int16.h"

/* sum_k a[k] * b[k]: the zero-point term, one product per group */
static inline float dot_f32(const float *a, const float *b, int64_t n)
{
    int64_t k = 0;
    float s = 0.0f;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    s = hsum_256(acc);
#endif
    for (; k < n; k++)
        s += a[k] * b[k];
    return s;
}

/* dots[i][t] before the zero-point term, by the widest kernel this build has */
KT_INLINE void int_dots(float dots[4][4], const int_rows *rows, const int RT, const kt_acts *a, int64_t t0,
                        const int TT, const int32_t fmt)
{
#if defined(__AVX2__)
    if (a->q16) {
        int16_tile(dots, rows, RT, a, t0, TT, fmt);
        return;
    }
#endif
#if defined(KT_INT_TILE_512)
    if (a->cols % 64 == 0 && a->group % 32 == 0) {
        int_tile_512(dots, rows, RT, a, t0, TT, fmt);
        return;
    }
#endif
#if defined(__AVX2__)
    int_tile_256(dots, rows, RT, a, t0, TT, fmt);
#else
    int_tile_portable(dots, rows, RT, a, t0, TT, fmt);
#endif
}

/* Rows [r, r + RT) of W against tokens [t0, t0 + TT): out[t * ldo + i] for row r + i.
 * The zero-point term (I4, asymmetric W) is, per row and token, the dot product of
 * the row's mins (or -8 * its scales) with the token's group sums. */
KT_INLINE void int_tile(float *out, int64_t ldo, const kt_matrix *w, int64_t r, const int RT,
                        const kt_acts *a, int64_t t0, const int TT, const int32_t fmt, const int asym,
                        const int tiled, kt_tile_prefetch pf)
{
    int64_t cols = w->cols, group = w->group, n_groups = cols / group;
    int64_t due = pf.phase * 64;
    int_rows rows;
    rows.chunk_stride = tiled ? (int64_t)KT_TILE_CHUNK * KT_TILE_ROWS : KT_TILE_CHUNK;   /* kt_chunk_stride(w) */
    rows.pf = pf;
    rows.due = &due;
    for (int i = 0; i < RT; i++) {
        rows.codes[i] = kt_row_start(w, r + i);
        rows.scale[i] = w->scale + (r + i) * n_groups;
        rows.min[i] = asym ? w->min + (r + i) * n_groups : NULL;
    }
    float dots[4][4];
    int_dots(dots, &rows, RT, a, t0, TT, fmt);
    if (asym || fmt == KT_I4) {
        const float *gsum = a->q_group_sum + t0 * n_groups;
        for (int i = 0; i < RT; i++)
            for (int t = 0; t < TT; t++)
                dots[i][t] += asym ? dot_f32(rows.min[i], gsum + t * n_groups, n_groups)
                                   : -8.0f * dot_f32(rows.scale[i], gsum + t * n_groups, n_groups);
    }
    for (int i = 0; i < RT; i++)
        for (int t = 0; t < TT; t++)
            out[t * ldo + i] = dots[i][t];
}

#endif
