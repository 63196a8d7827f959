/* simd_row8_i6.h: the 8-row kernel for I6 weights in KT_LAYOUT_ROW8 (kt.h) against int8
 * activations (kt_acts, plain rows as for I8), included by row8.c only.
 *
 * A block of 8 rows and 32 columns is I4's 128 bytes of low nibbles and 64 bytes of top bits
 * (kt.h). Load j (0-3) of the nibbles holds, per row, columns 4j..4j+3 (low nibbles) and
 * 16+4j..19+4j (high ones); high byte p covers nibble bytes p and p + 64, so loads 0 and 1
 * take bits 0-3 of high bytes 0-31 and 32-63, loads 2 and 3 bits 4-7. Each code is the
 * nibble ORed with its 2 bits moved to bits 4-5: an unsigned byte 0..63, vpdpbusd's (or
 * vpmaddubsw's) unsigned operand, against the 4 activation bytes of its columns broadcast
 * to the 8 rows.
 *
 * Maths: for token t, block b and 8-row lane i, the low and high nibbles' dots are kept
 * apart, as columns 0-15 and 16-31 of the block:
 *   acc[i] += sa[b] * (s[i, g_lo] * dot_lo[i] + s[i, g_hi] * dot_hi[i])
 * (g_lo = g_hi for groups of 32 or more, summed first), and once per group the zero point,
 * -32 * s[i, g] (symmetric) or mn[i, g], times gsum[g].
 * int16 bound (vpmaddubsw, no VNNI): a pair sum is <= 2 * 63 * 128 = 16128 (activations
 * -128..127), so two loads' pair sums add in int16 (32256 < 32767) before vpmaddwd. */
#ifndef KT_SIMD_ROW8_I6_H
#define KT_SIMD_ROW8_I6_H

#include "simd_row8.h"
#include "simd_row8_pair.h"

#if defined(KT_ROW8_KERNEL)
#define KT_ROW8_I6_KERNEL 1

/* I6_TOKENS: tokens a pass over an 8-row group takes, as many as the registers hold
 * (2 int32 chains and a float accumulator a token) */
#if defined(__AVX512F__)
#define I6_TOKENS 4
#else
#define I6_TOKENS 2
#endif
enum { I6_BLOCK_BYTES = 192, I6_AHEAD = 2048 };

/* The codes of nibble load j of an I6 block: low-nibble codes in *lo, high-nibble ones in *hi */
KT_INLINE void i6_codes(__m256i *lo, __m256i *hi, const uint8_t *block, const int j)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * (j % 2)));
    /* 16-bit shifts: bits crossing into the next byte land outside 0x30 */
    const __m256i h_lo = j < 2 ? _mm256_slli_epi16(h, 4) : h;
    const __m256i h_hi = j < 2 ? _mm256_slli_epi16(h, 2) : _mm256_srli_epi16(h, 2);
    *lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(h_lo, top2));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_and_si256(h_hi, top2));
}

/* The int32 dots of one block's 8 rows with TT tokens' activations (q: token 0's block,
 * tokens cols apart): low-nibble columns (0-15) in lo[t], high ones (16-31) in hi[t] */
