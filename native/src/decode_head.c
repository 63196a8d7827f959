/* decode_head.c: the end of a decode step in one call (kt.h kt_decode_head_f32):
 * the final norm, the lm_head and, for greedy rows, the argmax of each row's logits.
 *
 * From Python these were an RMSNorm module, a Linear module and the sampler's torch
 * argmax: ~0.3 ms a step on a 2-core machine (scaled Qwen3-MoE, vocab 49152), most
 * of it interpreter and dispatch work on caches the lm_head's 57 MB had just flushed. */
#include <math.h>
#include "kt_internal.h"

static int head_ok(const kt_decode_head *H)
{
    if (!H || !H->norm || !(H->eps >= 0.0f) || H->hidden < 1 || !H->lm_head)
        return 0;
    if (H->acts != KT_ACTS_INT8 && H->acts != KT_ACTS_INT16 && H->acts != KT_ACTS_F32 && H->acts != KT_ACTS_BF16)
        return 0;
    const kt_matrix *w = H->lm_head;
    return w->cols == H->hidden && w->rows >= 1 && kt_matrix_check(w) == KT_OK;
}

int64_t kt_decode_head_scratch_floats(const kt_decode_head *H, int64_t n)
{
    if (!head_ok(H) || n < 1)
        return -1;
    return n * H->hidden;
}

/* The first index of the largest value, a NaN counting as larger than any number
 * (the first NaN wins), as torch.argmax picks */
static int64_t row_argmax(const float *v, int64_t n)
{
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(v[i]))
            return i;
        if (v[i] > v[best])
            best = i;
    }
    return best;
}

int kt_decode_head_f32(kt_pool *pool, const kt_decode_head *H, const float *h, int64_t n, float *logits,
                       int64_t *argmax, float *scratch, int64_t scratch_floats)
{
    if (!pool || !h || !logits || !scratch || n < 1 || !head_ok(H))
        return KT_EINVAL;
    if (n > INT64_MAX / H->hidden || scratch_floats < n * H->hidden)      /* kt_decode_head_scratch_floats */
        return KT_EINVAL;
    int rc = kt_rmsnorm_f32(scratch, h, H->norm, n, H->hidden, 1, H->eps);
    if (rc == KT_OK)
        rc = kt_linear(pool, logits, scratch, n, H->lm_head, H->acts);
    if (rc != KT_OK)
        return rc;
    const int64_t vocab = H->lm_head->rows;
    for (int64_t t = 0; argmax && t < n; t++)
        argmax[t] = row_argmax(logits + t * vocab, vocab);
    return KT_OK;
}
