/* linear.c: out (m, rows) = x (m, cols) @ W^T for every kt-q1 format.
 *
 * kt_matrix_rows_f32 is the single-threaded core shared with the MoE operator:
 * "these rows of W times these prepared tokens". It walks W in row blocks that
 * stay in L2; inside a block, token tiles of up to 4 are the middle loop and
 * rows the inner one, so in decode (m <= 4: one token tile) every weight row is
 * streamed from memory exactly once, and in prefill each weight vector loaded is
 * reused by 4 tokens (the tiles in simd_float.h / simd_int.h) while the block is
 * re-read from cache, not memory, by the next token tile.
 *
 * kt_linear_f32 prepares the activations once, then splits the rows across the
 * pool in tasks of ROWS_PER_TASK.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdlib.h>
#include "kt_internal.h"
#include "simd_float.h"
#include "simd_int.h"

#define TOKEN_TILE 4
#define BLOCK_BYTES (128 * 1024)
#define ROWS_PER_TASK 16
#define MAX_ELEMENTS (INT64_C(1) << 52)

/* ---- descriptor check --------------------------------------------------------- */

static int quantized(int32_t format)
{
    return format == KT_I8 || format == KT_I4;
}

int kt_matrix_check(const kt_matrix *w)
{
    if (!w || !w->data || w->rows < 1 || w->cols < 1)
        return KT_EINVAL;
    if (w->format < KT_F32 || w->format > KT_I4)
        return KT_EINVAL;
    if (w->cols > MAX_ELEMENTS / w->rows)
        return KT_EINVAL;
    if (!quantized(w->format))
        return KT_OK;
    int32_t block = w->format == KT_I4 ? 32 : 16;
    if (!w->scale || w->group < block || w->group % block != 0 || w->cols % w->group != 0)
        return KT_EINVAL;
    return KT_OK;
}

static int64_t row_bytes(const kt_matrix *w)
{
    switch (w->format) {
    case KT_F32: return w->cols * 4;
    case KT_BF16: case KT_F16: return w->cols * 2;
    case KT_I8: return w->cols;
    default: return w->cols / 2;
    }
}

/* ---- float formats -------------------------------------------------------------- */

#define FLOAT_TILE(RT, TT) float_tile(o, ldo, rowp, RT, x, w->cols, TT, fmt)
#define BF16_DP_TILE(RT, TT) bf16_tile_dp(o, ldo, rowp, RT, xb, x, w->cols, TT)
#define SWITCH_TT(TILE, RT, tt)                                               \
    switch (tt) {                                                             \
    case 1: TILE(RT, 1); break;                                               \
    case 2: TILE(RT, 2); break;                                               \
    case 3: TILE(RT, 3); break;                                               \
    default: TILE(RT, 4); break;                                              \
    }

KT_INLINE void float_block(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t b0,
                           int64_t b1, const kt_acts *a, const int32_t fmt)
{
    int64_t rb = row_bytes(w);
    for (int64_t t0 = 0; t0 < a->m; t0 += TOKEN_TILE) {
        int tt = a->m - t0 < TOKEN_TILE ? (int)(a->m - t0) : TOKEN_TILE;
        const float *x = a->f32 + t0 * w->cols;
#if defined(__AVX512BF16__)
        const uint16_t *xb = a->bf16 ? a->bf16 + t0 * w->cols : NULL;
#endif
        for (int64_t r = b0; r < b1; r += 2) {
            int rt = b1 - r >= 2 ? 2 : 1;
            const void *rowp[2] = {(const char *)w->data + r * rb,
                                   (const char *)w->data + (r + rt - 1) * rb};
            float *o = out + t0 * ldo + (r - r0);
#if defined(__AVX512BF16__)
            if (fmt == KT_BF16 && xb) {
                if (rt == 2) { SWITCH_TT(BF16_DP_TILE, 2, tt) } else { SWITCH_TT(BF16_DP_TILE, 1, tt) }
                continue;
            }
#endif
            if (rt == 2) { SWITCH_TT(FLOAT_TILE, 2, tt) } else { SWITCH_TT(FLOAT_TILE, 1, tt) }
        }
    }
}

