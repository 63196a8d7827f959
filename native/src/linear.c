/* linear.c: out (m, rows) = x (m, cols) @ W^T for every kt-q1 format.
 *
 * kt_matrix_rows_f32 is the single-threaded core shared with the MoE operator:
 * "these rows of W times these prepared tokens". It walks W in row blocks that
 * stay in L2; inside a block, token tiles of up to 4 are the middle loop and
 * rows the inner one, so in decode (m <= 4: one token tile) every weight row is
 * streamed from memory exactly once, and in prefill each weight vector loaded is
 * reused by 4 tokens (the tiles in simd_float.h / simd_int.h) while the block is
 * re-read from cache, not memory, by the next token tile. The integer tiles
 * also share each token vector across INT_ROWS weight rows; their activations
 * are int8 with one scale per 32 values (kt_acts, quant.c).
 *
 * kt_linear prepares the activations once (into per-thread scratch that is
 * kept between calls), then splits the rows across the pool (rows_per_task).
 * With KT_ACTS_F32 the integer formats take float activations instead and are
 * dequantized in registers (simd_dequant.h).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdlib.h>
#include "kt_internal.h"
#include "simd_float.h"
#include "simd_int.h"
#include "simd_amx.h"
#include "simd_amx_row8.h"
#include "simd_dequant.h"

#define TOKEN_TILE 4
#define BLOCK_BYTES (128 * 1024)
#define TASKS_PER_THREAD 4
#define MIN_TASK_BYTES (32 * 1024)
#define MAX_TASK_BYTES (64 * 1024 * 1024)
#define MAX_ELEMENTS (INT64_C(1) << 52)

/* ---- descriptor check --------------------------------------------------------- */

int kt_matrix_check(const kt_matrix *w)
{
    if (!w || !w->data || w->rows < 1 || w->cols < 1)
        return KT_EINVAL;
    if (w->format < KT_F32 || w->format > KT_I6)
        return KT_EINVAL;
    if (w->cols > MAX_ELEMENTS / w->rows)
        return KT_EINVAL;
    if (w->layout != KT_LAYOUT_ROWS && w->layout != KT_LAYOUT_TILES && w->layout != KT_LAYOUT_ROW8)
        return KT_EINVAL;
    if (w->scale_type != KT_SCALE_F32 && !((w->scale_type == KT_SCALE_F16 || kt_two_level(w->scale_type))
                                           && w->layout == KT_LAYOUT_ROW8))
        return KT_EINVAL;
    if (!kt_int_format(w->format))
        return w->layout == KT_LAYOUT_ROWS ? KT_OK : KT_EINVAL;
    int32_t block = w->format == KT_I4 ? 32 : 16;
    if (!w->scale || w->group < block || w->group % block != 0 || w->cols % w->group != 0)
        return KT_EINVAL;
    if (w->format == KT_I6 && (w->layout != KT_LAYOUT_ROW8 || (w->group != 16 && w->group % 32 != 0)))
        return KT_EINVAL;
    if (w->layout == KT_LAYOUT_TILES && (w->rows % KT_TILE_ROWS != 0 || kt_row_bytes(w) % KT_TILE_CHUNK != 0))
        return KT_EINVAL;
    if (w->layout == KT_LAYOUT_ROW8 && (w->rows % KT_ROW8_ROWS != 0 || w->cols % 64 != 0
                                        || (w->format != KT_I6 && w->group % 32 != 0)))
        return KT_EINVAL;
    if (kt_two_level(w->scale_type) && (!w->scale_base || !w->min != !w->min_base
                                        || (w->cols / w->group) % KT_SCALE_K_GROUPS != 0))
        return KT_EINVAL;
    return KT_OK;
}

/* ---- float formats -------------------------------------------------------------- */

/* Rows [b0, b1) for the token tile at t0 (tt tokens): tiles of `rows` (4 or 2;
 * 1 means single rows only) while they fit, then single rows. */
#define ROW_TILES(TILE, rows, tt)                                             \
    int64_t r = b0;                                                           \
    for (; (rows) > 1 && r + (rows) <= b1; r += (rows)) {                     \
        float *o = out + t0 * ldo + (r - r0);                                 \
        if ((rows) == 4) { SWITCH_TT(TILE, 4, tt) } else { SWITCH_TT(TILE, 2, tt) } \
    }                                                                         \
    for (; r < b1; r++) {                                                     \
        float *o = out + t0 * ldo + (r - r0);                                 \
        SWITCH_TT(TILE, 1, tt)                                                \
    }

