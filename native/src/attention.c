/* attention.c: attention of query rows over a paged float32 KV cache in one call
 * (each row lists its own context, so rows of different sequences share a call).
 *
 * Row i, query head h (KV head g = h / G, G = heads / kv_heads), over the keys at
 * cache rows slots[ctx_offset[i] + j], j < ctx_len[i]:
 *   s_j = scale * q[i, h] . K[slot_j, g],   out[i, h] = sum_j softmax(s)_j V[slot_j, g]
 *
 * The softmax runs online over blocks of ATTN_BLOCK keys (running max m and
 * denominator l per query; when m grows, what was summed so far is rescaled by
 * exp(m_old - m_new)), so the scores never need the whole context. A task is a KV
 * head of a block of rows:
 * - a lone row (decode: one new token per sequence): its G query heads read each key
 *   and value row once, as dot products (the rows stream from memory);
 * - consecutive rows with the same context start (a prefill chunk of one sequence,
 *   causal through their lengths) are taken up to block_rows() at a time, and their
 *   G heads each form two small GEMMs per key block on the vector units
 *   (simd_attn_block.h), every key and value row read once for all of them. Blocks
 *   run longest context first, so the last tasks are the short ones. */
#include <math.h>
#include <stdlib.h>
#include "kt_internal.h"
#include "simd_float.h"
#include "simd_math.h"

#define ATTN_BLOCK 32
#include "simd_attn_block.h"

#define BLOCK_QUERIES AB_PAD  /* query vectors a block of rows aims at (rows x G) */

typedef struct {
    float *out;
    const float *q, *k, *v;
    const int64_t *slots, *ctx_offset, *ctx_len;
    int32_t heads, kv_heads, head_dim, v_dim;
    float scale;
    const int64_t *starts;   /* block b holds rows starts[b] .. starts[b + 1] - 1 */
    int64_t blocks;
    float *scratch;          /* per pool thread: row_task's or block_task's buffers */
    int64_t scratch_floats;
} attn_job;

static float dot_f32(const float *a, const float *b, int64_t n)
{
    vf acc0 = vf_zero(), acc1 = vf_zero();
    int64_t k = 0;
    for (; k + 2 * VF_N <= n; k += 2 * VF_N) {
        acc0 = vf_fma(vf_load(a + k), vf_load(b + k), acc0);
        acc1 = vf_fma(vf_load(a + k + VF_N), vf_load(b + k + VF_N), acc1);
    }
    for (; k + VF_N <= n; k += VF_N)
        acc0 = vf_fma(vf_load(a + k), vf_load(b + k), acc0);
    float s = vf_hsum(acc0) + vf_hsum(acc1);
    for (; k < n; k++)
        s += a[k] * b[k];
    return s;
}

/* s[b] = exp(s[b] - m) for b < nb; returns their sum */
static float exp_shifted(float *s, int nb, float m)
{
    vf mv = vf_set1(m), sum = vf_zero();
    int b = 0;
    for (; b + VF_N <= nb; b += VF_N) {
        vf e = vf_exp_nonpos(vf_load(s + b) - mv);
        vf_store(s + b, e);
        sum = sum + e;
    }
    float total = vf_hsum(sum);
    for (; b < nb; b++)
        total += (s[b] = expf(s[b] - m));
    return total;
}

/* Four heads' scores against one key: the key is loaded once for the four, and two
 * accumulators per head (even and odd vectors) keep 8 FMA chains in flight. */
static void dot4_f32(float *s, int64_t s_stride, const float *q, int64_t D, const float *key)
{
    vf acc[4][2];
    for (int i = 0; i < 4; i++)
        acc[i][0] = acc[i][1] = vf_zero();
    int64_t k = 0;
    for (; k + 2 * VF_N <= D; k += 2 * VF_N) {
        vf k0 = vf_load(key + k), k1 = vf_load(key + k + VF_N);
        for (int i = 0; i < 4; i++) {
            acc[i][0] = vf_fma(vf_load(q + i * D + k), k0, acc[i][0]);
            acc[i][1] = vf_fma(vf_load(q + i * D + k + VF_N), k1, acc[i][1]);
        }
    }
    for (; k + VF_N <= D; k += VF_N) {
        vf kv = vf_load(key + k);
        for (int i = 0; i < 4; i++)
            acc[i][0] = vf_fma(vf_load(q + i * D + k), kv, acc[i][0]);
    }
    for (int i = 0; i < 4; i++) {
        float sum = vf_hsum(acc[i][0] + acc[i][1]);
        for (int64_t r = k; r < D; r++)
            sum += q[i * D + r] * key[r];
        s[i * s_stride] = sum;
    }
}

