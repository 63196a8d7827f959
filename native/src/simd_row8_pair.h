/* simd_row8_pair.h: the 16-row form of the 8-row kernel (simd_row8.h) on
 * AVX-512, two 8-row groups at a time, included by row8.c only: INT4 prefill, and
 * I8 at every token count (kt.h KT_LAYOUT_ROW8 for I8; decode on one 8-row group).
 * With AVX512-VNNI the block sums are vpdpbusd (KT_ROW8_PAIR_DPBUSD), and INT4 decode has a
 * 512-bit form of its own (row8_group_decode). Without it
 * (AVX512BW only) INT4 runs as the AVX2 8-row kernel does, vpmaddubsw into int16 and
 * one vpmaddwd a block (bound: simd_row8.h); I8 splits its flipped codes u = q + 128
 * into nibbles, u = 16 uh + ul, and sums each as INT4 does: a lane's int16 adds 16
 * products of at most 15 * 128 a block (30720, no saturation), then one vpmaddwd by 1
 * (ul) and one by 16 (uh) a block. It costs about twice INT4's instructions a block.
 *
 * One 512-bit register holds the same 32-byte load of groups G (low half) and
 * G + 1 (high half): 4 bytes of each of 16 rows. A token's 4 activation bytes
 * broadcast to all 16 lanes, so one vpdpbusd serves both groups, and the
 * unpacking, the float scaling and the stores are shared by 16 rows instead of 8.
 * The 256-bit form ran ~180 instructions per block, 8 rows and 4 tokens, for 32
 * vpdpbusd: issue-bound at about half the vpdpbusd rate. The maths is
 * simd_row8.h's, lane for lane.
 *
 * I8 codes are signed; each load flips their top bit (q + 128, as vpdpbusd's unsigned
 * operand), and the group's zero point takes the 128 back: -128 * s[i, g] * gsum[g]
 * (plus mn[i, g] * gsum[g] where the matrix has mins). Per block and token a lane adds
 * 32 products of at most 255 * 128: far inside int32. */
#ifndef KT_SIMD_ROW8_PAIR_H
#define KT_SIMD_ROW8_PAIR_H

#include "simd_row8.h"
#include "simd_row8_i8.h"

#if defined(KT_ROW8_KERNEL) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KT_ROW8_PAIR_KERNEL 1
#if defined(__AVX512VNNI__)
#define KT_ROW8_PAIR_DPBUSD 1
#endif

/* INT4 from PAIR_MIN_TOKENS rows of activations on (its decode reads one 8-row group at a
 * time, a single stream: row8_group_decode or simd_row8.h's row8_group); I8 decode likewise
 * (simd_row8_i8.h's row8_i8_group) */
enum { PAIR_TOKENS = 6, PAIR_MIN_TOKENS = 3 };

/* bytes [p0, p0 + 32) in the low half, [p1, p1 + 32) in the high half */
KT_INLINE __m512i load_pair(const uint8_t *p0, const uint8_t *p1)
{
    const __m512i low = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0));
    return _mm512_inserti64x4(low, _mm256_loadu_si256((const __m256i *)p1), 1);
}

/* lo in the low half, hi in the high half */
KT_INLINE __m512 pair_of(__m256 lo, __m256 hi)
{
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

#if defined(KT_ROW8_PAIR_DPBUSD)
/* acc + u (unsigned bytes) . the 4 signed bytes at p in every lane, the broadcast folded into
 * vpdpbusd's memory operand ({1to16}); GCC 12 does not fold _mm512_set1_epi32 there and
 * spends a vpbroadcastd on each */
KT_INLINE __m512i dpbusd_bcast(__m512i acc, __m512i u, const int8_t *p)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}
#else
/* int16 pair sums of u (unsigned bytes) with the 4 signed bytes at p in every lane */
KT_INLINE __m512i maddubs_bcast(__m512i u, const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_maddubs_epi16(u, _mm512_set1_epi32(v));
}

/* An accumulator as it stands (simd_row8.h's block_dots does the same): without it GCC 12
 * reorders a block's int16 sums into a tree over its loads, holding every product at once,
 * and spilled most of them to the stack (MoE layer, q4_0, T=128: 1.35x with it) */
KT_INLINE void keep_order(__m512i *acc) { __asm__("" : "+v"(*acc)); }

