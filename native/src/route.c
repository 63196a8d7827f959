/* route.c: softmax top-k routing of router logits (kt.h kt_route_softmax_topk), in
 * one call instead of the softmax, top-k, renormalisation and counting that torch
 * runs as separate operations per MoE layer and decode step. */
#include <math.h>
#include "kt_internal.h"

/* Inserts expert e with probability p into the descending list (ids, probs) of
 * n < k entries or of k full ones; equal p keep the lower id first. -> new n */
static int32_t keep_top(int32_t *ids, float *probs, int32_t n, int32_t k, int32_t e, float p)
{
    if (n == k && !(p > probs[k - 1]))
        return n;
    int32_t at = n == k ? k - 1 : n;
    while (at > 0 && p > probs[at - 1]) {
        ids[at] = ids[at - 1];
        probs[at] = probs[at - 1];
        at--;
    }
    ids[at] = e;
    probs[at] = p;
    return n == k ? k : n + 1;
}

static void route_row(const float *logits, int64_t experts, int32_t k, int32_t normalize, int32_t *ids,
                      float *weights)
{
    float max = logits[0], sum = 0.0f;
    for (int64_t e = 1; e < experts; e++)
        max = logits[e] > max ? logits[e] : max;
    for (int64_t e = 0; e < experts; e++)
        sum += expf(logits[e] - max);
    int32_t n = 0;
    for (int64_t e = 0; e < experts; e++) {
        float p = expf(logits[e] - max) / sum;
        n = keep_top(ids, weights, n, k, (int32_t)e, p == p ? p : -1.0f);   /* NaN: last, so ids stay valid */
    }
    float kept = 0.0f;
    for (int32_t j = 0; j < k; j++)
        kept += weights[j];
    if (normalize)
        for (int32_t j = 0; j < k; j++)
            weights[j] /= kept;
}

int kt_route_softmax_topk(const float *logits, int64_t tokens, int64_t experts, int32_t k, int32_t normalize,
                          int32_t *ids, float *weights, int64_t *counts)
{
    if (!logits || !ids || !weights || tokens < 1 || experts < 1 || experts > INT32_MAX)
        return KT_EINVAL;
    if (k < 1 || k > KT_ROUTE_MAX_K || k > experts)
        return KT_EINVAL;
    for (int64_t t = 0; t < tokens; t++) {
        route_row(logits + t * experts, experts, k, normalize, ids + t * k, weights + t * k);
        if (counts)
            for (int32_t j = 0; j < k; j++)
                counts[ids[t * k + j]]++;
    }
    return KT_OK;
}
