/* moe.c: one MoE layer's routed experts, fused into one pool job per call.
 *
 *   out[t] = sum_k weights[t, k] * down_e( act(gate_e x_t) * up_e x_t ),  e = ids[t, k]
 *
 * Plan (on the calling thread, integer work only: O(T*K + n_experts))
 *   ids are checked, then the valid (token, k) pairs are counting-sorted by
 *   expert (stable, so pairs of one expert keep (t, k) order). Pair p has token
 *   pair_tok[p] and weight pair_w[p]; expert e owns pairs [offset_e, offset_e + n_e),
 *   cut into units of at most UNIT_TOKENS tokens. Doing this before the job is
 *   posted lets kt_moe_submit return KT_EINVAL for bad ids, size its scratch and
 *   the task list exactly; every float operation runs on the workers.
 *
 * Job: one task list, four ranges, in this order
 *   A  prep(unit)            gather x rows of the unit's tokens -> xg, kt_acts_prepare
 *   B  gate_up(expert, rows) for every unit of the expert: gate and up rows -> tmp (one
 *                            run of an interleaved gate_up, kt.h; else gate rows -> inter
 *                            and up rows -> tmp), inter = act(gate) * up
 *   C  prep_down(unit)       kt_acts_prepare on the unit's inter rows
 *   D  down(rows of H)       zero out[:, rows], then for every unit in expert order:
 *                            out[t, rows] += w_p * (down_e rows . inter_p)
 * A task waits (spin, then yield) only for tasks of earlier ranges. The pool
 * hands tasks out in increasing order, so the lowest unfinished task can always
 * run and the job cannot deadlock, whatever the number of threads.
 * Each D task owns a column range of `out`, so the reduction needs no atomics
 * and its order (expert ascending, then (t, k)) does not depend on timing.
 *
 * Asynchronous mode posts the same job with kt_pool_run_async; the last task
 * to finish clears the kt_moe's busy flag.
 *
 * Scratch (grown on demand, owned by the kt_moe), N = number of valid pairs:
 *   xg [N, H] f32, inter [N, I] f32, per-unit activation scratch, per-thread
 *   tmp [UNIT_TOKENS, 2 block] f32, and the plan arrays.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "kt_internal.h"
#include "simd_math.h"

#define UNIT_TOKENS 128
#define MAX_BLOCK 256       /* rows a task streams per matrix: longer runs than 64 rows were 2-10% faster
                              * (Qwen3-30B-A3B shape, T = 1 and 8, cold experts, 2-core Zen 3 guest) */
#define MIN_BLOCK 16
#define TASKS_PER_THREAD 8
#define SPINS_BEFORE_YIELD 2000

_Static_assert(MIN_BLOCK % KT_GATE_UP_CHUNK == 0, "a gate_up task starts on a chunk");

typedef struct moe_unit {
    int32_t expert;
    int32_t active;     /* index into the plan's active-expert list */
    int64_t p0;         /* first sorted pair */
    int64_t m;          /* tokens (pairs) in the unit */
} moe_unit;

typedef struct moe_plan {
    float *out;
    const float *x;
    int64_t T, N;
    int32_t n_active, n_units;
    int64_t rb_gu, nrb_gu, rb_dn, nrb_dn;   /* row blocks of gate/up (over I) and down (over H) */
    int64_t start_gu, start_dp, start_dn, n_tasks;
    int32_t *active;          /* [n_active] expert ids, ascending */
    int32_t *first_unit;      /* [n_active + 1] */
    int32_t *pair_tok;        /* [N] */
    float *pair_w;            /* [N] */
    moe_unit *units;          /* [n_units] */
    kt_acts *acts_gu, *acts_dn;             /* [n_units] */
    void **scr_gu, **scr_dn;                /* [n_units] */
    atomic_int *prep_left, *dprep_left;     /* [n_units]: 1 until the unit's acts are ready */
    atomic_int *gu_left;      /* [n_active]: gate_up tasks still running */
    atomic_llong done;
    atomic_int failed;
    float *xg, *inter;        /* [N, H], [N, I] */
    float *tmp;               /* [threads, tmp_stride] */
    int64_t tmp_stride;
    int amx_tiles;            /* kt_pool_amx_tiles of the pool this call runs on */
} moe_plan;