#define PREFETCH_AT(r) tile_prefetch(t0 / TOKEN_TILE, n_tiles, r, b0, b1, rb, w->rows, (b1 - b0 < 4 ? b1 - b0 : 4) * rb)
#define FLOAT_TILE(RT, TT) float_tile(o, ldo, (const char *)w->data + r * rb, rb, RT, x, w->cols, TT, fmt, PREFETCH_AT(r))
#define BF16_DP_TILE(RT, TT) bf16_tile_dp(o, ldo, (const char *)w->data + r * rb, rb, RT, xb, x, w->cols, TT, PREFETCH_AT(r))
#define SWITCH_TT(TILE, RT, tt)                                               \
    switch (tt) {                                                             \
    case 1: TILE(RT, 1); break;                                               \
    case 2: TILE(RT, 2); break;                                               \
    case 3: TILE(RT, 3); break;                                               \
    default: TILE(RT, 4); break;                                              \
    }

/* Software prefetch of a block's rows (kt_tile_prefetch). The first token tile
 * streams the block from memory: it asks for the lines stream_ahead bytes on
 * (the next row tile's; the tiled integer layout, a few chunks of its own run).
 * The later token tiles find the block in L2 and are compute-bound: they fetch
 * the next block meanwhile, every row tile the same rows one block on, a 64-byte
 * step in (later tiles) each, so each line is asked for once and the requests
 * are spread evenly. Streaming BF16 blocks of 32 rows x 8 token tiles on Zen 4:
 * 0.70 -> 0.85 vdpbf16ps a cycle (0.92 from L2); MoE layer BF16 T=512 1.18x,
 * I8 1.06x. */
KT_INLINE kt_tile_prefetch tile_prefetch(int64_t tile, int64_t n_tiles, int64_t r, int64_t b0, int64_t b1,
                                         int64_t rb, int64_t n_rows, int64_t stream_ahead)
{
    kt_tile_prefetch none = {0, 1, 0};
    if (tile == 0)
        return (kt_tile_prefetch){stream_ahead, 1, 0};
    if (r + (b1 - b0) >= n_rows)
        return none;
    return (kt_tile_prefetch){(b1 - b0) * rb, n_tiles - 1, tile - 1};
}

KT_INLINE void float_block(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t b0,
                           int64_t b1, const kt_acts *a, const int32_t fmt)
{
    const int64_t rb = kt_row_bytes(w);
    const int64_t n_tiles = (a->m + TOKEN_TILE - 1) / TOKEN_TILE;
    for (int64_t t0 = 0; t0 < a->m; t0 += TOKEN_TILE) {
        int tt = a->m - t0 < TOKEN_TILE ? (int)(a->m - t0) : TOKEN_TILE;
        const float *x = a->f32 + t0 * w->cols;
        /* decode (one token): 4 rows a tile, four independent FMA chains */
        const int rows = a->m == 1 ? 4 : 2;
#if defined(__AVX512BF16__)
        const uint16_t *xb = a->bf16 ? a->bf16 + t0 * w->cols : NULL;
        /* BF16 decode one row at a time, so that a task's rows stream as one run: tiles of 4 rows
         * read 4 runs a row apart, and one MoE layer's BF16 decode ran 1.24-1.36x slower (Zen 4) */
        if (fmt == KT_BF16 && xb) {
            ROW_TILES(BF16_DP_TILE, a->m == 1 ? 1 : 4, tt)
            continue;
        }
#endif
        ROW_TILES(FLOAT_TILE, rows, tt)
    }
}

static void float_block_f32(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                            int64_t b1, const kt_acts *a) { float_block(o, l, w, r0, b0, b1, a, KT_F32); }
static void float_block_bf16(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                             int64_t b1, const kt_acts *a) { float_block(o, l, w, r0, b0, b1, a, KT_BF16); }
static void float_block_f16(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                            int64_t b1, const kt_acts *a) { float_block(o, l, w, r0, b0, b1, a, KT_F16); }

/* ---- integer formats ------------------------------------------------------------ */