KT_INLINE void i6_block_dots(__m256i lo[I6_TOKENS], __m256i hi[I6_TOKENS], const uint8_t *block, const int8_t *q,
                             int64_t cols, const int TT)
{
    for (int t = 0; t < TT; t++)
        lo[t] = hi[t] = _mm256_setzero_si256();
#if defined(ROW8_DPBUSD)
    for (int j = 0; j < 4; j++) {
        __m256i cl, ch;
        i6_codes(&cl, &ch, block, j);
        for (int t = 0; t < TT; t++) {
            lo[t] = ROW8_DPBUSD(lo[t], cl, broadcast4(q + t * cols + 4 * j));
            hi[t] = ROW8_DPBUSD(hi[t], ch, broadcast4(q + t * cols + 16 + 4 * j));
            __asm__("" : "+x"(lo[t]), "+x"(hi[t]));
        }
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 4; j += 2) {
        __m256i cl0, ch0, cl1, ch1;
        i6_codes(&cl0, &ch0, block, j);
        i6_codes(&cl1, &ch1, block, j + 1);
        for (int t = 0; t < TT; t++) {
            const int8_t *x = q + t * cols + 4 * j;
            const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(cl0, broadcast4(x)),
                                                _mm256_maddubs_epi16(cl1, broadcast4(x + 4)));
            const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(ch0, broadcast4(x + 16)),
                                                _mm256_maddubs_epi16(ch1, broadcast4(x + 20)));
            lo[t] = _mm256_add_epi32(lo[t], _mm256_madd_epi16(pl, ones));
            hi[t] = _mm256_add_epi32(hi[t], _mm256_madd_epi16(ph, ones));
        }
    }
#endif
}

/* The zero point of group g's 8 rows with scales ws: the mins, or -32 * ws */
KT_INLINE __m256 i6_zero_point(const row8_at *at, int64_t g, __m256 ws)
{
    return at->min ? at_mins8(at, g) : _mm256_mul_ps(ws, _mm256_set1_ps(-32.0f));
}

KT_INLINE void i6_prefetch(const uint8_t *block, int stream)
{
    if (!stream)        /* a later token tile: the group's codes are in L1 or L2 by now */
        return;
    for (int i = 0; i < 3; i++)
        _mm_prefetch((const char *)block + I6_AHEAD + 64 * i, _MM_HINT_T1);
}

/* Groups of 16: each block's low and high nibbles have groups 2b and 2b + 1 */
KT_INLINE void i6_rows_g16(__m256 acc[I6_TOKENS], const row8_at *at, int stream, const int TT)
{
    for (int64_t b = 0; b < at->nb; b++) {
        const uint8_t *block = at->codes + b * I6_BLOCK_BYTES;
        i6_prefetch(block, stream);
        __m256i lo[I6_TOKENS], hi[I6_TOKENS];
        i6_block_dots(lo, hi, block, at->q + b * 32, at->cols, TT);
        const __m256 s_lo = at_scales8(at, 2 * b), s_hi = at_scales8(at, 2 * b + 1);
        const __m256 z_lo = i6_zero_point(at, 2 * b, s_lo), z_hi = i6_zero_point(at, 2 * b + 1, s_hi);
        for (int t = 0; t < TT; t++) {
            const __m256 sa = _mm256_set1_ps(at->sa[t * at->nb + b]);
            const float *gsum = at->gsum + t * at->ng + 2 * b;
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[t]), _mm256_mul_ps(s_lo, sa), acc[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[t]), _mm256_mul_ps(s_hi, sa), acc[t]);
            acc[t] = _mm256_fmadd_ps(z_lo, _mm256_set1_ps(gsum[0]), acc[t]);
            acc[t] = _mm256_fmadd_ps(z_hi, _mm256_set1_ps(gsum[1]), acc[t]);
        }
    }
}

/* Groups of 32 or more: per_group blocks under one scale */
KT_INLINE void i6_rows_grouped(__m256 acc[I6_TOKENS], const row8_at *at, int stream, const int TT)
{
    for (int64_t g = 0, b = 0; g < at->ng; g++) {
        const __m256 ws = at_scales8(at, g);
        for (int64_t end = b + at->per_group; b < end; b++) {
            const uint8_t *block = at->codes + b * I6_BLOCK_BYTES;
            i6_prefetch(block, stream);
            __m256i lo[I6_TOKENS], hi[I6_TOKENS];
            i6_block_dots(lo, hi, block, at->q + b * 32, at->cols, TT);
            for (int t = 0; t < TT; t++) {
                const __m256 scale_tb = _mm256_mul_ps(ws, _mm256_set1_ps(at->sa[t * at->nb + b]));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo[t], hi[t])), scale_tb, acc[t]);
            }
        }
        const __m256 zero_point = i6_zero_point(at, g, ws);
        for (int t = 0; t < TT; t++)
            acc[t] = _mm256_fmadd_ps(zero_point, _mm256_set1_ps(at->gsum[t * at->ng + g]), acc[t]);
    }
}