typedef struct grow_buf {
    void *p;
    size_t cap;
} grow_buf;

struct kt_moe {
    kt_moe_desc desc;
    int64_t *count;           /* [n_experts] */
    int64_t *cursor;          /* [n_experts] */
    atomic_int busy;
    moe_plan plan;
    grow_buf plan_mem, acts_mem;
};

/* ---- small helpers --------------------------------------------------------- */

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }
static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static int grow(grow_buf *b, size_t need)
{
    if (need <= b->cap)
        return KT_OK;
    size_t bytes = align64(need + need / 4);
    void *p = aligned_alloc(64, bytes);
    if (!p)
        return KT_ENOMEM;
    free(b->p);
    b->p = p;
    b->cap = bytes;
    return KT_OK;
}

/* Bump allocator run twice: with base == NULL it only measures. */
typedef struct carve {
    char *base;
    size_t used;
} carve;

static void *take(carve *c, size_t bytes)
{
    size_t at = align64(c->used);
    c->used = at + bytes;
    return c->base ? c->base + at : NULL;
}

static void wait_zero(atomic_int *flag)
{
    int spins = 0;
    while (atomic_load_explicit(flag, memory_order_acquire) != 0) {
        if (++spins < SPINS_BEFORE_YIELD) {
            cpu_relax();
        } else {
            sched_yield();
            spins = 0;
        }
    }
}

/* ---- activations ------------------------------------------------------------- */

/* gpt-oss: out <- min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, +-limit) + 1) */
static void act_swiglu_clamp(float *out, const float *g, const float *u, int64_t n, float limit, float alpha)
{
    for (int64_t i = 0; i < n; i++) {
        float gc = fminf(g[i], limit);
        float uc = fminf(fmaxf(u[i], -limit), limit);
        out[i] = gc / (1.0f + expf(-alpha * gc)) * (uc + 1.0f);
    }
}

/* out <- act(g) * u; out may be g */
static void activate(const kt_moe_desc *d, float *out, const float *g, const float *u, int64_t n)
{
    if (d->activation == KT_ACT_SWIGLU_CLAMP)
        act_swiglu_clamp(out, g, u, n, d->clamp_limit, d->alpha);
    else
        silu_mul_f32(out, g, u, n);
}

/* The matrix whose activations serve gate and up (one kt_acts for both, desc_ok) */
static const kt_matrix *gate_up_weight(const kt_moe_desc *d, int32_t e)
{
    return d->gate_up ? &d->gate_up[e] : &d->gate[e];
}

/* ---- the four task kinds --------------------------------------------------------- */

/* A failed prepare (not expected once the descriptor was checked) leaves m = 0,
 * so the row kernel computes nothing, and marks the call failed. */
static void prepare_or_flag(moe_plan *p, kt_acts *acts, const float *x, int64_t m,
                            const kt_matrix *w, void *scratch)
{
    if (kt_acts_prepare(acts, x, m, w, p->amx_tiles, kt_acts_expert_kind(w, m), scratch) != KT_OK) {
        memset(acts, 0, sizeof *acts);
        atomic_store_explicit(&p->failed, 1, memory_order_relaxed);
    }
}

static void prep_unit(kt_moe *moe, int64_t u)
{
    moe_plan *p = &moe->plan;
    const moe_unit *un = &p->units[u];
    int64_t H = moe->desc.hidden;
    float *dst = p->xg + un->p0 * H;
    for (int64_t i = 0; i < un->m; i++)
        memcpy(dst + i * H, p->x + (int64_t)p->pair_tok[un->p0 + i] * H, (size_t)H * sizeof(float));
    prepare_or_flag(p, &p->acts_gu[u], dst, un->m, gate_up_weight(&moe->desc, un->expert), p->scr_gu[u]);
    atomic_store_explicit(&p->prep_left[u], 0, memory_order_release);
}

