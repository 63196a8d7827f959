/* rope.c: rotary position embedding applied in place to float32 query/key heads.
 *
 * Row i holds `heads` vectors of `dim` floats; each is rotated by row i's tables:
 *   x[k] <- x[k] * cos[i, k] + partner(x)[k] * sin[i, k]
 * partner pairs element k with k + dim/2 (neox halves: partner(x)[k] = x[k + dim/2]
 * for k < dim/2, x[k - dim/2] after) or with its neighbour (interleaved pairs:
 * partner(x)[2p] = x[2p + 1], partner(x)[2p + 1] = x[2p]); sin carries the pair's
 * sign. Two products and a sum, each rounded to float (no FMA contraction under
 * -std=c11): the same bits as the layers' torch expression. */
#include <string.h>
#include "kt_internal.h"

#define ROPE_MAX_DIM 1024
/* below this many floats (a decode step's heads) waking the pool costs more than the work */
#define ROPE_INLINE_FLOATS 65536

typedef struct {
    float *x;
    int64_t row_stride;
    int32_t heads, dim, interleaved;
    const float *cos, *sin;
} rope_job;

static void partner_of(float *p, const float *v, int32_t dim, int32_t interleaved)
{
    if (interleaved) {
        for (int32_t k = 0; k < dim; k += 2) {
            p[k] = v[k + 1];
            p[k + 1] = v[k];
        }
        return;
    }
    int32_t half = dim / 2;
    memcpy(p, v + half, (size_t)half * sizeof(float));
    memcpy(p + half, v, (size_t)half * sizeof(float));
}

static void rotate(float *restrict v, const float *restrict partner, const float *restrict c,
                   const float *restrict s, int32_t dim)
{
    for (int32_t k = 0; k < dim; k++) {
        float a = v[k] * c[k], b = partner[k] * s[k];
        v[k] = a + b;
    }
}

static void rope_row(void *ctx, int64_t i, int thread)
{
    (void)thread;
    const rope_job *j = ctx;
    const float *c = j->cos + i * j->dim, *s = j->sin + i * j->dim;
    float partner[ROPE_MAX_DIM];
    for (int32_t h = 0; h < j->heads; h++) {
        float *v = j->x + i * j->row_stride + (int64_t)h * j->dim;
        partner_of(partner, v, j->dim, j->interleaved);
        rotate(v, partner, c, s, j->dim);
    }
}

int kt_rope_f32(kt_pool *pool, float *x, int64_t n, int64_t row_stride, int32_t heads, int32_t dim,
                const float *cos, const float *sin, int32_t interleaved)
{
    if (!pool || !x || !cos || !sin || n < 1 || heads < 1 || dim < 2 || dim % 2 || dim > ROPE_MAX_DIM
        || (interleaved != 0 && interleaved != 1) || row_stride < (int64_t)heads * dim
        || n > INT64_MAX / row_stride)
        return KT_EINVAL;
    rope_job j = {x, row_stride, heads, dim, interleaved, cos, sin};
    if (n * heads * dim <= ROPE_INLINE_FLOATS) {
        for (int64_t i = 0; i < n; i++)
            rope_row(&j, i, 0);
    } else {
        kt_pool_run(pool, rope_row, &j, n);
    }
    return KT_OK;
}