static void float_block_f32(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                            int64_t b1, const kt_acts *a) { float_block(o, l, w, r0, b0, b1, a, KT_F32); }
static void float_block_bf16(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                             int64_t b1, const kt_acts *a) { float_block(o, l, w, r0, b0, b1, a, KT_BF16); }
static void float_block_f16(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                            int64_t b1, const kt_acts *a) { float_block(o, l, w, r0, b0, b1, a, KT_F16); }

/* ---- integer formats ------------------------------------------------------------ */

#define INT_TILE(RT, TT) int_tile(o, ldo, w, r, a, t0, TT, fmt, asym)

KT_INLINE void int_block(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t b0,
                         int64_t b1, const kt_acts *a, const int32_t fmt, const int asym)
{
    for (int64_t t0 = 0; t0 < a->m; t0 += TOKEN_TILE) {
        int tt = a->m - t0 < TOKEN_TILE ? (int)(a->m - t0) : TOKEN_TILE;
        for (int64_t r = b0; r < b1; r++) {
            float *o = out + t0 * ldo + (r - r0);
            SWITCH_TT(INT_TILE, 1, tt)
        }
    }
}

static void int_block_i8(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                         int64_t b1, const kt_acts *a) { int_block(o, l, w, r0, b0, b1, a, KT_I8, 0); }
static void int_block_i8_asym(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                              int64_t b1, const kt_acts *a) { int_block(o, l, w, r0, b0, b1, a, KT_I8, 1); }
static void int_block_i4(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                         int64_t b1, const kt_acts *a) { int_block(o, l, w, r0, b0, b1, a, KT_I4, 0); }
static void int_block_i4_asym(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                              int64_t b1, const kt_acts *a) { int_block(o, l, w, r0, b0, b1, a, KT_I4, 1); }

/* ---- the shared rows kernel -------------------------------------------------------- */

typedef void (*block_fn)(float *, int64_t, const kt_matrix *, int64_t, int64_t, int64_t, const kt_acts *);

static block_fn pick_block(const kt_matrix *w)
{
    switch (w->format) {
    case KT_F32: return float_block_f32;
    case KT_BF16: return float_block_bf16;
    case KT_F16: return float_block_f16;
    case KT_I8: return w->min ? int_block_i8_asym : int_block_i8;
    default: return w->min ? int_block_i4_asym : int_block_i4;
    }
}

void kt_matrix_rows_f32(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                        const kt_acts *acts)
{
    block_fn block = pick_block(w);
    int64_t rows_per_block = BLOCK_BYTES / row_bytes(w);
    rows_per_block = rows_per_block < 2 ? 2 : rows_per_block & ~(int64_t)1;
    for (int64_t b0 = r0; b0 < r1; b0 += rows_per_block) {
        int64_t b1 = r1 - b0 < rows_per_block ? r1 : b0 + rows_per_block;
        block(out, ldo, w, r0, b0, b1, acts);
    }
}

/* ---- dense linear over the pool ------------------------------------------------------ */

struct linear_job {
    float *out;
    const kt_matrix *w;
    const kt_acts *acts;
};

static void linear_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    const struct linear_job *job = ctx;
    int64_t r0 = task * ROWS_PER_TASK;
    int64_t r1 = r0 + ROWS_PER_TASK < job->w->rows ? r0 + ROWS_PER_TASK : job->w->rows;
    kt_matrix_rows_f32(job->out + r0, job->w->rows, job->w, r0, r1, job->acts);
}

int kt_linear_f32(kt_pool *pool, float *out, const float *x, int64_t m, const kt_matrix *w)
{
    if (!out || !x || m < 1 || kt_matrix_check(w) != KT_OK)
        return KT_EINVAL;
    size_t bytes = kt_acts_scratch_bytes(w, m);
    void *scratch = NULL;
    if (bytes > 0 && posix_memalign(&scratch, 64, bytes) != 0)
        return KT_ENOMEM;
    kt_acts acts;
    int rc = kt_acts_prepare(&acts, x, m, w, scratch);
    if (rc == KT_OK) {
        struct linear_job job = {out, w, &acts};
        int64_t n_tasks = (w->rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
        if (pool) {
            kt_pool_run(pool, linear_task, &job, n_tasks);
        } else {
            for (int64_t t = 0; t < n_tasks; t++)
                linear_task(&job, t, 0);
        }
    }
    free(scratch);
    return rc;
}