/* Gate and up rows [r0, r1) of expert e for one unit's m tokens, from two matrices */
static void gate_up_split(const kt_moe_desc *d, float *inter, float *up, int32_t e, int64_t r0, int64_t r1,
                          const kt_acts *acts, int64_t m)
{
    int64_t nr = r1 - r0;
    kt_matrix_rows_f32(inter, d->inter, &d->gate[e], r0, r1, acts);
    kt_matrix_rows_f32(up, nr, &d->up[e], r0, r1, acts);
    for (int64_t i = 0; i < m; i++)
        activate(d, inter + i * d->inter, inter + i * d->inter, up + i * nr, nr);
}

/* The same from gate_up's rows [2 r0, 2 r1) (r0 a multiple of KT_GATE_UP_CHUNK), one run:
 * token i's gate values of chunk c are gu[i, 2c : 2c + n], its up values the next n. */
static void gate_up_fused(const kt_moe_desc *d, float *inter, float *gu, int32_t e, int64_t r0, int64_t r1,
                          const kt_acts *acts, int64_t m)
{
    int64_t nr = r1 - r0;
    kt_matrix_rows_f32(gu, 2 * nr, &d->gate_up[e], 2 * r0, 2 * r1, acts);
    for (int64_t i = 0; i < m; i++) {
        const float *row = gu + i * 2 * nr;
        for (int64_t c = 0; c < nr; c += KT_GATE_UP_CHUNK) {
            int64_t n = min64(KT_GATE_UP_CHUNK, nr - c);
            activate(d, inter + i * d->inter + c, row + 2 * c, row + 2 * c + n, n);
        }
    }
}

/* inter[p, r0:r1] = act(gate_e[r0:r1] . x_p) * (up_e[r0:r1] . x_p) for every pair p of the expert */
static void gate_up_block(kt_moe *moe, int64_t job, int thread)
{
    moe_plan *p = &moe->plan;
    const kt_moe_desc *d = &moe->desc;
    int64_t a = job / p->nrb_gu, r0 = (job % p->nrb_gu) * p->rb_gu;
    int64_t r1 = min64(r0 + p->rb_gu, d->inter);
    int32_t e = p->active[a];
    float *tmp = p->tmp + thread * p->tmp_stride;
    for (int32_t u = p->first_unit[a]; u < p->first_unit[a + 1]; u++) {
        const moe_unit *un = &p->units[u];
        wait_zero(&p->prep_left[u]);
        float *inter = p->inter + un->p0 * d->inter + r0;
        if (d->gate_up)
            gate_up_fused(d, inter, tmp, e, r0, r1, &p->acts_gu[u], un->m);
        else
            gate_up_split(d, inter, tmp, e, r0, r1, &p->acts_gu[u], un->m);
    }
    atomic_fetch_sub_explicit(&p->gu_left[a], 1, memory_order_acq_rel);
}

static void prep_down_unit(kt_moe *moe, int64_t u)
{
    moe_plan *p = &moe->plan;
    const moe_unit *un = &p->units[u];
    wait_zero(&p->gu_left[un->active]);
    prepare_or_flag(p, &p->acts_dn[u], p->inter + un->p0 * moe->desc.inter, un->m,
                    &moe->desc.down[un->expert], p->scr_dn[u]);
    atomic_store_explicit(&p->dprep_left[u], 0, memory_order_release);
}

/* out[:, h0:h1] = sum over units (expert order) of w_p * (down_e[h0:h1] . inter_p) */
static void down_block(kt_moe *moe, int64_t job, int thread)
{
    moe_plan *p = &moe->plan;
    int64_t H = moe->desc.hidden;
    int64_t h0 = job * p->rb_dn, h1 = min64(h0 + p->rb_dn, H), nr = h1 - h0;
    float *y = p->tmp + thread * p->tmp_stride;
    for (int64_t t = 0; t < p->T; t++)
        memset(p->out + t * H + h0, 0, (size_t)nr * sizeof(float));
    for (int32_t u = 0; u < p->n_units; u++) {
        const moe_unit *un = &p->units[u];
        wait_zero(&p->dprep_left[u]);
        kt_matrix_rows_f32(y, nr, &moe->desc.down[un->expert], h0, h1, &p->acts_dn[u]);
        for (int64_t i = 0; i < un->m; i++) {
            float w = p->pair_w[un->p0 + i];
            float *o = p->out + (int64_t)p->pair_tok[un->p0 + i] * H + h0;
            const float *yi = y + i * nr;
            for (int64_t j = 0; j < nr; j++)
                o[j] += w * yi[j];
        }
    }
}

