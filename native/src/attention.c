/* attention.c: attention of query rows over a paged float32 KV cache in one call
 * (each row lists its own context, so rows of different sequences share a call).
 *
 * Row i, query head h (KV head g = h / G, G = heads / kv_heads), over the keys at
 * cache rows slots[ctx_offset[i] + j], j < ctx_len[i]:
 *   s_j = scale * q[i, h] . K[slot_j, g],   out[i, h] = sum_j softmax(s)_j V[slot_j, g]
 *
 * The softmax runs online over blocks of ATTN_BLOCK keys (running max m and
 * denominator l per query; when m grows, what was summed so far is rescaled by
 * exp(m_old - m_new)), so the scores never need the whole context. Tasks:
 * - consecutive rows with the same context start (a prefill chunk of one sequence,
 *   causal through their lengths), up to block_rows() at a time, one task a KV head:
 *   their G heads each form two small GEMMs per key block on the vector units
 *   (simd_attn_block.h), every key and value row read once for all of them. Blocks
 *   run longest context first, so the last tasks are the short ones;
 * - a lone row (decode: one new token per sequence) whose G heads fill a quarter of a
 *   vector or more: pieces of its context (piece_task), every KV head in turn within each
 *   block of keys, so each cache row is read as one run of all its heads (a KV head's
 *   own runs are a whole row apart, which a core streams at half the rate); a long
 *   context splits into pieces of keys for the threads, merged at the end (each
 *   piece's m, l and sums rescaled to the largest m), a short one into pieces of heads;
 * - other lone rows (G below a quarter of a vector): a KV head at a time, as dot products. */
#include <math.h>
#include <stdlib.h>
#include "kt_internal.h"
#include "simd_float.h"
#include "simd_math.h"

#define ATTN_BLOCK 32
#include "simd_attn_block.h"

#define BLOCK_QUERIES AB_PAD  /* query vectors a block of rows aims at (rows x G) */

/* A lone row's keys [k0, k1) for KV heads [g0, g1) (piece_task); part >= 0: the keys are one
 * share of the row's context, split into n_parts, whose running m, l and acc go to
 * partials[part] for merge_split, else the heads' output. */
typedef struct {
    int64_t row, k0, k1, g0, g1, part, n_parts;
} attn_piece;