/* The low (ul) and high (uh) nibbles of flipped I8 codes v: u = v ^ 0x80 = 16 uh + ul;
 * the flip leaves the low nibble alone */
KT_INLINE void i8_nibbles(__m512i v, __m512i *ul, __m512i *uh)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(0x08);
    *ul = _mm512_and_si512(v, low4);
    *uh = _mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi32(v, 4), low4), eight);
}

/* pair_block_dots for I8 without VNNI: each nibble's int16 sums over the block's 8 loads
 * (header: at most 30720 a lane), then ul's + 16 * uh's as int32 */
KT_INLINE void pair_block_dots_i8_nibbles(__m512i dot[PAIR_TOKENS], const uint8_t *b0, const uint8_t *b1,
                                          const int8_t *qb, int64_t cols, const int TT)
{
    __m512i lo_sum[PAIR_TOKENS], hi_sum[PAIR_TOKENS];
    for (int t = 0; t < TT; t++)
        lo_sum[t] = hi_sum[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        __m512i ul, uh;
        i8_nibbles(load_pair(b0 + 32 * j, b1 + 32 * j), &ul, &uh);
        for (int t = 0; t < TT; t++) {
            const int8_t *q = qb + t * cols + 4 * j;
            lo_sum[t] = _mm512_add_epi16(lo_sum[t], maddubs_bcast(ul, q));
            hi_sum[t] = _mm512_add_epi16(hi_sum[t], maddubs_bcast(uh, q));
            keep_order(&lo_sum[t]);
            keep_order(&hi_sum[t]);
        }
    }
    for (int t = 0; t < TT; t++)
        dot[t] = _mm512_add_epi32(_mm512_madd_epi16(lo_sum[t], _mm512_set1_epi16(1)),
                                  _mm512_madd_epi16(hi_sum[t], _mm512_set1_epi16(16)));
}
#endif

/* The int32 dots of one block's 16 rows with TT tokens' activations (qb: token 0's piece)
 * at b0 (rows 0-7) and b1 (rows 8-15), two chains a token. INT4: the low and high nibbles of
 * 4 loads, as block_dots_set; I8: 8 loads of codes with their top bit flipped. */
KT_INLINE void pair_block_dots(__m512i dot[PAIR_TOKENS], const uint8_t *b0, const uint8_t *b1, const int8_t *qb,
                               int64_t cols, const int is_i8, const int TT)
{
#if defined(KT_ROW8_PAIR_DPBUSD)
    __m512i hi_dot[PAIR_TOKENS];
    for (int t = 0; t < TT; t++)
        dot[t] = hi_dot[t] = _mm512_setzero_si512();
    if (is_i8) {
        const __m512i top = _mm512_set1_epi8((char)0x80);
        __m512i u[8];
        for (int j = 0; j < 8; j++)
            u[j] = _mm512_xor_si512(load_pair(b0 + 32 * j, b1 + 32 * j), top);
        const int8_t *q = qb;
        for (int t = 0; t < TT; t++, q += cols) {
            __asm__("" : "+r"(q));      /* one pointer, as the INT4 branch below */
            for (int j = 0; j < 8; j += 2) {
                dot[t] = dpbusd_bcast(dot[t], u[j], q + 4 * j);
                hi_dot[t] = dpbusd_bcast(hi_dot[t], u[j + 1], q + 4 * j + 4);
            }
        }
    } else {
        /* the block's codes stay unpacked in 8 registers while the tokens pass over them, one
         * pointer stepping cols bytes a token; the empty asm keeps GCC from holding all TT
         * pointers at once: it had spilled them and reloaded one per vpdpbusd */
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        __m512i lo[4], hi[4];
        for (int j = 0; j < 4; j++) {
            const __m512i v = load_pair(b0 + 32 * j, b1 + 32 * j);
            lo[j] = _mm512_and_si512(v, low4);
            hi[j] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low4);
        }
        const int8_t *q = qb;
        for (int t = 0; t < TT; t++, q += cols) {
            __asm__("" : "+r"(q));
            for (int j = 0; j < 4; j++) {
                dot[t] = dpbusd_bcast(dot[t], lo[j], q + 4 * j);
                hi_dot[t] = dpbusd_bcast(hi_dot[t], hi[j], q + 32 + 4 * j);
            }
        }
    }
    for (int t = 0; t < TT; t++)
        dot[t] = _mm512_add_epi32(dot[t], hi_dot[t]);
