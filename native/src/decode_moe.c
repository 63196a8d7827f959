/* decode_moe.c: the MoE half of a decode step in one call (kt.h kt_decode_moe_f32).
 *
 * In decode, one MoE layer's post-norm, router, routing and the call into the
 * expert operator each cost 50-110 us from Python on a 2-core machine (their
 * data evicted by the experts the step before streamed), about 0.3 ms a layer
 * beside ~1.5 ms of expert work. Here they are plain calls of the same kernels,
 * in the same order as kt_cli.layers.moe.MoEBlock. */
#include "kt_internal.h"

static int64_t top_k(const kt_decode_moe *M) { return M->top_k; }

int64_t kt_decode_moe_scratch_floats(const kt_decode_moe *M, int64_t n)
{
    if (!M || n < 1 || M->hidden < 1 || M->n_experts < 1 || M->top_k < 1)
        return -1;
    return n * (2 * M->hidden + M->n_experts + 2 * top_k(M));
}

static int moe_ok(const kt_decode_moe *M)
{
    if (!M || !M->post_norm || !(M->post_eps >= 0.0f) || !M->router || !M->moe || M->hidden < 1)
        return 0;
    if (M->top_k < 1 || M->top_k > KT_ROUTE_MAX_K || M->top_k > M->n_experts)
        return 0;
    int64_t hidden;
    int32_t n_experts;
    kt_moe_dims(M->moe, &hidden, &n_experts);
    if (hidden != M->hidden || n_experts != M->n_experts)
        return 0;
    const kt_matrix *r = M->router;
    return r->rows == M->n_experts && r->cols == M->hidden && kt_matrix_check(r) == KT_OK;
}

int kt_decode_moe_f32(kt_pool *pool, const kt_decode_moe *M, float *h, int64_t n, float *scratch,
                      int64_t scratch_floats)
{
    if (!pool || !h || !scratch || n < 1 || !moe_ok(M))
        return KT_EINVAL;
    int64_t need = kt_decode_moe_scratch_floats(M, n);
    if (need < 0 || scratch_floats < need)
        return KT_EINVAL;
    const int64_t H = M->hidden, K = top_k(M);
    float *x = scratch, *logits = x + n * H, *weights = logits + n * M->n_experts;
    int32_t *ids = (int32_t *)(weights + n * K);     /* int32 in float-sized slots */
    float *y = (float *)(ids + n * K);
    int rc = kt_rmsnorm_f32(x, h, M->post_norm, n, H, 1, M->post_eps);
    if (rc == KT_OK)
        rc = kt_linear(pool, logits, x, n, M->router, KT_ACTS_F32);
    if (rc == KT_OK)
        rc = kt_route_softmax_topk(logits, n, M->n_experts, M->top_k, M->normalize, ids, weights, M->counts);
    if (rc == KT_OK)
        rc = kt_moe_forward(pool, M->moe, y, x, ids, weights, n, K);
    if (rc != KT_OK)
        return rc;
    for (int64_t k = 0; k < n * H; k++)
        h[k] += y[k];
    return KT_OK;
}