typedef struct {
    float *out;
    const float *q, *k, *v;
    const int64_t *slots, *ctx_offset, *ctx_len;
    int32_t heads, kv_heads, head_dim, v_dim;
    float scale;
    const int64_t *starts;   /* block b holds rows starts[b] .. starts[b + 1] - 1 */
    const int64_t *blocks;   /* the blocks of block tasks (kv_heads tasks each), in row order */
    int64_t n_blocks;
    const attn_piece *pieces;
    int64_t n_pieces;
    float *partials;         /* [parts, heads, 2 + v_dim]: m, l, acc */
    float *scratch;          /* per pool thread: row_task's, block_task's or piece_task's buffers */
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

/* n_floats floats from `offset` of cache row `slot` (rows row_floats apart) towards L1 */
KT_INLINE void prefetch_row(const float *base, int64_t slot, int64_t row_floats, int64_t offset, int64_t n_floats)
{
    const char *row = (const char *)(base + slot * row_floats + offset);
    for (int64_t byte = 0; byte < n_floats * 4; byte += 64)
        __builtin_prefetch(row + byte);
}

/* KV head g's value row of key b of this block (nb keys at slots) and key row of key b of the
 * next one (`next` keys) towards L1, where they exist */
KT_INLINE void prefetch_key(const attn_job *j, const int64_t *slots, int nb, int next, int b, int64_t g)
{
    const int64_t D = j->head_dim, Dv = j->v_dim;
    if (b < nb)
        prefetch_row(j->v, slots[b], (int64_t)j->kv_heads * Dv, g * Dv, Dv);
    if (b < next)
        prefetch_row(j->k, slots[nb + b], (int64_t)j->kv_heads * D, g * D, D);
}

/* prefetch_key for every key of the block, in a burst: a row_task's first block; every block
 * of a piece of some heads */
static void prefetch_block(const attn_job *j, const int64_t *slots, int nb, int next, int64_t g)
{
    for (int b = 0; b < nb || b < next; b++)
        prefetch_key(j, slots, nb, next, b, g);
}

/* Scores of a block of keys for the G heads, then the online-softmax update:
 * scores become the block's unnormalised probabilities exp(s - m_new). Cache rows of
 * one KV head are short runs in a large stride that the hardware prefetchers hardly
 * follow, so each key requests its value row and the next block's key row at its
 * index (`ahead` of them), a few lines at a time rather than a block in a burst. */
static void block_probs(const attn_job *j, const float *qg, int64_t g, const int64_t *slots, int nb, int ahead,
                        int G, float *scores, float *m, float *l, float *acc)
{
    const int64_t D = j->head_dim, Dv = j->v_dim;
    for (int b = 0; b < nb; b++) {
        prefetch_key(j, slots, nb, ahead, b, g);
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
    const int64_t v_row = (int64_t)j->kv_heads * Dv;
    prefetch_block(j, slots, 0, (int)(len < ATTN_BLOCK ? len : ATTN_BLOCK), g);
    for (int64_t b0 = 0; b0 < len; b0 += ATTN_BLOCK) {
        int nb = (int)(len - b0 < ATTN_BLOCK ? len - b0 : ATTN_BLOCK);
        int next = (int)(len - b0 - nb < ATTN_BLOCK ? len - b0 - nb : ATTN_BLOCK);
        block_probs(j, qg, g, slots + b0, nb, next, G, scores, m, l, acc);
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

/* query vectors a block of M pads to */
static int64_t padded_queries(int64_t M) { return round_up(M, VF_N); }

/* floats block_task needs for up to `rows` rows: qt, st, acc, m, l and valid (ints) */
static int64_t block_floats(int64_t rows, int64_t G, int64_t D, int64_t Dv)
{
    int64_t Mp = padded_queries(rows * G);
    return Mp * (D + AB_KEY_ROWS + Dv + 3);
}

/* qt = scale * the block's query vectors in panels of AB_Q (the last one VF_N wide when Mp is
 * an odd number of vectors), transposed (simd_attn_block.h); zeros past M */
static void pack_queries(float *qt, const attn_job *j, int64_t r0, int64_t M, int64_t Mp, int64_t g)
{
    const int64_t G = j->heads / j->kv_heads, D = j->head_dim;
    for (int64_t p0 = 0; p0 < Mp; p0 += AB_Q) {
        const int64_t width = Mp - p0 < AB_Q ? Mp - p0 : AB_Q;
        float *panel = qt + p0 * D;
        for (int64_t i = p0; i < p0 + width; i++) {
            const float *q = i < M ? j->q + ((r0 + i / G) * j->heads + g * G + i % G) * D : NULL;
            for (int64_t d = 0; d < D; d++)
                panel[d * width + i - p0] = q ? q[d] * j->scale : 0.0f;
        }
    }
}

/* st [AB_KEY_ROWS, Mp] = the scores of the block's keys krow for the Mp packed queries: AB_Q-wide
 * panels AB_KEYS keys at a time (each key group read once for all panels), then the narrow one */
static void block_scores(float *st, int64_t Mp, const float *const *krow, int nb, const float *qt, int64_t D)
{
    const int64_t wide = Mp - Mp % AB_Q;
    for (int b = 0; b < nb; b += AB_KEYS)
        for (int64_t i = 0; i < wide; i += AB_Q)
            score_tile(st + b * Mp + i, Mp, krow + b, qt + i * D, D);
    if (wide < Mp)
        for (int b = 0; b < nb; b += AB_NARROW_KEYS)
            score_tile_narrow(st + b * Mp + wide, Mp, krow + b, qt + wide * D, D);
}

/* Rows r0 .. r0 + rows - 1 (one context start), KV head g, as simd_attn_block.h lays out */
static void block_task(const attn_job *j, int64_t r0, int64_t rows, int64_t g, int thread)
{
    const int64_t G = j->heads / j->kv_heads, D = j->head_dim, Dv = j->v_dim;
    const int64_t M = rows * G, Mp = padded_queries(M);
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
        block_scores(st, Mp, krow, nb, qt, D);
        for (int64_t i = 0; i < Mp; i++) {
            int64_t left = i < M ? j->ctx_len[r0 + i / G] - b0 : nb;
            valid[i] = (int)(left < nb ? left : nb);
        }
        block_softmax(st, Mp, nb, valid, m, l, acc, Dv);
        block_values(acc, Dv, st, Mp, M, vrow, nb);
    }
    for (int64_t i = 0; i < M; i++) {
        float *o = j->out + ((r0 + i / G) * j->heads + g * G + i % G) * Dv;
        for (int64_t c = 0; c < Dv; c++)
            o[c] = acc[i * Dv + c] / l[i];
    }
}

/* Lone rows whose G heads fill a quarter of a vector or more run as pieces: with fewer lanes
 * idle, contiguous rows and split contexts beat G dot products a key (AVX2, 512-4096 keys:
 * G = 2 and 3 1.3-1.7x, G = 1 0.6-1.0x) */
static int lone_row_in_pieces(int64_t G) { return 4 * G >= VF_N; }

/* floats piece_task needs: qt, acc, m and l for every KV head, then st and valid */
static int64_t piece_floats(int64_t kv_heads, int64_t G, int64_t D, int64_t Dv)
{
    const int64_t Mp = padded_queries(G);
    return kv_heads * Mp * (D + Dv + 2) + AB_KEY_ROWS * Mp + Mp;
}

/* The share of the next block's cache rows (`next` of them) that KV head g's turn requests: whole
 * rows of every head, in address order, so that the cache streams as contiguous runs */
static void prefetch_share(const attn_job *j, const int64_t *slots, int next, int64_t g)
{
    const int64_t H = j->kv_heads, k_row = H * j->head_dim, v_row = H * j->v_dim;
    for (int64_t b = g * next / H; b < (g + 1) * next / H; b++) {
        prefetch_row(j->k, slots[b], k_row, 0, k_row);
        prefetch_row(j->v, slots[b], v_row, 0, v_row);
    }
}

/* Requests ahead of the piece's g-th KV head's turn at a block (block_slots, nb keys; `next` in
 * the next one): with every head in the piece, its share of the next block's whole rows; else
 * that head's next key rows and this block's value rows */
static void prefetch_turn(const attn_job *j, const attn_piece *p, const int64_t *block_slots, int nb, int next,
                          int64_t g)
{
    if (p->g1 - p->g0 == j->kv_heads)
        prefetch_share(j, block_slots + nb, next, g);
    else
        prefetch_block(j, block_slots, nb, next, p->g0 + g);
}

/* The piece's m, l and acc of its heads: their output, or its partials (merge_split) */
static void finish_piece(const attn_job *j, const attn_piece *p, const float *acc, const float *m, const float *l,
                         int64_t Mp)
{
    const int64_t G = j->heads / j->kv_heads, Dv = j->v_dim;
    for (int64_t h = p->g0 * G; h < p->g1 * G; h++) {
        const int64_t i = (h / G - p->g0) * Mp + h % G;
        if (p->part < 0) {
            float *o = j->out + (p->row * j->heads + h) * Dv;
            for (int64_t c = 0; c < Dv; c++)
                o[c] = acc[i * Dv + c] / l[i];
        } else {
            float *dst = j->partials + (p->part * j->heads + h) * (Dv + 2);
            dst[0] = m[i];
            dst[1] = l[i];
            for (int64_t c = 0; c < Dv; c++)
                dst[2 + c] = acc[i * Dv + c];
        }
    }
}

/* Keys [k0, k1) of a lone row, a block of keys at a time for each of its KV heads in turn (the
 * G heads of each one block of queries): the heads' runs of each cache row are read within one
 * block, not a whole context apart. A long context splits into pieces of keys for several
 * threads, a short one (few pieces in the call) into pieces of heads. */
static void piece_task(const attn_job *j, const attn_piece *p, int thread)
{
    const int64_t G = j->heads / j->kv_heads, D = j->head_dim, Dv = j->v_dim, Mp = padded_queries(G);
    const int64_t H = p->g1 - p->g0;
    float *qt = j->scratch + thread * j->scratch_floats, *acc = qt + H * D * Mp, *m = acc + H * Mp * Dv;
    float *l = m + H * Mp, *st = l + H * Mp;
    int *valid = (int *)(st + AB_KEY_ROWS * Mp);
    for (int64_t g = 0; g < H; g++)
        pack_queries(qt + g * D * Mp, j, p->row, G, Mp, p->g0 + g);
    for (int64_t i = 0; i < H * Mp; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    for (int64_t c = 0; c < H * Mp * Dv; c++)
        acc[c] = 0.0f;
    const int64_t *slots = j->slots + j->ctx_offset[p->row];
    for (int64_t g = 0; g < H; g++)
        prefetch_turn(j, p, slots + p->k0, 0, (int)(p->k1 - p->k0 < ATTN_BLOCK ? p->k1 - p->k0 : ATTN_BLOCK), g);
    for (int64_t b0 = p->k0; b0 < p->k1; b0 += ATTN_BLOCK) {
        const int nb = (int)(p->k1 - b0 < ATTN_BLOCK ? p->k1 - b0 : ATTN_BLOCK);
        const int next = (int)(p->k1 - b0 - nb < ATTN_BLOCK ? p->k1 - b0 - nb : ATTN_BLOCK);
        for (int64_t i = 0; i < Mp; i++)
            valid[i] = nb;
        for (int64_t g = 0; g < H; g++) {
            const float *krow[AB_KEY_ROWS], *vrow[AB_KEY_ROWS];
            for (int b = 0; b < AB_KEY_ROWS; b++) {     /* past nb: any key, its scores unread */
                int64_t slot = slots[b0 + (b < nb ? b : 0)];
                krow[b] = j->k + (slot * j->kv_heads + p->g0 + g) * D;
                vrow[b] = j->v + (slot * j->kv_heads + p->g0 + g) * Dv;
            }
            prefetch_turn(j, p, slots + b0, nb, next, g);
            block_scores(st, Mp, krow, nb, qt + g * D * Mp, D);
            block_softmax(st, Mp, nb, valid, m + g * Mp, l + g * Mp, acc + g * Mp * Dv, Dv);
            block_values(acc + g * Mp * Dv, Dv, st, Mp, G, vrow, nb);
        }
    }
    finish_piece(j, p, acc, m, l, Mp);
}

static void attn_task(void *ctx, int64_t task, int thread)
{
    const attn_job *j = ctx;
    if (task >= j->n_blocks * j->kv_heads) {
        piece_task(j, &j->pieces[task - j->n_blocks * j->kv_heads], thread);
        return;
    }
    const int64_t b = j->blocks[j->n_blocks - 1 - task / j->kv_heads], g = task % j->kv_heads;
    const int64_t r0 = j->starts[b], rows = j->starts[b + 1] - r0;
    if (rows == 1)
        row_task(j, r0, g, thread);
    else
        block_task(j, r0, rows, g, thread);
}

/* A split row's output from its parts' partials: each part's sums rescaled to the largest m */
static void merge_split(const attn_job *j, const attn_piece *first)
{
    const int64_t Dv = j->v_dim, stride = (int64_t)j->heads * (Dv + 2);
    for (int64_t h = 0; h < j->heads; h++) {
        const float *part = j->partials + first->part * stride + h * (Dv + 2);
        float top = -INFINITY, l = 0.0f;
        for (int64_t c = 0; c < first->n_parts; c++)
            top = part[c * stride] > top ? part[c * stride] : top;
        float *o = j->out + (first->row * j->heads + h) * Dv;
        for (int64_t x = 0; x < Dv; x++)
            o[x] = 0.0f;
        for (int64_t c = 0; c < first->n_parts; c++) {
            const float *pc = part + c * stride, w = expf(pc[0] - top);
            l += w * pc[1];
            for (int64_t x = 0; x < Dv; x++)
                o[x] += w * pc[2 + x];
        }
        for (int64_t x = 0; x < Dv; x++)
            o[x] /= l;
    }
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

enum { PIECES_PER_THREAD = 4, PIECE_MIN_KEYS = 256 };

/* Keys a piece takes: lone rows' keys shared by PIECES_PER_THREAD pieces a thread, at least
 * PIECE_MIN_KEYS (a piece packs its heads' queries once), in whole blocks of keys */
static int64_t piece_keys(int64_t lone_keys, int64_t threads)
{
    const int64_t share = (lone_keys + PIECES_PER_THREAD * threads - 1) / (PIECES_PER_THREAD * threads);
    return round_up(share > PIECE_MIN_KEYS ? share : PIECE_MIN_KEYS, ATTN_BLOCK);
}

/* KV heads a piece takes: all of them, unless the lone rows' pieces of keys are too few for
 * PIECES_PER_THREAD a thread (short contexts, few rows) */
static int64_t piece_heads(int64_t key_pieces, int64_t threads, int64_t kv_heads)
{
    const int64_t groups = (PIECES_PER_THREAD * threads + key_pieces - 1) / key_pieces;
    return groups >= kv_heads ? 1 : (kv_heads + groups - 1) / groups;
}

typedef struct {
    int64_t *starts, *blocks;
    attn_piece *pieces;
    float *partials;
    float *scratch;
} attn_buffers;

static void free_buffers(attn_buffers *b)
{
    free(b->starts);
    free(b->blocks);
    free(b->pieces);
    free(b->partials);
    free(b->scratch);
}

/* Whether block b of rows (starts) is a lone row that runs as pieces */
static int block_in_pieces(const attn_job *j, const int64_t *starts, int64_t b)
{
    return starts[b + 1] - starts[b] == 1 && lone_row_in_pieces(j->heads / j->kv_heads);
}

/* Splits the rows' blocks into block tasks and lone-row pieces (j->blocks, j->pieces); parts
 * counts the pieces of split rows. Returns KT_ENOMEM if the buffers do not come. */
static int plan_tasks(attn_job *j, attn_buffers *buf, int64_t n_row_blocks, int64_t threads, int64_t *parts)
{
    int64_t lone_keys = 0, lone = 0;
    for (int64_t b = 0; b < n_row_blocks; b++)
        if (block_in_pieces(j, buf->starts, b)) {
            lone_keys += j->ctx_len[buf->starts[b]];
            lone++;
        }
    const int64_t chunk = piece_keys(lone_keys, threads), most_pieces = lone + lone_keys / chunk;
    const int64_t span = piece_heads(most_pieces > 0 ? most_pieces : 1, threads, j->kv_heads);
    const int64_t groups = (j->kv_heads + span - 1) / span;
    buf->blocks = malloc((size_t)(n_row_blocks - lone + 1) * sizeof(int64_t));
    buf->pieces = malloc((size_t)(most_pieces * groups + 1) * sizeof(attn_piece));
    if (!buf->blocks || !buf->pieces)
        return KT_ENOMEM;
    int64_t n_blocks = 0, n_pieces = 0, n_parts = 0;
    for (int64_t b = 0; b < n_row_blocks; b++) {
        const int64_t r = buf->starts[b], len = j->ctx_len[r];
        if (!block_in_pieces(j, buf->starts, b)) {
            buf->blocks[n_blocks++] = b;
            continue;
        }
        const int64_t count = (len + chunk - 1) / chunk;
        for (int64_t c = 0; c < count; c++) {
            const int64_t k0 = c * chunk, k1 = k0 + chunk < len ? k0 + chunk : len;
            for (int64_t g0 = 0; g0 < j->kv_heads; g0 += span) {
                const int64_t g1 = g0 + span < j->kv_heads ? g0 + span : j->kv_heads;
                buf->pieces[n_pieces++] = (attn_piece){r, k0, k1, g0, g1, count > 1 ? n_parts + c : -1, count};
            }
        }
        n_parts += count > 1 ? count : 0;
    }
    j->blocks = buf->blocks;
    j->n_blocks = n_blocks;
    j->pieces = buf->pieces;
    j->n_pieces = n_pieces;
    *parts = n_parts;
    return KT_OK;
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
    const int64_t pc_floats = piece_floats(kv_heads, G, head_dim, v_dim);
    const int64_t larger = row_floats > blk_floats ? row_floats : blk_floats;
    attn_job j = {out, q, k_cache, v_cache, slots, ctx_offset, ctx_len, heads, kv_heads, head_dim, v_dim, scale,
                  NULL, NULL, 0, NULL, 0, NULL, NULL, larger > pc_floats ? larger : pc_floats};
    attn_buffers buf = {malloc((size_t)(n + 1) * sizeof(int64_t)), NULL, NULL, NULL,
                        malloc((size_t)(threads * j.scratch_floats) * sizeof(float))};
    int64_t parts = 0;
    int rc = buf.starts && buf.scratch ? KT_OK : KT_ENOMEM;
    if (rc == KT_OK) {
        j.starts = buf.starts;
        rc = plan_tasks(&j, &buf, group_rows(buf.starts, ctx_offset, n, most), threads, &parts);
    }
    if (rc == KT_OK && parts > 0) {
        buf.partials = malloc((size_t)(parts * heads * ((int64_t)v_dim + 2)) * sizeof(float));
        rc = buf.partials ? KT_OK : KT_ENOMEM;
    }
    if (rc == KT_OK) {
        j.scratch = buf.scratch;
        j.partials = buf.partials;
        kt_pool_run(pool, attn_task, &j, j.n_blocks * kv_heads + j.n_pieces);
        for (int64_t p = 0; p < j.n_pieces; p++)
            if (j.pieces[p].part >= 0 && j.pieces[p].k0 == 0 && j.pieces[p].g0 == 0)
                merge_split(&j, &j.pieces[p]);
    }
    free_buffers(&buf);
    return rc;
}