#else
    if (is_i8) {
        pair_block_dots_i8_nibbles(dot, b0, b1, qb, cols, TT);
        return;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < TT; t++)
        dot[t] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i v = load_pair(b0 + 32 * j, b1 + 32 * j);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low4);
        for (int t = 0; t < TT; t++) {
            const int8_t *q = qb + t * cols + 4 * j;
            dot[t] = _mm512_add_epi16(dot[t], _mm512_add_epi16(maddubs_bcast(lo, q), maddubs_bcast(hi, q + 32)));
            keep_order(&dot[t]);
        }
    }
    for (int t = 0; t < TT; t++)
        dot[t] = _mm512_madd_epi16(dot[t], _mm512_set1_epi16(1));
#endif
}

/* Where a token tile of a pair prefetches: the first streams its own codes ROW8_AHEAD bytes
 * ahead (stream, lines_per_block a group); the later ones fetch lines [first, last) of the
 * next pair's codes from next into L2, per_block lines a block, so that its first tile finds
 * them there instead of waiting on memory (MoE layer, Q4_0, Zen 4: T=128 1.08x, T=512 1.03x). */
typedef struct pair_prefetch {
    int stream;
    const char *next;
    int64_t first, last, per_block;
} pair_prefetch;

KT_INLINE void prefetch_block(const pair_prefetch *pf, const uint8_t *b0, const uint8_t *b1, int64_t b,
                              const int is_i8)
{
    if (pf->stream) {
        /* a block's lines, ROW8_AHEAD on (I8 2048 or 4096 bytes ahead ran no faster) */
        for (int i = 0; i < (is_i8 ? 4 : 2); i++) {
            __builtin_prefetch(b0 + ROW8_AHEAD + 64 * i);
            __builtin_prefetch(b1 + ROW8_AHEAD + 64 * i);
        }
        return;
    }
    for (int64_t line = pf->first + b * pf->per_block, end = line + pf->per_block; line < end; line++)
        if (line < pf->last)
            __builtin_prefetch(pf->next + line * 64, 0, 2);
}

/* 8 rows' scales (mins: mins) of group g, for the pair's two 8-row groups; with `same`, the
 * first group's in both halves (an odd last group run as its own pair) */
KT_INLINE __m512 pair_scales(const row8_at *at, int mins, int64_t g, int same)
{
    const char *t = mins ? at->min : at->scale;
    const uint16_t *base = mins ? at->min_base : at->scale_base;
    const __m256 first = group_scales8(t, base, g, at->kind);
    return pair_of(first, same ? first : group_scales8(t + at->next_scale, base + at->next_base, g, at->kind));
}

/* Two-level scales (kt.h KT_SCALE_K) in prefill: the pair's 16 bases of groups g..g+7, taken
 * once for the 8 groups, and each group's 16 uint8 subs. Both levels taken per group
 * (pair_scales) ran one Qwen3-30B-A3B MoE layer, Q4_K-like, 1.09x slower at T=512 (86.8 vs
 * 79.5 ms, alternating in one run, 2-core Zen 4). */
KT_INLINE __m512 pair_bases(const row8_at *at, int mins, int64_t g, int same)
{
    const uint16_t *base = (mins ? at->min_base : at->scale_base) + (g / KT_SCALE_K_GROUPS) * 8;
    const __m128i first = _mm_loadu_si128((const __m128i *)base);
    const __m128i second = same ? first : _mm_loadu_si128((const __m128i *)(base + at->next_base));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1));
}

KT_INLINE __m512 pair_subs(const row8_at *at, int mins, int64_t g, int same)
{
    const char *t = (mins ? at->min : at->scale) + g * 8;
    const __m128i first = _mm_loadl_epi64((const __m128i *)t);
    const __m128i both = _mm_unpacklo_epi64(first, same ? first : _mm_loadl_epi64((const __m128i *)(t + at->next_scale)));
    return _mm512_cvtepi32_ps(at->kind == KT_SCALE_KS ? _mm512_cvtepi8_epi32(both) : _mm512_cvtepu8_epi32(both));
}

/* Rows 8G..8G+15 for tokens t0..t0+TT-1 into out (token t at out[t * ldo], 16 floats); with
 * `same`, rows 8G..8G+7 only (G is the last group: both halves compute it, 8 floats stored) */
