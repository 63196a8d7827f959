/* simd_attn_block.h: attention of a block of query vectors against ATTN_BLOCK keys at
 * a time as two small GEMMs on the vector units (attention.c's path for rows that
 * share a context: a prefill chunk's rows of one sequence).
 *
 * A block holds M query vectors: some consecutive rows of one sequence times the G
 * query heads of one KV head (vector i = row i / G, head i % G), padded with zero
 * queries to Mp, a multiple of VF_N. Layouts, per pool thread:
 *   qt  [Mp / AB_Q, D, AB_Q]  the queries transposed by panels of AB_Q, times the scale
 *                         (a score tile streams one contiguous D x AB_Q panel); when
 *                         Mp is an odd number of vectors, a last narrow panel [D, VF_N]
 *   st  [AB_KEY_ROWS, Mp] key b's score for query i at st[b * Mp + i]; then exp(s - m)
 *   acc [Mp, Dv]          the running sum of p * V per query vector
 * Scores are formed as S^T = K Q^T: each key element is broadcast against AB_Q
 * queries loaded from qt, so neither the cached keys nor the scores are transposed,
 * and the online softmax runs across queries, one lane per query. */
#ifndef KT_SIMD_ATTN_BLOCK_H
#define KT_SIMD_ATTN_BLOCK_H

#include <math.h>
#include "simd_float.h"
#include "simd_math.h"

/* Tiles of 2 vectors by AB_KEYS keys (scores) or AB_ROWS query vectors (values): 12-16
 * accumulators, enough FMA chains to cover the latency, within the register file */
#if defined(__AVX512F__)
#define AB_KEYS 8
#define AB_ROWS 8
#define AB_PAD 32           /* multiple of AB_Q and AB_ROWS: full tiles for full blocks */
#elif defined(__AVX2__)
#define AB_KEYS 6
#define AB_ROWS 6
#define AB_PAD 48           /* multiple of AB_Q and AB_ROWS: full tiles for full blocks */
#else
#define AB_KEYS 4
#define AB_ROWS 4
#define AB_PAD 4
#endif
#define AB_Q (2 * VF_N)     /* queries a score tile holds, and columns a value tile holds */
#define AB_NARROW_KEYS (2 * AB_KEYS)  /* keys a narrow (one-vector) score tile holds */
#define AB_KEY_ROWS ((ATTN_BLOCK + AB_NARROW_KEYS - 1) / AB_NARROW_KEYS * AB_NARROW_KEYS)  /* rows of st */

#if defined(__AVX512F__)
#define vf_max(a, b) _mm512_max_ps(a, b)
#elif defined(__AVX2__)
#define vf_max(a, b) _mm256_max_ps(a, b)
#else
#define vf_max(a, b) fmaxf(a, b)
#endif

/* st[b, 0 .. AB_Q) = the qt panel's AB_Q queries . krow[b] for the AB_KEYS keys krow[0 ..],
 * each key element loaded once for AB_Q queries */
KT_INLINE void score_tile(float *st, int64_t Mp, const float *const *krow, const float *qt, int64_t D)
{
    vf acc[AB_KEYS][2];
    for (int b = 0; b < AB_KEYS; b++)
        acc[b][0] = acc[b][1] = vf_zero();
    for (int64_t d = 0; d < D; d++) {
        vf q0 = vf_load(qt + d * AB_Q), q1 = vf_load(qt + d * AB_Q + VF_N);
        for (int b = 0; b < AB_KEYS; b++) {
            vf k = vf_set1(krow[b][d]);
            acc[b][0] = vf_fma(k, q0, acc[b][0]);
            acc[b][1] = vf_fma(k, q1, acc[b][1]);
        }
    }
    for (int b = 0; b < AB_KEYS; b++) {
        vf_store(st + b * Mp, acc[b][0]);
        vf_store(st + b * Mp + VF_N, acc[b][1]);
    }
}

/* The same for a narrow panel: VF_N queries, twice the keys (as many FMA chains) */
KT_INLINE void score_tile_narrow(float *st, int64_t Mp, const float *const *krow, const float *qt, int64_t D)
{
    vf acc[AB_NARROW_KEYS];
    for (int b = 0; b < AB_NARROW_KEYS; b++)
        acc[b] = vf_zero();
    for (int64_t d = 0; d < D; d++) {
        vf q = vf_load(qt + d * VF_N);
        for (int b = 0; b < AB_NARROW_KEYS; b++)
            acc[b] = vf_fma(vf_set1(krow[b][d]), q, acc[b]);
    }
    for (int b = 0; b < AB_NARROW_KEYS; b++)
        vf_store(st + b * Mp, acc[b]);
}

/* acc[i, c .. c + AB_Q) += sum_b st[b, i] vrow[b][c ..] for the R <= AB_ROWS query vectors
 * i at acc (st offset to the same first query): acc is read and written once per block */