static void moe_task(void *ctx, int64_t task, int thread)
{
    kt_moe *moe = ctx;
    moe_plan *p = &moe->plan;
    if (task < p->start_gu)
        prep_unit(moe, task);
    else if (task < p->start_dp)
        gate_up_block(moe, task - p->start_gu, thread);
    else if (task < p->start_dn)
        prep_down_unit(moe, task - p->start_dp);
    else
        down_block(moe, task - p->start_dn, thread);
    if (atomic_fetch_add_explicit(&p->done, 1, memory_order_acq_rel) + 1 == p->n_tasks)
        atomic_store_explicit(&moe->busy, 0, memory_order_release);
}

/* ---- planning (calling thread) -------------------------------------------------- */

/* Counts valid pairs per expert; -1 when an id is >= n_experts. */
static int64_t count_pairs(kt_moe *moe, const int32_t *ids, int64_t n)
{
    int32_t E = moe->desc.n_experts;
    memset(moe->count, 0, (size_t)E * sizeof(int64_t));
    int64_t valid = 0;
    for (int64_t s = 0; s < n; s++) {
        int32_t e = ids[s];
        if (e >= E)
            return -1;
        if (e >= 0) {
            moe->count[e]++;
            valid++;
        }
    }
    return valid;
}

/* Row block: as large as MAX_BLOCK while the job still has enough tasks to balance. */
static int64_t pick_block(int64_t rows, int64_t groups, int threads)
{
    int64_t rb = MAX_BLOCK;
    while (rb > MIN_BLOCK && groups * ceil_div(rows, rb) < (int64_t)TASKS_PER_THREAD * threads)
        rb /= 2;
    return rb;
}

static void size_plan(kt_moe *moe, moe_plan *p, int threads)
{
    const kt_moe_desc *d = &moe->desc;
    p->n_active = 0;
    p->n_units = 0;
    for (int32_t e = 0; e < d->n_experts; e++) {
        if (moe->count[e] > 0) {
            p->n_active++;
            p->n_units += (int32_t)ceil_div(moe->count[e], UNIT_TOKENS);
        }
    }
    p->rb_gu = pick_block(d->inter, p->n_active, threads);
    p->nrb_gu = ceil_div(d->inter, p->rb_gu);
    p->rb_dn = pick_block(d->hidden, 1, threads);
    p->nrb_dn = ceil_div(d->hidden, p->rb_dn);
    p->start_gu = p->n_units;
    p->start_dp = p->start_gu + p->n_active * p->nrb_gu;
    p->start_dn = p->start_dp + p->n_units;
    p->n_tasks = p->start_dn + p->nrb_dn;
    p->tmp_stride = (int64_t)align64(UNIT_TOKENS * 2 * MAX_BLOCK * sizeof(float)) / (int64_t)sizeof(float);
}

static void lay_out(moe_plan *p, carve *c, const kt_moe_desc *d, int threads)
{
    size_t nu = (size_t)p->n_units, na = (size_t)p->n_active, N = (size_t)p->N;
    p->active = take(c, na * sizeof(int32_t));
    p->first_unit = take(c, (na + 1) * sizeof(int32_t));
    p->pair_tok = take(c, N * sizeof(int32_t));
    p->pair_w = take(c, N * sizeof(float));
    p->units = take(c, nu * sizeof(moe_unit));
    p->acts_gu = take(c, nu * sizeof(kt_acts));
    p->acts_dn = take(c, nu * sizeof(kt_acts));
    p->scr_gu = take(c, nu * sizeof(void *));
    p->scr_dn = take(c, nu * sizeof(void *));
    p->prep_left = take(c, nu * sizeof(atomic_int));
    p->dprep_left = take(c, nu * sizeof(atomic_int));
    p->gu_left = take(c, na * sizeof(atomic_int));
    p->xg = take(c, N * (size_t)d->hidden * sizeof(float));
    p->inter = take(c, N * (size_t)d->inter * sizeof(float));
    p->tmp = take(c, (size_t)threads * (size_t)p->tmp_stride * sizeof(float));
}