/* Rows 8G..8G+7 for tokens t0..t0+TT-1 of kt_acts into out (token t at out[t * ldo], 8 floats);
 * stream: the first pass over the group's codes, which prefetches them */
KT_INLINE void row8_i6_group(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a, int64_t t0,
                             int stream, const int TT)
{
    const row8_at at = row8_locate(w, G, a, t0);
    __m256 acc[I6_TOKENS];
    for (int t = 0; t < TT; t++)
        acc[t] = _mm256_setzero_ps();
    if (w->group == 16)
        i6_rows_g16(acc, &at, stream, TT);
    else
        i6_rows_grouped(acc, &at, stream, TT);
    for (int t = 0; t < TT; t++)
        _mm256_storeu_ps(out + t * ldo, acc[t]);
}

/* Tokens [c0, c1) of rows 8G..8G+7, I6_TOKENS at a time */
KT_INLINE void row8_i6_tokens(float *out, int64_t ldo, const kt_matrix *w, int64_t G, const kt_acts *a, int64_t c0,
                              int64_t c1)
{
    for (int64_t t0 = c0; t0 < c1; t0 += I6_TOKENS) {
        float *o = out + t0 * ldo;
        const int stream = t0 == c0;
        switch (c1 - t0 < I6_TOKENS ? c1 - t0 : I6_TOKENS) {
        case 1: row8_i6_group(o, ldo, w, G, a, t0, stream, 1); break;
#if I6_TOKENS > 2
        case 2: row8_i6_group(o, ldo, w, G, a, t0, stream, 2); break;
        case 3: row8_i6_group(o, ldo, w, G, a, t0, stream, 3); break;
#endif
        default: row8_i6_group(o, ldo, w, G, a, t0, stream, I6_TOKENS); break;
        }
    }
}

#if defined(KT_ROW8_PAIR_DPBUSD)
/* The 16-row form on AVX512-VNNI, as simd_row8_pair.h's for INT4 and I8: one 512-bit register
 * holds the same load of 8-row groups G (low half) and G + 1 (high half), so each activation
 * broadcast and vpdpbusd serves 16 rows. Prefill from PAIR_MIN_TOKENS tokens, PAIR_TOKENS at a
 * time. */
KT_INLINE void i6_pair_codes(__m512i *lo, __m512i *hi, const uint8_t *b0, const uint8_t *b1, const int j)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    const __m512i v = load_pair(b0 + 32 * j, b1 + 32 * j);
    const __m512i h = load_pair(b0 + 128 + 32 * (j % 2), b1 + 128 + 32 * (j % 2));
    const __m512i h_lo = j < 2 ? _mm512_slli_epi16(h, 4) : h;
    const __m512i h_hi = j < 2 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
    *lo = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(h_lo, top2));
    *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_and_si512(h_hi, top2));
}

/* The int32 dots of one block's 16 rows with TT tokens (q: token 0's block, tokens cols apart),
 * low-nibble columns in lo[t], high ones in hi[t]; the codes stay unpacked while the tokens pass */
KT_INLINE void i6_pair_dots(__m512i lo[PAIR_TOKENS], __m512i hi[PAIR_TOKENS], const uint8_t *b0, const uint8_t *b1,
                            const int8_t *q, int64_t cols, const int TT)
{
    __m512i cl[4], ch[4];
    for (int j = 0; j < 4; j++)
        i6_pair_codes(&cl[j], &ch[j], b0, b1, j);
    const int8_t *x = q;
    for (int t = 0; t < TT; t++, x += cols) {
        __asm__("" : "+r"(x));      /* one pointer, as pair_block_dots */
        lo[t] = hi[t] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            lo[t] = dpbusd_bcast(lo[t], cl[j], x + 4 * j);
            hi[t] = dpbusd_bcast(hi[t], ch[j], x + 16 + 4 * j);
        }
    }
}