/* Register tile of the integer kernels: INT_ROWS weight rows x INT_TOKENS tokens
 * of float accumulators, each token vector shared by the rows and each weight
 * vector by the tokens. AVX2 has 16 vector registers: I4 4 x 2, I8 (which also
 * keeps the weights' magnitudes) 2 x 4 fitted without spills with per-token
 * activation scales (measured on Zen 3); AVX-512 has 32: 4 x 4. With per-block
 * scales I8 adds a group accumulator per tile entry (simd_int.h i8_groups), which
 * the compiler may keep in L1 across a group's blocks; the shapes were not re-tuned
 * (A/B on a 2-core AVX2 host: prefill as fast or faster, bench/linear.py --baseline). */
#if defined(__AVX512F__)
#define INT_ROWS(fmt) 4
#define INT_TOKENS(fmt) 4
#else
#define INT_ROWS(fmt) ((fmt) == KT_I4 ? 4 : 2)
#define INT_TOKENS(fmt) ((fmt) == KT_I4 ? 2 : 4)
#endif

/* streaming: tiled, KT_PREFETCH_CHUNKS chunks of the tile's run ahead; rows, the next row tile */
#define INT_TILE(RT, TT)                                                                          \
    int_tile(o, ldo, w, r, RT, a, t0, TT, fmt, asym, tiled,                                       \
             tile_prefetch(t0 / tokens, n_tiles, r, b0, b1, kt_row_bytes(w), w->rows,            \
                           tiled ? KT_PREFETCH_CHUNKS * KT_TILE_CHUNK * KT_TILE_ROWS : (RT) * kt_row_bytes(w)))

/* tiled: w's layout as a constant, so the tiles' address arithmetic folds */
KT_INLINE void int_block_in(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t b0,
                            int64_t b1, const kt_acts *a, const int32_t fmt, const int asym, const int tiled)
{
    const int tokens = INT_TOKENS(fmt);
    const int64_t n_tiles = (a->m + tokens - 1) / tokens;
    for (int64_t t0 = 0; t0 < a->m; t0 += tokens) {
        int tt = a->m - t0 < tokens ? (int)(a->m - t0) : tokens;
        /* 1-2 tokens: 4 rows, a whole row tile of the tiled layout (kt.h); AVX2 I8
         * with 2 tokens ran 1.3x faster so (spilled accumulators and all) */
        const int rows = tt <= 2 ? 4 : INT_ROWS(fmt);
        ROW_TILES(INT_TILE, rows, tt)
    }
}

KT_INLINE void int_block(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t b0,
                         int64_t b1, const kt_acts *a, const int32_t fmt, const int asym)
{
    if (w->layout == KT_LAYOUT_TILES)
        int_block_in(out, ldo, w, r0, b0, b1, a, fmt, asym, 1);
    else
        int_block_in(out, ldo, w, r0, b0, b1, a, fmt, asym, 0);
}

static void int_block_i8(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                         int64_t b1, const kt_acts *a) { int_block(o, l, w, r0, b0, b1, a, KT_I8, 0); }
static void int_block_i8_asym(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                              int64_t b1, const kt_acts *a) { int_block(o, l, w, r0, b0, b1, a, KT_I8, 1); }
static void int_block_i4(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                         int64_t b1, const kt_acts *a) { int_block(o, l, w, r0, b0, b1, a, KT_I4, 0); }
static void int_block_i4_asym(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                              int64_t b1, const kt_acts *a) { int_block(o, l, w, r0, b0, b1, a, KT_I4, 1); }

/* ---- integer formats against float activations (exact path) ------------------------ */

/* Rows per dequantizing tile: under AVX2 (16 registers) 4 rows for one token,
 * giving decode four independent FMA chains, and 2 rows for token tiles of 2-4;
 * AVX-512 (32 registers) 4 x 4. */
#if defined(__AVX512F__)
#define DQ_ROWS(tt) 4
#elif defined(__AVX2__)
#define DQ_ROWS(tt) ((tt) == 1 ? 4 : 2)
#else
#define DQ_ROWS(tt) 1
#endif

#define DQ_TILE(RT, TT) dq_tile(o, ldo, w, r, RT, x, TT, fmt, asym)

KT_INLINE void dq_block(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t b0,
                        int64_t b1, const kt_acts *a, const int32_t fmt, const int asym)
{
    for (int64_t t0 = 0; t0 < a->m; t0 += TOKEN_TILE) {
        int tt = a->m - t0 < TOKEN_TILE ? (int)(a->m - t0) : TOKEN_TILE;
        const float *x = a->f32 + t0 * w->cols;
        const int rows = DQ_ROWS(tt);
        ROW_TILES(DQ_TILE, rows, tt)
    }
}