KT_INLINE void row8_pair(float *out, int64_t ldo, const kt_matrix *w, int64_t G, int same, const kt_acts *a,
                         int64_t t0, const pair_prefetch *pf, const int is_i8, const int TT)
{
    const row8_at at = row8_locate(w, G, a, t0);
    const int64_t group_bytes = 8 * kt_row_bytes(w), block_bytes = is_i8 ? I8_BLOCK_BYTES : ROW8_BLOCK_BYTES;
    const uint8_t *codes0 = at.codes, *codes1 = same ? codes0 : codes0 + group_bytes;
    const __m512 bias = _mm512_set1_ps(is_i8 ? -128.0f : -8.0f);
    __m512 acc[PAIR_TOKENS];
    for (int t = 0; t < TT; t++)
        acc[t] = _mm512_setzero_ps();
    const int two_level = kt_two_level(at.kind);
    __m512 scale_bases = _mm512_setzero_ps(), min_bases = _mm512_setzero_ps();
    for (int64_t g = 0, b = 0; g < at.ng; g++) {
        if (two_level && g % KT_SCALE_K_GROUPS == 0) {
            scale_bases = pair_bases(&at, 0, g, same);
            if (at.min)
                min_bases = pair_bases(&at, 1, g, same);
        }
        const __m512 ws = two_level ? _mm512_mul_ps(pair_subs(&at, 0, g, same), scale_bases)
                                    : pair_scales(&at, 0, g, same);
        for (int64_t end = b + at.per_group; b < end; b++) {
            const uint8_t *b0 = codes0 + b * block_bytes, *b1 = codes1 + b * block_bytes;
            prefetch_block(pf, b0, b1, b, is_i8);
            __m512i dot[PAIR_TOKENS];
            pair_block_dots(dot, b0, b1, at.q + (is_i8 ? b * 32 : act_piece(b)), at.cols, is_i8, TT);
            for (int t = 0; t < TT; t++) {
                const __m512 scale_tb = _mm512_mul_ps(ws, _mm512_set1_ps(at.sa[t * at.nb + b]));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), scale_tb, acc[t]);
            }
        }
        /* INT4: mn or -8 s; I8: (mn or 0) - 128 s */
        __m512 zero_point = _mm512_mul_ps(ws, bias);
        if (at.min) {
            const __m512 mins = two_level ? _mm512_mul_ps(pair_subs(&at, 1, g, same), min_bases)
                                          : pair_scales(&at, 1, g, same);
            zero_point = is_i8 ? _mm512_add_ps(zero_point, mins) : mins;
        }
        for (int t = 0; t < TT; t++)
            acc[t] = _mm512_fmadd_ps(zero_point, _mm512_set1_ps(at.gsum[t * at.ng + g]), acc[t]);
    }
    for (int t = 0; t < TT; t++)
        _mm512_mask_storeu_ps(out + t * ldo, same ? (__mmask16)0x00FF : (__mmask16)0xFFFF, acc[t]);
}

#if defined(KT_ROW8_PAIR_DPBUSD)
/* INT4 decode on AVX-512: one 8-row group, a whole 512-bit register a load. The 64 bytes at
 * 64h of a block (h = 0, 1) are its pieces 2h (lanes 0-7: 8 rows) and 2h + 1 (lanes 8-15),
 * so each half needs its own activation dwords: one vpermd picks them from the 64 activation
 * bytes of the block pair (kt_acts' I4 interleave: dwords 0-3 columns 0-15 of the even block,
 * 4-7 of the odd one, 8-11 and 12-15 their columns 16-31). The two halves of a lane pair sum
 * the same row, added once at the end. Per 128-byte block that is 2 loads, 4 vpermd and 4
 * vpdpbusd where the 256-bit form (row8_group) spends 4 loads, 8 broadcasts and 8 vpdpbusd:
 * from L3, 1.2x its speed (2048 x 2048 Q4_0-like, one thread, 2-core Zen 5 guest).
 * DECODE_AHEAD: the prefetch distance, 4 KB. Streaming from memory, the 8-row form's 1 KB left the
 * MoE layer at the same speed, 4-8 KB (into L1 or L2) ran it 1.08-1.17x faster (Qwen3-30B-A3B
 * shape, Q4_0 and g128, T = 1 and 2, 25 alternating rounds in one process, same host). Into L2
 * (prefetcht1), not L1: on a 2-core Sapphire Rapids-class guest that ran the same layer 1.02-1.09x
 * faster (12 rounds), 1 KB 0.88-0.90x, 2 KB 0.94-0.98x, 8 KB 0.99-1.02x, none 0.72-0.79x. */