/* acc[h, c .. c + W * VF_N) += sum_b probs[h, b] V_b[c ..] for heads h0..h0+3, in
 * registers: acc is read and written once per block of keys, not once per key.
 * W = 2 vectors a head keeps 8 FMA chains in flight. */
KT_INLINE void pv4_f32(float *acc, int64_t Dv, const float *probs, const float *const *vrows, int nb, int64_t c,
                       const int W)
{
    vf r[4][2];
    for (int i = 0; i < 4; i++)
        for (int w = 0; w < W; w++)
            r[i][w] = vf_load(acc + i * Dv + c + w * VF_N);
    for (int b = 0; b < nb; b++) {
        vf v[2];
        for (int w = 0; w < W; w++)
            v[w] = vf_load(vrows[b] + c + w * VF_N);
        for (int i = 0; i < 4; i++) {
            vf p = vf_set1(probs[i * ATTN_BLOCK + b]);
            for (int w = 0; w < W; w++)
                r[i][w] = vf_fma(p, v[w], r[i][w]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int w = 0; w < W; w++)
            vf_store(acc + i * Dv + c + w * VF_N, r[i][w]);
}

/* acc [G, Dv] += probs [G, nb] . V [nb, Dv] for one block of value rows */
static void accumulate_values(float *acc, int64_t Dv, int G, const float *probs, const float *const *vrows,
                              int nb)
{
    int h = 0;
    for (; h + 4 <= G; h += 4) {
        int64_t c = 0;
        for (; c + 2 * VF_N <= Dv; c += 2 * VF_N)
            pv4_f32(acc + h * Dv, Dv, probs + h * ATTN_BLOCK, vrows, nb, c, 2);
        for (; c + VF_N <= Dv; c += VF_N)
            pv4_f32(acc + h * Dv, Dv, probs + h * ATTN_BLOCK, vrows, nb, c, 1);
    }
    for (; h < G; h++)
        for (int b = 0; b < nb; b++)
            for (int64_t c = 0; c + VF_N <= Dv; c += VF_N)
                vf_store(acc + h * Dv + c, vf_fma(vf_set1(probs[h * ATTN_BLOCK + b]), vf_load(vrows[b] + c),
                                                  vf_load(acc + h * Dv + c)));
    for (int64_t c = Dv - Dv % VF_N; c < Dv; c++)
        for (h = 0; h < G; h++)
            for (int b = 0; b < nb; b++)
                acc[h * Dv + c] += probs[h * ATTN_BLOCK + b] * vrows[b][c];
}

/* Cache rows of one KV head are 4 * head_dim bytes every kv_heads * 4 * head_dim:
 * short runs in a large stride that the hardware prefetchers hardly follow, so each
 * block's rows are requested one block ahead. */
static void prefetch_rows(const float *base, const int64_t *slots, int nb, int64_t row_floats, int64_t offset,
                          int64_t n_floats)
{
    for (int b = 0; b < nb; b++) {
        const char *row = (const char *)(base + slots[b] * row_floats + offset);
        for (int64_t byte = 0; byte < n_floats * 4; byte += 64)
            __builtin_prefetch(row + byte);
    }
}

/* Scores of a block of keys for the G heads, then the online-softmax update:
 * scores become the block's unnormalised probabilities exp(s - m_new). */
static void block_probs(const attn_job *j, const float *qg, int64_t g, const int64_t *slots, int nb, int G,
                        float *scores, float *m, float *l, float *acc)
{
    const int64_t D = j->head_dim, Dv = j->v_dim;
    for (int b = 0; b < nb; b++) {
        const float *key = j->k + (slots[b] * j->kv_heads + g) * D;
        int h = 0;
        for (; h + 4 <= G; h += 4)
            dot4_f32(scores + h * ATTN_BLOCK + b, ATTN_BLOCK, qg + h * D, D, key);
        for (; h < G; h++)
            scores[h * ATTN_BLOCK + b] = dot_f32(qg + h * D, key, D);
    }
    for (int h = 0; h < G; h++) {
        float *s = scores + h * ATTN_BLOCK, m_new = m[h];
        for (int b = 0; b < nb; b++)
            s[b] *= j->scale;
        for (int b = 0; b < nb; b++)
            m_new = s[b] > m_new ? s[b] : m_new;
        if (m_new > m[h]) {
            float rescale = m[h] == -INFINITY ? 0.0f : expf(m[h] - m_new);
            l[h] *= rescale;
            for (int64_t c = 0; c < Dv; c++)
                acc[h * Dv + c] *= rescale;
            m[h] = m_new;
        }
        l[h] += exp_shifted(s, nb, m_new);
    }
}

/* One row, KV head g. Scratch: acc [G, Dv], scores [G, ATTN_BLOCK], m [G], l [G]. */
static void row_task(const attn_job *j, int64_t i, int64_t g, int thread)
{
    const int G = j->heads / j->kv_heads;
    const int64_t D = j->head_dim, Dv = j->v_dim;
    float *acc = j->scratch + thread * j->scratch_floats, *scores = acc + G * Dv;
    float *m = scores + G * ATTN_BLOCK, *l = m + G;
    for (int h = 0; h < G; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int64_t c = 0; c < G * Dv; c++)
        acc[c] = 0.0f;
    const float *qg = j->q + (i * j->heads + g * G) * D;
    const int64_t *slots = j->slots + j->ctx_offset[i], len = j->ctx_len[i];
    const int64_t k_row = (int64_t)j->kv_heads * D, v_row = (int64_t)j->kv_heads * Dv;
    prefetch_rows(j->k, slots, (int)(len < ATTN_BLOCK ? len : ATTN_BLOCK), k_row, g * D, D);
    for (int64_t b0 = 0; b0 < len; b0 += ATTN_BLOCK) {
        int nb = (int)(len - b0 < ATTN_BLOCK ? len - b0 : ATTN_BLOCK);
        int next = (int)(len - b0 - nb < ATTN_BLOCK ? len - b0 - nb : ATTN_BLOCK);
        prefetch_rows(j->v, slots + b0, nb, v_row, g * Dv, Dv);
        prefetch_rows(j->k, slots + b0 + nb, next, k_row, g * D, D);
        block_probs(j, qg, g, slots + b0, nb, G, scores, m, l, acc);
        const float *vrows[ATTN_BLOCK];
        for (int b = 0; b < nb; b++)
            vrows[b] = j->v + slots[b0 + b] * v_row + g * Dv;
        accumulate_values(acc, Dv, G, scores, vrows, nb);
    }
    float *o = j->out + (i * j->heads + g * G) * Dv;
    for (int h = 0; h < G; h++)
        for (int64_t c = 0; c < Dv; c++)
            o[h * Dv + c] = acc[h * Dv + c] / l[h];
}

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* rows a block takes: enough for BLOCK_QUERIES query vectors, at least one */
static int64_t block_rows(int64_t G) { return G >= BLOCK_QUERIES ? 1 : BLOCK_QUERIES / G; }

/* floats block_task needs for up to `rows` rows: qt, st, acc, m, l and valid (ints) */
static int64_t block_floats(int64_t rows, int64_t G, int64_t D, int64_t Dv)
{
    int64_t Mp = round_up(rows * G, AB_PAD);
    return Mp * (D + AB_KEY_ROWS + Dv + 3);
}

/* qt = scale * the block's query vectors in panels of AB_Q, transposed (simd_attn_block.h);
 * zeros past M */
static void pack_queries(float *qt, const attn_job *j, int64_t r0, int64_t M, int64_t Mp, int64_t g)
{
    const int64_t G = j->heads / j->kv_heads, D = j->head_dim;
    for (int64_t i = 0; i < Mp; i++) {
        const float *q = i < M ? j->q + ((r0 + i / G) * j->heads + g * G + i % G) * D : NULL;
        float *panel = qt + (i / AB_Q) * D * AB_Q + i % AB_Q;
        for (int64_t d = 0; d < D; d++)
            panel[d * AB_Q] = q ? q[d] * j->scale : 0.0f;
    }
}

/* Rows r0 .. r0 + rows - 1 (one context start), KV head g, as simd_attn_block.h lays out */
static void block_task(const attn_job *j, int64_t r0, int64_t rows, int64_t g, int thread)
{
    const int64_t G = j->heads / j->kv_heads, D = j->head_dim, Dv = j->v_dim;
    const int64_t M = rows * G, Mp = round_up(M, AB_PAD);
    float *qt = j->scratch + thread * j->scratch_floats, *st = qt + D * Mp, *acc = st + AB_KEY_ROWS * Mp;
    float *m = acc + Mp * Dv, *l = m + Mp;
    int *valid = (int *)(l + Mp);
    pack_queries(qt, j, r0, M, Mp, g);
    int64_t longest = 0;
    for (int64_t r = r0; r < r0 + rows; r++)
        longest = j->ctx_len[r] > longest ? j->ctx_len[r] : longest;
    for (int64_t i = 0; i < Mp; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    for (int64_t c = 0; c < Mp * Dv; c++)
        acc[c] = 0.0f;
    const int64_t *slots = j->slots + j->ctx_offset[r0];
    for (int64_t b0 = 0; b0 < longest; b0 += ATTN_BLOCK) {
        const int nb = (int)(longest - b0 < ATTN_BLOCK ? longest - b0 : ATTN_BLOCK);
        const float *krow[AB_KEY_ROWS], *vrow[AB_KEY_ROWS];
        for (int b = 0; b < AB_KEY_ROWS; b++) {         /* past nb: any key, its scores unread */
            int64_t slot = slots[b0 + (b < nb ? b : 0)];
            krow[b] = j->k + (slot * j->kv_heads + g) * D;
            vrow[b] = j->v + (slot * j->kv_heads + g) * Dv;
        }
        for (int b = 0; b < nb; b += AB_KEYS)
            for (int64_t i = 0; i < Mp; i += AB_Q)
                score_tile(st + b * Mp + i, Mp, krow + b, qt + i * D, D);
        for (int64_t i = 0; i < Mp; i++) {
            int64_t left = i < M ? j->ctx_len[r0 + i / G] - b0 : nb;
            valid[i] = (int)(left < nb ? left : nb);
        }
        block_softmax(st, Mp, nb, valid, m, l, acc, Dv);
        block_values(acc, Dv, st, Mp, vrow, nb);
    }
    for (int64_t i = 0; i < M; i++) {
        float *o = j->out + ((r0 + i / G) * j->heads + g * G + i % G) * Dv;
        for (int64_t c = 0; c < Dv; c++)
            o[c] = acc[i * Dv + c] / l[i];
    }
}

static void attn_task(void *ctx, int64_t task, int thread)
{
    const attn_job *j = ctx;
    const int64_t b = j->blocks - 1 - task / j->kv_heads, g = task % j->kv_heads;
    const int64_t r0 = j->starts[b], rows = j->starts[b + 1] - r0;
    if (rows == 1)
        row_task(j, r0, g, thread);
    else
        block_task(j, r0, rows, g, thread);
}

/* starts[0 .. blocks]: runs of rows with the same context start, cut every `most` rows */
static int64_t group_rows(int64_t *starts, const int64_t *ctx_offset, int64_t n, int64_t most)
{
    int64_t blocks = 0;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || ctx_offset[i] != ctx_offset[i - 1] || i - starts[blocks - 1] == most)
            starts[blocks++] = i;
    starts[blocks] = n;
    return blocks;
}

static int contexts_valid(const int64_t *slots, int64_t n_slots, int64_t cache_rows, const int64_t *ctx_offset,
                          const int64_t *ctx_len, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        if (ctx_len[i] < 1 || ctx_offset[i] < 0 || ctx_offset[i] > n_slots - ctx_len[i])
            return 0;
    }
    for (int64_t s = 0; s < n_slots; s++)
        if (slots[s] < 0 || slots[s] >= cache_rows)
            return 0;
    return 1;
}

int kt_attention_decode_f32(kt_pool *pool, float *out, const float *q, int64_t n, int32_t heads,
                            const float *k_cache, const float *v_cache, int64_t cache_rows, int32_t kv_heads,
                            int32_t head_dim, int32_t v_dim, const int64_t *slots, int64_t n_slots,
                            const int64_t *ctx_offset, const int64_t *ctx_len, float scale)
{
    if (!pool || !out || !q || !k_cache || !v_cache || !slots || !ctx_offset || !ctx_len || n < 1 || cache_rows < 1
        || heads < 1 || kv_heads < 1 || heads % kv_heads || head_dim < 1 || v_dim < 1 || n_slots < 1
        || !isfinite(scale) || n > INT64_MAX / heads)
        return KT_EINVAL;
    if (!contexts_valid(slots, n_slots, cache_rows, ctx_offset, ctx_len, n))
        return KT_EINVAL;
    const int64_t G = heads / kv_heads, threads = kt_pool_threads(pool), most = block_rows(G);
    const int64_t row_floats = G * ((int64_t)v_dim + ATTN_BLOCK + 2);
    const int64_t blk_floats = block_floats(most, G, head_dim, v_dim);
    attn_job j = {out, q, k_cache, v_cache, slots, ctx_offset, ctx_len, heads, kv_heads, head_dim, v_dim, scale,
                  NULL, 0, NULL, row_floats > blk_floats ? row_floats : blk_floats};
    int64_t *starts = malloc((size_t)(n + 1) * sizeof(int64_t));
    j.scratch = malloc((size_t)(threads * j.scratch_floats) * sizeof(float));
    if (!starts || !j.scratch) {
        free(starts);
        free(j.scratch);
        return KT_ENOMEM;
    }
    j.blocks = group_rows(starts, ctx_offset, n, most);
    j.starts = starts;
    kt_pool_run(pool, attn_task, &j, j.blocks * kv_heads);
    free(starts);
    free(j.scratch);
    return KT_OK;
}