static void dq_block_i8(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                        int64_t b1, const kt_acts *a) { dq_block(o, l, w, r0, b0, b1, a, KT_I8, 0); }
static void dq_block_i8_asym(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                             int64_t b1, const kt_acts *a) { dq_block(o, l, w, r0, b0, b1, a, KT_I8, 1); }
static void dq_block_i4(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                        int64_t b1, const kt_acts *a) { dq_block(o, l, w, r0, b0, b1, a, KT_I4, 0); }
static void dq_block_i4_asym(float *o, int64_t l, const kt_matrix *w, int64_t r0, int64_t b0,
                             int64_t b1, const kt_acts *a) { dq_block(o, l, w, r0, b0, b1, a, KT_I4, 1); }

/* ---- the shared rows kernel -------------------------------------------------------- */

typedef void (*block_fn)(float *, int64_t, const kt_matrix *, int64_t, int64_t, int64_t, const kt_acts *);

static block_fn pick_block(const kt_matrix *w, const kt_acts *acts)
{
    if (acts->float_acts && w->format == KT_I8)
        return w->min ? dq_block_i8_asym : dq_block_i8;
    if (acts->float_acts && w->format == KT_I4)
        return w->min ? dq_block_i4_asym : dq_block_i4;
    switch (w->format) {
    case KT_F32: return float_block_f32;
    case KT_BF16: return float_block_bf16;
    case KT_F16: return float_block_f16;
    case KT_I8: return w->min ? int_block_i8_asym : int_block_i8;
    default: return w->min ? int_block_i4_asym : int_block_i4;
    }
}

/* Rows [from, r1) in L2-sized blocks; out column 0 is row r0. */
static void rows_by_blocks(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t from,
                           int64_t r1, const kt_acts *acts)
{
    block_fn block = pick_block(w, acts);
    int64_t rows_per_block = BLOCK_BYTES / kt_row_bytes(w);
    rows_per_block = rows_per_block < 4 ? 4 : rows_per_block & ~(int64_t)3;
    for (int64_t b0 = from; b0 < r1; b0 += rows_per_block) {
        int64_t b1 = r1 - b0 < rows_per_block ? r1 : b0 + rows_per_block;
        block(out, ldo, w, r0, b0, b1, acts);
    }
}

void kt_matrix_rows_f32(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                        const kt_acts *acts)
{
    if (w->layout == KT_LAYOUT_ROW8) {
        int64_t from = r0;
#if defined(KT_HAVE_AMX)
        /* full 16-row blocks on the BF16 tiles when the tokens were laid out for them */
        if (acts->amx_bf16 && r1 - r0 >= AMX_ROWS) {
            int64_t to = r0 + (r1 - r0) / AMX_ROWS * AMX_ROWS;
            if (amx_row8_rows(out, ldo, w, r0, r0, to, acts) == KT_OK)
                from = to;
        }
#endif
        if (from < r1)
            kt_row8_rows_f32(out + (from - r0), ldo, w, from, r1, acts);
        return;
    }
    if (acts->xt) {
        if (kt_gemm_rows(out, ldo, w, r0, r1, acts) == KT_OK)
            return;
        /* no memory for the GEMM's panel: the float32 tiles need only x */
        kt_acts exact = *acts;
        exact.float_acts = 1;
        exact.xt = NULL;
        rows_by_blocks(out, ldo, w, r0, r0, r1, &exact);
        return;
    }
    if (acts->bf16_pairs) {
        kt_bf16_gemm_rows(out, ldo, w, r0, r1, acts);
        return;
    }
    int64_t from = r0;
#if defined(KT_HAVE_AMX)
    /* full 16-row blocks on the AMX tiles when the tokens were laid out for them */
    int amx = (w->format == KT_BF16 && acts->amx_bf16) || (w->format == KT_I8 && acts->amx_q);
    if (amx && r1 - r0 >= AMX_ROWS) {
        from = r0 + (r1 - r0) / AMX_ROWS * AMX_ROWS;
        amx_rows(out, ldo, w, r0, r0, from, acts);
    }
#endif
    rows_by_blocks(out, ldo, w, r0, from, r1, acts);
}

/* ---- dense linear over the pool ------------------------------------------------------ */

struct linear_job {
    float *out;
    const kt_matrix *w;
    const kt_acts *acts;
    int64_t rows_per_task;
};