enum { DECODE_AHEAD = 4096 };
KT_INLINE __m512i decode_index(int parity, int piece, int high)
{
    const int first = 8 * high + 4 * parity + piece;
    return _mm512_set_epi32(first + 1, first + 1, first + 1, first + 1, first + 1, first + 1, first + 1,
                            first + 1, first, first, first, first, first, first, first, first);
}

/* int32 dots of block b's 8 rows (each lane pair i, i + 8 sums to row i) with TT tokens'
 * activations (q: token 0's, act rows cols apart) */
KT_INLINE void decode_block_dots(__m512i dot[2], const uint8_t *block, const int8_t *q, int64_t cols, int64_t b,
                                 const int TT)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int p = (int)(b & 1);
    const __m512i v0 = _mm512_loadu_si512(block), v1 = _mm512_loadu_si512(block + 64);
    const __m512i lo0 = _mm512_and_si512(v0, low4), hi0 = _mm512_and_si512(_mm512_srli_epi32(v0, 4), low4);
    const __m512i lo1 = _mm512_and_si512(v1, low4), hi1 = _mm512_and_si512(_mm512_srli_epi32(v1, 4), low4);
    for (int t = 0; t < TT; t++) {
        const __m512i x = _mm512_loadu_si512(q + t * cols + (b / 2) * 64);
        const __m512i zero = _mm512_setzero_si512();
        __m512i d = _mm512_dpbusd_epi32(zero, lo0, _mm512_permutexvar_epi32(decode_index(p, 0, 0), x));
        __m512i e = _mm512_dpbusd_epi32(zero, hi0, _mm512_permutexvar_epi32(decode_index(p, 0, 1), x));
        d = _mm512_dpbusd_epi32(d, lo1, _mm512_permutexvar_epi32(decode_index(p, 2, 0), x));
        e = _mm512_dpbusd_epi32(e, hi1, _mm512_permutexvar_epi32(decode_index(p, 2, 1), x));
        dot[t] = _mm512_add_epi32(d, e);
    }
}

/* INT4 decode: rows 8G..8G+7 for the TT (<= 2) rows of activations, as row8_group computes them */
KT_INLINE void row8_group_decode(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a,
                                 const int TT)
{
    const row8_at at = row8_locate(w, G, a, 0);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 zacc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0, b = 0; g < at.ng; g++) {
        const __m256 scales = at_scales8(&at, g);
        const __m512 ws = pair_of(scales, scales);      /* the group's 8 scales, twice */
        for (int64_t end = b + at.per_group; b < end; b++) {
            const uint8_t *block = at.codes + b * ROW8_BLOCK_BYTES;
            _mm_prefetch((const char *)block + DECODE_AHEAD, _MM_HINT_T1);
            _mm_prefetch((const char *)block + DECODE_AHEAD + 64, _MM_HINT_T1);
            __m512i dot[2];
            decode_block_dots(dot, block, at.q, at.cols, b, TT);
            for (int t = 0; t < TT; t++) {
                const __m512 scale_tb = _mm512_mul_ps(ws, _mm512_set1_ps(at.sa[t * at.nb + b]));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), scale_tb, acc[t]);
            }
        }
        const __m256 zero_point = at.min ? at_mins8(&at, g) : _mm256_mul_ps(scales, _mm256_set1_ps(-8.0f));
        for (int t = 0; t < TT; t++)
            zacc[t] = _mm256_fmadd_ps(zero_point, _mm256_set1_ps(at.gsum[t * at.ng + g]), zacc[t]);
    }
    for (int t = 0; t < TT; t++) {
        const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1));
        const __m256 rows = _mm256_add_ps(_mm512_castps512_ps256(acc[t]), high);
        _mm256_storeu_ps(out + t * ldo, _mm256_add_ps(rows, zacc[t]));
    }
}

/* Rows [r0, r1) (multiples of 8) for the 1-2 rows of activations of a */
static inline void row8_rows_i4_decode(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                       const kt_acts *a)
{
    for (int64_t G = r0 / 8; G < r1 / 8; G++) {
        if (a->m == 1)
            row8_group_decode(out + (G * 8 - r0), ldo, w, G, a, 1);
        else
            row8_group_decode(out + (G * 8 - r0), ldo, w, G, a, 2);
    }
}
#endif