/* The pair's scales (mins: mins) of group g, asked for in increasing g: two-level ones take the
 * bases of groups g..g+7 once, at g % 8 == 0, into *bases (as row8_pair: pair_bases) */
KT_INLINE __m512 i6_pair_scales(const row8_at *at, int mins, int64_t g, int same, __m512 *bases)
{
    if (!kt_two_level(at->kind))
        return pair_scales(at, mins, g, same);
    if (g % KT_SCALE_K_GROUPS == 0)
        *bases = pair_bases(at, mins, g, same);
    return _mm512_mul_ps(pair_subs(at, mins, g, same), *bases);
}

KT_INLINE __m512 i6_pair_zero_point(const row8_at *at, int64_t g, int same, __m512 ws, __m512 *min_bases)
{
    return at->min ? i6_pair_scales(at, 1, g, same, min_bases) : _mm512_mul_ps(ws, _mm512_set1_ps(-32.0f));
}

/* acc[t] += dot[t] * ws * sa[t] (sa: block b's scales, tokens nb apart) */
KT_INLINE void i6_pair_scale(__m512 acc[PAIR_TOKENS], const __m512i dot[PAIR_TOKENS], __m512 ws, const float *sa,
                             int64_t nb, const int TT)
{
    for (int t = 0; t < TT; t++)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(ws, _mm512_set1_ps(sa[t * nb])), acc[t]);
}

/* acc[t] += zero_point * gsum[t * ng] */
KT_INLINE void i6_pair_zero(__m512 acc[PAIR_TOKENS], __m512 zero_point, const float *gsum, int64_t ng, const int TT)
{
    for (int t = 0; t < TT; t++)
        acc[t] = _mm512_fmadd_ps(zero_point, _mm512_set1_ps(gsum[t * ng]), acc[t]);
}

/* Rows 8G..8G+15 for tokens t0..t0+TT-1 into out (16 floats a token); with `same`, rows
 * 8G..8G+7 only (G the last group: both halves compute it, 8 floats stored) */
KT_INLINE void row8_i6_pair(float *out, int64_t ldo, const kt_matrix *w, int64_t G, int same, const kt_acts *a,
                            int64_t t0, int stream, const int TT)
{
    const row8_at at = row8_locate(w, G, a, t0);
    const uint8_t *codes0 = at.codes, *codes1 = same ? codes0 : codes0 + 8 * kt_row_bytes(w);
    __m512 acc[PAIR_TOKENS];
    for (int t = 0; t < TT; t++)
        acc[t] = _mm512_setzero_ps();
    const int g16 = w->group == 16;
    __m512 bases = _mm512_setzero_ps(), min_bases = _mm512_setzero_ps();
    for (int64_t g = 0, b = 0; b < at.nb; g++) {
        const __m512 ws = i6_pair_scales(&at, 0, g16 ? 2 * b : g, same, &bases);
        const __m512 ws_hi = g16 ? i6_pair_scales(&at, 0, 2 * b + 1, same, &bases) : ws;
        for (int64_t end = g16 ? b + 1 : b + at.per_group; b < end; b++) {
            const uint8_t *b0 = codes0 + b * I6_BLOCK_BYTES, *b1 = codes1 + b * I6_BLOCK_BYTES;
            i6_prefetch(b0, stream);
            if (!same)
                i6_prefetch(b1, stream);
            __m512i lo[PAIR_TOKENS], hi[PAIR_TOKENS];
            i6_pair_dots(lo, hi, b0, b1, at.q + b * 32, at.cols, TT);
            if (!g16)
                for (int t = 0; t < TT; t++)
                    lo[t] = _mm512_add_epi32(lo[t], hi[t]);
            i6_pair_scale(acc, lo, ws, at.sa + b, at.nb, TT);
            if (g16)
                i6_pair_scale(acc, hi, ws_hi, at.sa + b, at.nb, TT);
        }
        if (g16) {      /* groups 2b and 2b + 1 of the block just done */
            i6_pair_zero(acc, i6_pair_zero_point(&at, 2 * (b - 1), same, ws, &min_bases), at.gsum + 2 * (b - 1),
                         at.ng, TT);
            i6_pair_zero(acc, i6_pair_zero_point(&at, 2 * b - 1, same, ws_hi, &min_bases), at.gsum + 2 * b - 1,
                         at.ng, TT);
        } else {
            i6_pair_zero(acc, i6_pair_zero_point(&at, g, same, ws, &min_bases), at.gsum + g, at.ng, TT);
        }
    }
    for (int t = 0; t < TT; t++)
        _mm512_mask_storeu_ps(out + t * ldo, same ? (__mmask16)0x00FF : (__mmask16)0xFFFF, acc[t]);
}

