/* decode_layer.c: one decoder layer of a decode step in one call.
 *
 * In decode a layer is a chain of small kernels on a few rows, and driving that
 * chain from Python cost more than the kernels on small models (and it runs
 * slower still once the weights streamed through the caches have evicted the
 * interpreter's own data). kt_decode_layer_f32 runs the chain here, with the
 * kernels the Python layers call, in the same order:
 *
 *   x   = rmsnorm(h_in, in_norm)
 *   qkv = x @ Wqkv^T (+ bias)              (q heads, then k heads, then v heads)
 *   qk  = rmsnorm per head (qk_norm)       (optional)
 *   rope(q, k); cache[slot_mapping] = k, v
 *   h   = h_in + (attention(q, cache) @ Wo^T (+ bias))
 *   if inter > 0:  h += down(silu(gate(x')) * up(x')),  x' = rmsnorm(h, post_norm)
 *
 * Scratch (floats, kt_decode_scratch_floats): x [n, H], qkv [n, Q + 2K], q [n, Q],
 * attn [n, Q], o [n, H], gate_up [n, 2I], act [n, I], down [n, H] with Q = heads *
 * head_dim, K = kv_heads * head_dim; with q, k and v apart also kv [n, 2K] (their k and
 * v rows before they join q's in qkv; q's go to attn, unused until the attention). */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <string.h>
#include "kt_internal.h"
#include "simd_math.h"

typedef struct scratch {
    float *x, *qkv, *q, *attn, *o, *gate_up, *act, *down, *kv;
} scratch;

static int64_t q_width(const kt_decode_layer *L) { return (int64_t)L->heads * L->head_dim; }
static int64_t kv_width(const kt_decode_layer *L) { return (int64_t)L->kv_heads * L->head_dim; }
static int64_t qkv_width(const kt_decode_layer *L) { return q_width(L) + 2 * kv_width(L); }

int64_t kt_decode_scratch_floats(const kt_decode_layer *L, int64_t n)
{
    if (!L || n < 1 || L->hidden < 1 || L->heads < 1 || L->kv_heads < 1 || L->head_dim < 1 || L->inter < 0)
        return -1;
    int64_t per_row = 3 * (int64_t)L->hidden + qkv_width(L) + 2 * q_width(L) + 3 * (int64_t)L->inter;
    return (per_row + (L->qkv ? 0 : 2 * kv_width(L))) * n;
}

static scratch carve(const kt_decode_layer *L, float *base, int64_t n)
{
    scratch s;
    s.x = base;
    s.qkv = s.x + n * L->hidden;
    s.q = s.qkv + n * qkv_width(L);
    s.attn = s.q + n * q_width(L);
    s.o = s.attn + n * q_width(L);
    s.gate_up = s.o + n * L->hidden;
    s.act = s.gate_up + n * 2 * (int64_t)L->inter;
    s.down = s.act + n * (int64_t)L->inter;
    s.kv = s.down + n * L->hidden;
    return s;
}

static int matrix_is(const kt_matrix *w, int64_t rows, int64_t cols)
{
    return w && w->rows == rows && w->cols == cols && kt_matrix_check(w) == KT_OK;
}

static int layer_ok(const kt_decode_layer *L)
{
    if (!L || L->hidden < 1 || L->heads < 1 || L->kv_heads < 1 || L->heads % L->kv_heads != 0)
        return 0;
    if (L->head_dim < 2 || L->head_dim % 2 != 0 || L->head_dim > 1024 || L->inter < 0)
        return 0;
    if (!L->in_norm || !(L->eps >= 0.0f) || (L->qk_norm && !(L->qk_eps >= 0.0f)))
        return 0;
    if (L->acts != KT_ACTS_INT8 && L->acts != KT_ACTS_INT16 && L->acts != KT_ACTS_F32)
        return 0;
    int qkv_ok = L->qkv ? matrix_is(L->qkv, qkv_width(L), L->hidden)
                        : matrix_is(L->q_proj, q_width(L), L->hidden) && matrix_is(L->k_proj, kv_width(L), L->hidden)
                              && matrix_is(L->v_proj, kv_width(L), L->hidden);
    if (!qkv_ok || !matrix_is(L->o_proj, L->hidden, q_width(L)))
        return 0;
    if (L->inter == 0)
        return 1;
    return L->post_norm && L->post_eps >= 0.0f && matrix_is(L->gate_up, 2 * (int64_t)L->inter, L->hidden)
           && matrix_is(L->down, L->hidden, L->inter);
}

static int step_ok(const kt_decode_step *s, int64_t cache_rows)
{
    if (!s || s->n < 1 || !s->cos || !s->sin || !s->slot_mapping || !s->ctx_slots || s->n_ctx_slots < 1
        || !s->ctx_offset || !s->ctx_len)
        return 0;
    for (int64_t i = 0; i < s->n; i++)
        if (s->slot_mapping[i] < 0 || s->slot_mapping[i] >= cache_rows)
            return 0;
    return 1;
}

/* the new rows' k and v heads (inside qkv) into the cache rows at slot_mapping */
static void write_cache(const kt_decode_layer *L, const kt_decode_step *s, const float *qkv, float *k_cache,
                        float *v_cache)
{
    int64_t K = kv_width(L), row = qkv_width(L);
    for (int64_t i = 0; i < s->n; i++) {
        const float *k = qkv + i * row + q_width(L);
        memcpy(k_cache + s->slot_mapping[i] * K, k, (size_t)K * sizeof(float));
        memcpy(v_cache + s->slot_mapping[i] * K, k + K, (size_t)K * sizeof(float));
    }
}