/* Stable counting sort of the valid pairs by expert, then the units. */
static void fill_pairs(kt_moe *moe, moe_plan *p, const int32_t *ids, const float *weights, int64_t K)
{
    int32_t E = moe->desc.n_experts;
    int64_t at = 0;
    for (int32_t e = 0; e < E; e++) {
        moe->cursor[e] = at;
        at += moe->count[e];
    }
    for (int64_t s = 0; s < p->T * K; s++) {
        if (ids[s] < 0)
            continue;
        int64_t q = moe->cursor[ids[s]]++;
        p->pair_tok[q] = (int32_t)(s / K);
        p->pair_w[q] = weights[s];
    }
    int32_t a = 0, u = 0;
    int64_t p0 = 0;
    for (int32_t e = 0; e < E; p0 += moe->count[e], e++) {
        if (moe->count[e] == 0)
            continue;
        p->active[a] = e;
        p->first_unit[a] = u;
        atomic_init(&p->gu_left[a], (int)p->nrb_gu);
        for (int64_t c0 = 0; c0 < moe->count[e]; c0 += UNIT_TOKENS, u++) {
            p->units[u] = (moe_unit){e, a, p0 + c0, min64(UNIT_TOKENS, moe->count[e] - c0)};
            atomic_init(&p->prep_left[u], 1);
            atomic_init(&p->dprep_left[u], 1);
        }
        a++;
    }
    p->first_unit[a] = u;
}

static size_t unit_scratch_bytes(const kt_matrix *w, int64_t m, int amx_tiles)
{
    return kt_acts_scratch_bytes(w, m, amx_tiles, kt_acts_expert_kind(w, m));
}

static int assign_acts_scratch(kt_moe *moe, moe_plan *p)
{
    carve c = {NULL, 0};
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            if (grow(&moe->acts_mem, c.used + 64) != KT_OK)
                return KT_ENOMEM;
            c = (carve){moe->acts_mem.p, 0};
        }
        for (int32_t u = 0; u < p->n_units; u++) {
            const moe_unit *un = &p->units[u];
            void *g = take(&c, unit_scratch_bytes(gate_up_weight(&moe->desc, un->expert), un->m, p->amx_tiles));
            void *dn = take(&c, unit_scratch_bytes(&moe->desc.down[un->expert], un->m, p->amx_tiles));
            if (pass == 1) {
                p->scr_gu[u] = g;
                p->scr_dn[u] = dn;
            }
        }
    }
    return KT_OK;
}

static int plan_call(kt_moe *moe, const kt_pool *pool, float *out, const float *x,
                     const int32_t *ids, const float *weights, int64_t T, int64_t K)
{
    moe_plan *p = &moe->plan;
    int threads = kt_pool_threads(pool);
    p->amx_tiles = kt_pool_amx_tiles(pool);
    int64_t valid = count_pairs(moe, ids, T * K);
    if (valid < 0)
        return KT_EINVAL;
    p->out = out;
    p->x = x;
    p->T = T;
    p->N = valid;
    size_plan(moe, p, threads);
    carve c = {NULL, 0};
    lay_out(p, &c, &moe->desc, threads);
    if (grow(&moe->plan_mem, c.used + 64) != KT_OK)
        return KT_ENOMEM;
    c = (carve){moe->plan_mem.p, 0};
    lay_out(p, &c, &moe->desc, threads);
    fill_pairs(moe, p, ids, weights, K);
    atomic_init(&p->done, 0);
    atomic_init(&p->failed, 0);
    return assign_acts_scratch(moe, p);
}

/* ---- public API ------------------------------------------------------------------ */

static int check_matrix(const kt_matrix *w, int64_t rows, int64_t cols)
{
    return kt_matrix_check(w) == KT_OK && w->rows == rows && w->cols == cols;
}