static void linear_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    const struct linear_job *job = ctx;
    int64_t r0 = task * job->rows_per_task;
    int64_t r1 = r0 + job->rows_per_task < job->w->rows ? r0 + job->rows_per_task : job->w->rows;
    kt_matrix_rows_f32(job->out + r0, job->w->rows, job->w, r0, r1, job->acts);
}

/* About TASKS_PER_THREAD tasks per thread, so a thread delayed by the OS costs
 * little, but each worth at least MIN_TASK_BYTES of weight-times-token work, so
 * claiming a task (one atomic on a shared line) stays cheap beside it, and at most
 * MAX_TASK_BYTES (~2 ms on a Zen 3 core), so the core that ends first waits for at
 * most one short task: in prefill, 4 tasks a thread were 15 ms each for a 4096 x 2048
 * projection at 512 tokens, and one core sat idle ~3% of the step; a
 * multiple of 12 rows: whole row tiles of the integer kernels (4) and of the
 * GEMM (6 or 12); of 24 for the BF16 pair GEMM (8) and ROW8, whose row groups are 8, and of 48 where its
 * 16-row form runs (I8, and INT4 from 3 tokens: simd_row8_pair.h), whose row
 * groups go in pairs, or where the AMX tiles (16 rows) take the rows. */
static int64_t rows_per_task(const kt_matrix *w, const kt_acts *acts, int64_t m, int threads)
{
    int64_t balanced = (w->rows + (int64_t)TASKS_PER_THREAD * threads - 1) / ((int64_t)TASKS_PER_THREAD * threads);
    int64_t work = kt_row_bytes(w) * m;
    int64_t least = (MIN_TASK_BYTES + work - 1) / work;
    int64_t most = MAX_TASK_BYTES / work;
    int64_t rows = balanced < most ? balanced : most;
    rows = rows > least ? rows : least;
    int amx = acts->amx_q || acts->amx_bf16;
    int64_t unit = amx ? 48 : acts->bf16_pairs ? 24 : w->layout != KT_LAYOUT_ROW8 ? 12
                 : w->format == KT_I8 || m >= 3 ? 48 : 24;
    return (rows + unit - 1) / unit * unit;
}

/* Activations as the kernels want them, in the calling thread's scratch:
 * quantized (KT_ACTS_INT8, KT_ACTS_INT16) or float32 (KT_ACTS_F32), or the GEMM's tiles. */
static int prepare(kt_acts *acts, kt_pool *pool, const float *x, int64_t m, const kt_matrix *w,
                   int32_t kind)
{
    int amx_tiles = kind == KT_ACTS_INT8 || kind == KT_ACTS_BF16 ? kt_pool_amx_tiles(pool) : 0;
    size_t bytes = kt_acts_scratch_bytes(w, m, amx_tiles, kind);
    void *scratch = bytes > 0 ? kt_thread_buffer(KT_BUF_ACTS, bytes) : NULL;
    if (bytes > 0 && !scratch)
        return KT_ENOMEM;
    return kt_acts_prepare(acts, x, m, w, amx_tiles, kind, scratch);
}

int kt_linear_f32(kt_pool *pool, float *out, const float *x, int64_t m, const kt_matrix *w)
{
    return kt_linear(pool, out, x, m, w, KT_ACTS_INT8);
}

int kt_linear(kt_pool *pool, float *out, const float *x, int64_t m, const kt_matrix *w, int32_t acts_kind)
{
    if (!out || !x || m < 1 || kt_matrix_check(w) != KT_OK)
        return KT_EINVAL;
    if (acts_kind != KT_ACTS_INT8 && acts_kind != KT_ACTS_F32 && acts_kind != KT_ACTS_INT16 &&
        acts_kind != KT_ACTS_BF16)
        return KT_EINVAL;
    kt_acts acts;
    int rc = prepare(&acts, pool, x, m, w, acts_kind);
    if (rc != KT_OK)
        return rc;
    int threads = pool ? kt_pool_threads(pool) : 1;
    struct linear_job job = {out, w, &acts, rows_per_task(w, &acts, m, threads)};
    int64_t n_tasks = (w->rows + job.rows_per_task - 1) / job.rows_per_task;
    if (pool && n_tasks > 1) {
        kt_pool_run(pool, linear_task, &job, n_tasks);
    } else {
        for (int64_t t = 0; t < n_tasks; t++)
            linear_task(&job, t, 0);
    }
    return KT_OK;
}