/* y [n, cols] += bias [cols] on every row; no bias: nothing */
static void add_bias(float *y, const float *bias, int64_t n, int64_t cols)
{
    for (int64_t t = 0; bias && t < n; t++)
        for (int64_t k = 0; k < cols; k++)
            y[t * cols + k] += bias[k];
}

/* qkv = x @ qkv^T, or x's rows through q_proj, k_proj and v_proj joined row by row */
static int project_qkv(kt_pool *pool, const kt_decode_layer *L, int64_t n, const scratch *b)
{
    if (L->qkv)
        return kt_linear(pool, b->qkv, b->x, n, L->qkv, L->acts);
    const int64_t Q = q_width(L), K = kv_width(L), row = qkv_width(L);
    float *q = b->attn, *k = b->kv, *v = b->kv + n * K;
    int rc = kt_linear(pool, q, b->x, n, L->q_proj, L->acts);
    if (rc == KT_OK)
        rc = kt_linear(pool, k, b->x, n, L->k_proj, L->acts);
    if (rc == KT_OK)
        rc = kt_linear(pool, v, b->x, n, L->v_proj, L->acts);
    for (int64_t i = 0; rc == KT_OK && i < n; i++) {
        memcpy(b->qkv + i * row, q + i * Q, (size_t)Q * sizeof(float));
        memcpy(b->qkv + i * row + Q, k + i * K, (size_t)K * sizeof(float));
        memcpy(b->qkv + i * row + Q + K, v + i * K, (size_t)K * sizeof(float));
    }
    return rc;
}

static int attention_half(kt_pool *pool, const kt_decode_layer *L, const kt_decode_step *s, const float *h_in,
                          float *h_out, float *k_cache, float *v_cache, int64_t cache_rows, const scratch *b)
{
    int64_t n = s->n, H = L->hidden, Q = q_width(L), row = qkv_width(L);
    int rc = kt_rmsnorm_f32(b->x, h_in, L->in_norm, n, H, 1, L->eps);
    if (rc == KT_OK)
        rc = project_qkv(pool, L, n, b);
    add_bias(b->qkv, L->qkv_bias, n, row);
    int32_t qk_heads = L->heads + L->kv_heads;
    for (int64_t i = 0; rc == KT_OK && L->qk_norm && i < n; i++)
        rc = kt_rmsnorm_f32(b->qkv + i * row, b->qkv + i * row, L->qk_norm, qk_heads, L->head_dim, qk_heads,
                            L->qk_eps);
    if (rc == KT_OK)
        rc = kt_rope_f32(pool, b->qkv, n, row, qk_heads, L->head_dim, s->cos, s->sin, L->interleaved);
    if (rc != KT_OK)
        return rc;
    write_cache(L, s, b->qkv, k_cache, v_cache);
    for (int64_t i = 0; i < n; i++)
        memcpy(b->q + i * Q, b->qkv + i * row, (size_t)Q * sizeof(float));
    rc = kt_attention_decode_f32(pool, b->attn, b->q, n, L->heads, k_cache, v_cache, cache_rows, L->kv_heads,
                                 L->head_dim, L->head_dim, s->ctx_slots, s->n_ctx_slots, s->ctx_offset,
                                 s->ctx_len, L->scale);
    if (rc == KT_OK)
        rc = kt_linear(pool, b->o, b->attn, n, L->o_proj, L->acts);
    if (rc != KT_OK)
        return rc;
    add_bias(b->o, L->o_bias, n, H);
    for (int64_t k = 0; k < n * H; k++)
        h_out[k] = h_in[k] + b->o[k];
    return KT_OK;
}

/* h += down(silu(gate) * up) */
static int mlp_half(kt_pool *pool, const kt_decode_layer *L, int64_t n, float *h, const scratch *b)
{
    int64_t H = L->hidden, I = L->inter;
    int rc = kt_rmsnorm_f32(b->x, h, L->post_norm, n, H, 1, L->post_eps);
    if (rc == KT_OK)
        rc = kt_linear(pool, b->gate_up, b->x, n, L->gate_up, L->acts);
    if (rc != KT_OK)
        return rc;
    for (int64_t t = 0; t < n; t++)
        silu_mul_f32(b->act + t * I, b->gate_up + t * 2 * I, b->gate_up + t * 2 * I + I, I);
    rc = kt_linear(pool, b->down, b->act, n, L->down, L->acts);
    if (rc != KT_OK)
        return rc;
    for (int64_t k = 0; k < n * H; k++)
        h[k] += b->down[k];
    return KT_OK;
}

int kt_decode_layer_f32(kt_pool *pool, const kt_decode_layer *L, const kt_decode_step *s, const float *h_in,
                        float *h_out, float *k_cache, float *v_cache, int64_t cache_rows, float *scratch_base,
                        int64_t scratch_floats)
{
    if (!pool || !h_in || !h_out || !k_cache || !v_cache || cache_rows < 1 || !scratch_base || !layer_ok(L))
        return KT_EINVAL;
    if (!step_ok(s, cache_rows))
        return KT_EINVAL;
    int64_t need = kt_decode_scratch_floats(L, s->n);
    if (need < 0 || scratch_floats < need)
        return KT_EINVAL;
    scratch b = carve(L, scratch_base, s->n);
    int rc = attention_half(pool, L, s, h_in, h_out, k_cache, v_cache, cache_rows, &b);
    if (rc == KT_OK && L->inter > 0)
        rc = mlp_half(pool, L, s->n, h_out, &b);
    return rc;
}