/* Tokens [c0, c1) of the pair at G, PAIR_TOKENS at a time */
KT_INLINE void row8_i6_pair_tokens(float *out, int64_t ldo, const kt_matrix *w, int64_t G, int same,
                                   const kt_acts *a, int64_t c0, int64_t c1)
{
    for (int64_t t0 = c0; t0 < c1; t0 += PAIR_TOKENS) {
        float *o = out + t0 * ldo;
        const int stream = t0 == c0;
        switch (c1 - t0 < PAIR_TOKENS ? c1 - t0 : PAIR_TOKENS) {
        case 1: row8_i6_pair(o, ldo, w, G, same, a, t0, stream, 1); break;
        case 2: row8_i6_pair(o, ldo, w, G, same, a, t0, stream, 2); break;
        case 3: row8_i6_pair(o, ldo, w, G, same, a, t0, stream, 3); break;
        case 4: row8_i6_pair(o, ldo, w, G, same, a, t0, stream, 4); break;
        case 5: row8_i6_pair(o, ldo, w, G, same, a, t0, stream, 5); break;
        default: row8_i6_pair(o, ldo, w, G, same, a, t0, stream, 6); break;
        }
    }
}
#endif

/* Rows [r0, r1) (multiples of 8) of tokens [c0, c1): the 16-row form from PAIR_MIN_TOKENS
 * tokens on AVX512-VNNI builds (an odd last group as a pair of itself), else 8 rows a pass */
static inline void row8_i6_chunk(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                 const kt_acts *a, int64_t c0, int64_t c1)
{
    int64_t G = r0 / 8;
#if defined(KT_ROW8_PAIR_DPBUSD)
    if (c1 - c0 >= PAIR_MIN_TOKENS) {
        for (; G < r1 / 8; G += 2)
            row8_i6_pair_tokens(out + (G * 8 - r0), ldo, w, G, G + 1 == r1 / 8, a, c0, c1);
        return;
    }
#endif
    for (; G < r1 / 8; G++)
        row8_i6_tokens(out + (G * 8 - r0), ldo, w, G, a, c0, c1);
}

/* Rows [r0, r1) (multiples of 8) for every token, in chunks of ROW8_CHUNK tokens whose
 * activations stay in L2 while each 8-row group (a few KB, in L1 after the chunk's first
 * tokens) passes over them */
static inline void row8_rows_i6(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                                const kt_acts *a)
{
    for (int64_t c0 = 0; c0 < a->m; c0 += ROW8_CHUNK)
        row8_i6_chunk(out, ldo, w, r0, r1, a, c0, c0 + ROW8_CHUNK < a->m ? c0 + ROW8_CHUNK : a->m);
}

#endif
#endif