KT_INLINE void value_tile(float *acc, int64_t Dv, const float *st, int64_t Mp, const float *const *vrow, int nb,
                          int64_t c, const int R)
{
    vf r[AB_ROWS][2];
    for (int i = 0; i < R; i++) {
        r[i][0] = vf_load(acc + i * Dv + c);
        r[i][1] = vf_load(acc + i * Dv + c + VF_N);
    }
    for (int b = 0; b < nb; b++) {
        vf v0 = vf_load(vrow[b] + c), v1 = vf_load(vrow[b] + c + VF_N);
        for (int i = 0; i < R; i++) {
            vf p = vf_set1(st[b * Mp + i]);
            r[i][0] = vf_fma(p, v0, r[i][0]);
            r[i][1] = vf_fma(p, v1, r[i][1]);
        }
    }
    for (int i = 0; i < R; i++) {
        vf_store(acc + i * Dv + c, r[i][0]);
        vf_store(acc + i * Dv + c + VF_N, r[i][1]);
    }
}

/* value_tile with R < AB_ROWS a constant of each case */
static inline void value_tile_rows(float *acc, int64_t Dv, const float *st, int64_t Mp, const float *const *vrow,
                                   int nb, int64_t c, int R)
{
    switch (R) {
    case 1: value_tile(acc, Dv, st, Mp, vrow, nb, c, 1); break;
    case 2: value_tile(acc, Dv, st, Mp, vrow, nb, c, 2); break;
#if AB_ROWS > 3
    case 3: value_tile(acc, Dv, st, Mp, vrow, nb, c, 3); break;
#endif
#if AB_ROWS > 4
    case 4: value_tile(acc, Dv, st, Mp, vrow, nb, c, 4); break;
    case 5: value_tile(acc, Dv, st, Mp, vrow, nb, c, 5); break;
#endif
#if AB_ROWS > 6
    case 6: value_tile(acc, Dv, st, Mp, vrow, nb, c, 6); break;
    case 7: value_tile(acc, Dv, st, Mp, vrow, nb, c, 7); break;
#endif
    default: break;
    }
}

/* acc [M, Dv] += st^T [M, nb] . V [nb, Dv] (the M real query vectors; padding is never read back) */
static inline void block_values(float *acc, int64_t Dv, const float *st, int64_t Mp, int64_t M,
                                const float *const *vrow, int nb)
{
    const int64_t wide = Dv - Dv % AB_Q;
    for (int64_t i = 0; i < M; i += AB_ROWS) {
        const int R = (int)(M - i < AB_ROWS ? M - i : AB_ROWS);
        for (int64_t c = 0; c < wide; c += AB_Q) {
            if (R == AB_ROWS)
                value_tile(acc + i * Dv, Dv, st + i, Mp, vrow, nb, c, AB_ROWS);
            else
                value_tile_rows(acc + i * Dv, Dv, st + i, Mp, vrow, nb, c, R);
        }
        for (int64_t r = i; r < i + R; r++)
            for (int b = 0; b < nb; b++)
                for (int64_t c = wide; c < Dv; c++)
                    acc[r * Dv + c] += st[b * Mp + r] * vrow[b][c];
    }
}

/* acc row i *= the lanes of f where they are not 1 (the running maximum moved) */
KT_INLINE void rescale_rows(float *acc, int64_t Dv, vf f, int64_t i0)
{
    float lane[VF_N];
    vf_store(lane, f);
    for (int r = 0; r < VF_N; r++) {
        if (lane[r] == 1.0f)
            continue;
        float *row = acc + (i0 + r) * Dv;
        for (int64_t c = 0; c < Dv; c++)
            row[c] *= lane[r];
    }
}

/* The online softmax over one block of nb keys for queries [0, Mp): query i counts the
 * first valid[i] keys of the block (a row's context ends inside or before it: the rest
 * are set to -inf before the maximum and to 0 after the exp; valid[i] <= 0 leaves the
 * query as it was, since its first block always holds a key). st becomes
 * exp(s - m_new); m, l and acc are updated, acc rescaled by exp(m_old - m_new). */
static inline void block_softmax(float *st, int64_t Mp, int nb, const int *valid, float *m, float *l, float *acc,
                                 int64_t Dv)
{
    for (int64_t i = 0; i < Mp; i++)
        for (int b = valid[i] < 0 ? 0 : valid[i]; b < nb; b++)
            st[b * Mp + i] = -INFINITY;
    for (int64_t i0 = 0; i0 < Mp; i0 += VF_N) {
        vf m_old = vf_load(m + i0), m_new = m_old, sum = vf_zero();
        for (int b = 0; b < nb; b++)
            m_new = vf_max(m_new, vf_load(st + b * Mp + i0));
        for (int b = 0; b < nb; b++) {
            vf e = vf_exp_nonpos(vf_load(st + b * Mp + i0) - m_new);
            vf_store(st + b * Mp + i0, e);
            sum = sum + e;
        }
        vf f = vf_exp_nonpos(m_old - m_new);        /* m_old = -inf: ~1e-38, over acc = 0 */
        vf_store(l + i0, vf_load(l + i0) * f + sum);
        vf_store(m + i0, m_new);
        rescale_rows(acc, Dv, f, i0);
    }
    for (int64_t i = 0; i < Mp; i++)
        for (int b = valid[i] < 0 ? 0 : valid[i]; b < nb; b++)
            st[b * Mp + i] = 0.0f;
}

#endif