/* The prefetch plan of token tile `tile` of `tiles` over pair G (pair_prefetch) */
KT_INLINE pair_prefetch pair_plan(const kt_matrix *w, int64_t G, int64_t r1, int64_t tile, int64_t tiles)
{
    const int64_t group_bytes = 8 * kt_row_bytes(w), lines = 2 * group_bytes / 64, nb = w->cols / 32;
    pair_prefetch pf = {tile == 0, NULL, 0, 0, 0};
    if (tile == 0 || G + 3 >= r1 / 8)
        return pf;
    const int64_t per_tile = (lines + tiles - 2) / (tiles - 1);
    pf.next = (const char *)w->data + (G + 2) * group_bytes;
    pf.first = (tile - 1) * per_tile;
    pf.last = pf.first + per_tile < lines ? pf.first + per_tile : lines;
    pf.per_block = (per_tile + nb - 1) / nb;
    return pf;
}

/* One token tile (the first tt of PAIR_TOKENS) of pair G */
KT_INLINE void pair_tile(float *o, int64_t ldo, const kt_matrix *w, int64_t G, int same, const kt_acts *a,
                         int64_t t0, const pair_prefetch *pf, int64_t tt, const int is_i8)
{
    switch (tt < PAIR_TOKENS ? tt : PAIR_TOKENS) {
    case 1: row8_pair(o, ldo, w, G, same, a, t0, pf, is_i8, 1); break;
    case 2: row8_pair(o, ldo, w, G, same, a, t0, pf, is_i8, 2); break;
    case 3: row8_pair(o, ldo, w, G, same, a, t0, pf, is_i8, 3); break;
    case 4: row8_pair(o, ldo, w, G, same, a, t0, pf, is_i8, 4); break;
    case 5: row8_pair(o, ldo, w, G, same, a, t0, pf, is_i8, 5); break;
    default: row8_pair(o, ldo, w, G, same, a, t0, pf, is_i8, 6); break;
    }
}

/* Rows [r0, r1) (multiples of 8) for tokens [c0, c1): pairs of 8-row groups, then the odd
 * group, if any: INT4 through the 8-row form, I8 as a pair of itself */
KT_INLINE void row8_pair_chunk(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                               const kt_acts *a, int64_t c0, int64_t c1, const int is_i8)
{
    const int64_t tiles = (c1 - c0 + PAIR_TOKENS - 1) / PAIR_TOKENS;
    int64_t G = r0 / 8;
    if (is_i8 && c1 - c0 <= 2) {
        for (; G < r1 / 8; G++)
            row8_i8_tokens(out + (G * 8 - r0), ldo, w, G, a, c0, c1, NULL);
        return;
    }
    for (; G + 1 < r1 / 8; G += 2)
        for (int64_t t0 = c0, tile = 0; t0 < c1; t0 += PAIR_TOKENS, tile++) {
            const pair_prefetch pf = pair_plan(w, G, r1, tile, tiles);
            pair_tile(out + t0 * ldo + (G * 8 - r0), ldo, w, G, 0, a, t0, &pf, c1 - t0, is_i8);
        }
    if (G == r1 / 8)
        return;
    if (!is_i8) {
        row8_tokens_i4(out + (G * 8 - r0), ldo, w, G * 8, r1, a, c0, c1);
        return;
    }
    const pair_prefetch stream = {1, NULL, 0, 0, 0};
    for (int64_t t0 = c0; t0 < c1; t0 += PAIR_TOKENS)
        pair_tile(out + t0 * ldo + (G * 8 - r0), ldo, w, G, 1, a, t0, &stream, c1 - t0, is_i8);
}

/* Every token, in chunks of ROW8_CHUNK, as row8_rows_i4: INT4 (from PAIR_MIN_TOKENS rows of
 * activations) or I8 rows */
static inline void row8_pair_rows(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                  const kt_acts *a)
{
    for (int64_t c0 = 0; c0 < a->m; c0 += ROW8_CHUNK) {
        const int64_t c1 = c0 + ROW8_CHUNK < a->m ? c0 + ROW8_CHUNK : a->m;
        row8_pair_chunk(out, ldo, w, r0, r1, a, c0, c1, w->format == KT_I8);
    }
}

#endif
#endif