static int experts_ok(const kt_moe_desc *d)
{
    for (int32_t e = 0; e < d->n_experts; e++) {
        if (!check_matrix(&d->down[e], d->hidden, d->inter))
            return 0;
        if (d->gate_up) {
            if (!check_matrix(&d->gate_up[e], 2 * d->inter, d->hidden))
                return 0;
            continue;
        }
        const kt_matrix *g = &d->gate[e], *u = &d->up[e];
        if (!check_matrix(g, d->inter, d->hidden) || !check_matrix(u, d->inter, d->hidden))
            return 0;
        if (g->format != u->format || g->group != u->group)   /* one kt_acts serves both */
            return 0;
    }
    return 1;
}

static int desc_ok(const kt_moe_desc *d)
{
    if (!d || d->n_experts <= 0 || d->hidden <= 0 || d->inter <= 0 || !d->down)
        return 0;
    if (!d->gate_up && (!d->gate || !d->up))
        return 0;
    if (d->hidden > INT32_MAX || d->inter > INT32_MAX / 2)
        return 0;
    if (d->activation == KT_ACT_SWIGLU_CLAMP) {
        if (!(d->clamp_limit > 0.0f) || !isfinite(d->clamp_limit) || !isfinite(d->alpha))
            return 0;
    } else if (d->activation != KT_ACT_SILU) {
        return 0;
    }
    return experts_ok(d);
}

kt_moe *kt_moe_new(const kt_moe_desc *desc)
{
    if (!desc_ok(desc))
        return NULL;
    kt_moe *moe = calloc(1, sizeof *moe);
    if (!moe)
        return NULL;
    moe->desc = *desc;
    moe->count = calloc((size_t)desc->n_experts, sizeof(int64_t));
    moe->cursor = calloc((size_t)desc->n_experts, sizeof(int64_t));
    atomic_init(&moe->busy, 0);
    if (!moe->count || !moe->cursor) {
        kt_moe_free(moe);
        return NULL;
    }
    return moe;
}

void kt_moe_free(kt_moe *moe)
{
    if (!moe)
        return;
    free(moe->count);
    free(moe->cursor);
    free(moe->plan_mem.p);
    free(moe->acts_mem.p);
    free(moe);
}

static int args_ok(kt_pool *pool, kt_moe *moe, float *out, const float *x,
                   const int32_t *ids, const float *weights, int64_t T, int64_t K)
{
    if (!pool || !moe || T < 0 || K < 0 || T > INT32_MAX || K > 4096)
        return 0;
    return T == 0 || (out && x && (K == 0 || (ids && weights)));
}

/* Claims the kt_moe, plans the call and posts the job (async or not). */
static int launch(kt_pool *pool, kt_moe *moe, float *out, const float *x, const int32_t *ids,
                  const float *weights, int64_t T, int64_t K, int async)
{
    if (!args_ok(pool, moe, out, x, ids, weights, T, K))
        return KT_EINVAL;
    int idle = 0;
    if (!atomic_compare_exchange_strong(&moe->busy, &idle, 1))
        return KT_EBUSY;
    int rc = plan_call(moe, pool, out, x, ids, weights, T, K);
    if (rc == KT_OK && async)
        rc = kt_pool_run_async(pool, moe_task, moe, moe->plan.n_tasks);
    else if (rc == KT_OK)
        kt_pool_run(pool, moe_task, moe, moe->plan.n_tasks);
    if (rc != KT_OK)
        atomic_store(&moe->busy, 0);
    else if (!async && atomic_load(&moe->plan.failed))
        rc = KT_EINVAL;
    return rc;
}

int kt_moe_forward(kt_pool *pool, kt_moe *moe, float *out, const float *x,
                   const int32_t *ids, const float *weights, int64_t T, int64_t K)
{
    return launch(pool, moe, out, x, ids, weights, T, K, 0);
}

int kt_moe_submit(kt_pool *pool, kt_moe *moe, float *out, const float *x,
                  const int32_t *ids, const float *weights, int64_t T, int64_t K)
{
    return launch(pool, moe, out, x, ids, weights, T, K, 1);
}

void kt_moe_dims(const kt_moe *moe, int64_t *hidden, int32_t *n_experts)
{
    *hidden = moe->desc.hidden;
    *n_experts = moe->desc.n_experts;
}

int kt_moe_sync(kt_pool *pool)
{
    return kt_pool_wait(pool);
}
