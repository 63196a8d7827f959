/* kt_internal.h: what the C source files share with each other (not part of the
 * ABI in kt.h). Two contracts live here:
 *   1. the thread pool's job interface (threadpool.c), used by every parallel op;
 *   2. the matrix-rows kernel (linear.c), used by kt_linear_f32 and by the fused
 *      MoE operator (moe.c): both reduce to "these rows of W times these tokens". */
#ifndef KT_INTERNAL_H
#define KT_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include "kt.h"

/* A spin-wait hint: lets the sibling hyperthread run while a worker polls. */
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

/* ---- half floats (F16 weights, KT_SCALE_F16 scales) ------------------------------------ */

#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <string.h>

static inline float kt_f16_to_f32(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    /* IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, u;
    float f;
    if (exp == 0) {
        f = (float)mant * (1.0f / 16777216.0f);     /* subnormal: mant * 2^-24 */
        return sign ? -f : f;
    }
    u = exp == 31 ? sign | 0x7F800000u | (mant << 13) : sign | ((exp + 112u) << 23) | (mant << 13);
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* Whether scales of kt_scale_type t are two-level (uint8 or int8 subs times half bases) */
static inline int kt_two_level(int32_t t) { return t == KT_SCALE_K || t == KT_SCALE_KS; }

/* The integer code formats (scale and group; I6 only in the ROW8 layout) */
static inline int kt_int_format(int32_t format) { return format == KT_I8 || format == KT_I4 || format == KT_I6; }

/* Entry i of a ROW8 matrix's scale (mins: its min), i = (r / 8) * 8 * n_groups + g * 8 + r % 8
 * (kt.h KT_LAYOUT_ROW8), as a float, whatever its kt_scale_type */
static inline float kt_row8_scale_at(const kt_matrix *w, int mins, int64_t i)
{
    const void *t = mins ? (const void *)w->min : (const void *)w->scale;
    if (w->scale_type == KT_SCALE_F16)
        return kt_f16_to_f32(((const uint16_t *)t)[i]);
    if (!kt_two_level(w->scale_type))
        return ((const float *)t)[i];
    const int64_t ng = w->cols / w->group, G = i / (8 * ng), g = (i / 8) % ng;
    const uint16_t *base = mins ? w->min_base : w->scale_base;
    const float sub = w->scale_type == KT_SCALE_KS ? (float)((const int8_t *)t)[i] : (float)((const uint8_t *)t)[i];
    return kt_f16_to_f32(base[G * ng + (g / KT_SCALE_K_GROUPS) * 8 + i % 8]) * sub;
}

/* ---- thread pool jobs ----------------------------------------------------------
 * kt_pool_run calls fn(ctx, task, thread) once for every task in [0, n_tasks),
 * tasks handed out dynamically (atomic counter) across the pool's threads, the
 * caller included; returns when all tasks are done. thread is in
 * [0, kt_pool_threads(pool)) and indexes per-thread scratch. */
typedef void (*kt_task_fn)(void *ctx, int64_t task, int thread);

void kt_pool_run(kt_pool *pool, kt_task_fn fn, void *ctx, int64_t n_tasks);

/* Asynchronous form: returns at once; the pool's workers (not the caller) run the
 * tasks. kt_pool_wait blocks until they are done. KT_EBUSY if a job is running. */
int kt_pool_run_async(kt_pool *pool, kt_task_fn fn, void *ctx, int64_t n_tasks);
int kt_pool_wait(kt_pool *pool);

/* The pool's worker threads, for numa.c's pinning: how many, and worker w's
 * thread (0 <= w < kt_pool_worker_count(pool)), valid while the pool lives. */
int kt_pool_worker_count(const kt_pool *pool);
pthread_t kt_pool_worker_thread(const kt_pool *pool, int w);

/* ---- AMX tiles (amx variant) ---------------------------------------------------------
 * KT_AMX_BUILD: this build (the amx variant) compiles the AMX tile kernels. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define KT_AMX_BUILD 1
#endif

/* Whether kernels run on `pool` may use the AMX tile path: 0 unless
 * kt_pool_set_amx_tiles enabled it (never on other variants); 0 for a NULL pool. */
int kt_pool_amx_tiles(const kt_pool *pool);

/* ---- activations prepared for one weight format ------------------------------------
 * m token rows of length cols, converted once per (tokens, format) so every row
 * block of W reuses them: float formats use f32 (or bf16 for BF16 weights where
 * the ISA has a bf16 dot product); I8/I4 use symmetric int8 with one scale per
 * block of KT_ACT_BLOCK values of a token row (the last block of a row may be
 * shorter: cols % 32 == 16 happens for I8 with group 16), plus per-group sums of
 * the dequantized activations (the zero-point/min term of I4 and asymmetric W):
 *   x[t, k] ~= q_scale[t, k / 32] * q[t, k]
 *   q_group_sum[t, g] = sum over k in group g of q_scale[t, k / 32] * q[t, k]
 * For I4 weights q's rows are stored interleaved: in every full 64 columns the
 * pieces [0-15, 16-31, 32-47, 48-63] sit in the order [0-15, 32-47, 16-31, 48-63]
 * (the order in which the kernels unpack two 16-byte blocks of I4 codes).
 * KT_ACTS_INT16 fills q16 instead of q (in column order, scale max |x| / 32767),
 * with q_scale and q_group_sum as above; for a KT_LAYOUT_ROW8 matrix it is split
 * instead: x[t] ~= s * q16 with s = max |x| / KT_SPLIT_MAX and q16 = 256 * hi + lo
 * (hi, lo int8), stored as two int8 rows, 2t = hi with scale 256 * s and 2t + 1 =
 * lo with scale s, so the int8 kernels compute both and their sum is the int16
 * product (m = 2 * tokens, split = 1).
 * q_nibble_bias, for a ROW8 I8 matrix on builds whose 8-row I8 kernel sums its codes as nibbles
 * (KT_I8_NIBBLES; simd_row8_i8.h), else NULL: per int8 row t and 32-column block b, two int16
 * in one int32, -8 times the sum of q[t, k] over the block's k with k % 4 < 2 (low half) and
 * k % 4 >= 2 (high half): where that kernel's high-nibble sums start, which takes the flip's
 * -128 * s out of the zero point. */
#define KT_SPLIT_MAX 32639      /* |q16| <= 127 * 256 + 127: hi = rint(q16 / 256) stays in int8 */
#define KT_ACT_BLOCK 32

/* Builds whose 8-row I8 kernel splits codes into nibbles for vpmaddubsw: AVX2 without AVX512-VNNI */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define KT_I8_NIBBLES 1
#endif

typedef struct kt_acts {
    int64_t m;
    int64_t cols;
    int32_t format;        /* the weight format these were prepared for */
    int32_t group;
    int32_t float_acts;    /* 1: I8/I4 weights meet f32 (exact path; q etc. are NULL) */
    int32_t split;         /* 1: int16 activations as pairs of int8 rows (above); m is 2 * tokens */
    const float *f32;      /* [m, cols] */
    float *xt;             /* exact path's GEMM (float_acts, m >= KT_GEMM_MIN_TOKENS,
                            * AVX2+): x per token tile, transposed (gemm.c); or NULL */
    uint16_t *bf16;        /* [m, cols] or NULL */
    int8_t *q;             /* [m, cols] or NULL; I4: interleaved, see above */
    int16_t *q16;          /* [m, cols] or NULL (KT_ACTS_INT16) */
    float *q_scale;        /* [m, n_blocks], n_blocks = ceil(cols / 32) */
    float *q_group_sum;    /* [m, cols / group] */
    int32_t *q_nibble_bias;    /* [m, n_blocks] or NULL (above) */
    /* amx variant, AMX tiles enabled on the pool and m >= KT_AMX_MIN_TOKENS_*: the
     * same tokens in AMX B-tile panels (layout in simd_amx.h), padded with zero
     * tokens to a multiple of 16; else NULL */
    uint16_t *amx_bf16;    /* BF16, and ROW8 I4/I8: [m16/16][cols/32][16][16][2] */
    int8_t *amx_q;         /* I8:   [m16/16][cols/32][8][16][4] */
    float *amx_gsum;       /* I8:   [m16/16][cols/group][16] q_group_sum, transposed */
    float *amx_scale;      /* I8:   [m16/16][cols/32][16] q_scale, transposed */
    /* BF16 weights on AVX512-BF16 builds, m >= KT_BF16_GEMM_MIN_TOKENS, cols % 32 == 0 and
     * no AMX panels: the same panels as amx_bf16, for the pair GEMM (gemm_bf16.c), beside
     * the bf16 rows */
    uint16_t *bf16_pairs;
} kt_acts;

/* Token counts from which kt_acts_prepare lays out AMX panels (amx variant). BF16: one
 * 32768 x 2048 matrix from DRAM on a 2-core Sapphire Rapids-class guest ran 1.0x the
 * AVX512-BF16 kernel at 1-4 tokens, 1.5x at 6, 2.4x at 16. I8 flushes its C tile every
 * 32 columns (one activation scale per 32), which pays at 16. */
#define KT_AMX_MIN_TOKENS_BF16 4
#define KT_AMX_MIN_TOKENS_I8 16
/* ROW8 INT4 and I8 (int8 activations asked for) go to the BF16 tiles through a bf16 copy of
 * their rows (simd_amx_row8.h), which pays once enough tokens share each copy. On a 2-core
 * Sapphire Rapids-class guest, against the 16-row VNNI kernel: INT4 g32 0.8-0.9x at 16
 * tokens, 1.0x at 24, 1.27x at 32, 1.5-1.7x at 64 (g128: 1.05x at 16); I8 g32 in one
 * Qwen3-30B-A3B MoE layer (weights from DRAM) 0.87-1.03x at T=512 (32 tokens an expert),
 * 1.46-1.71x at T=2048. */
#define KT_AMX_MIN_TOKENS_ROW8 24
#define KT_AMX_MIN_TOKENS_ROW8_I8 64
/* Token count from which BF16 weights take the pair GEMM (gemm_bf16.c) on AVX512-BF16 builds */
#define KT_BF16_GEMM_MIN_TOKENS 16

/* The exact path's prefill GEMM (gemm.c): builds with AVX2 and FMA, from
 * KT_GEMM_MIN_TOKENS tokens. KT_GEMM_TOKENS = its token tile. */
#if defined(__AVX2__) && defined(__FMA__)
#define KT_GEMM_BUILD 1
#endif
#define KT_GEMM_MIN_TOKENS 16
#if defined(__AVX512F__)
#define KT_GEMM_TOKENS 32
#else
#define KT_GEMM_TOKENS 16
#endif

/* Bytes of scratch kt_acts_prepare needs for m rows against matrix w; amx_tiles
 * as kt_pool_amx_tiles of the pool the kernels will run on; kind a kt_acts_kind
 * (kt.h; KT_ACTS_F32: the exact path, float32 activations for every format). */
size_t kt_acts_scratch_bytes(const kt_matrix *w, int64_t m, int amx_tiles, int32_t kind);
/* Fills acts from x [m, w->cols] using `scratch` (kt_acts_scratch_bytes long, 64-byte
 * aligned): for KT_ACTS_F32 the GEMM's transposed tiles when it applies, else
 * nothing (the kernels read x); for KT_ACTS_INT16 int16 (I8/I4); else int8 (I8/I4)
 * or bf16 (BF16 on avx512_bf16), and AMX panels when amx_tiles is set (and the
 * build and shape allow). */
int kt_acts_prepare(kt_acts *acts, const float *x, int64_t m, const kt_matrix *w, int amx_tiles,
                    int32_t kind, void *scratch);
/* The activations an MoE expert's m rows take against w: KT_ACTS_INT8, or KT_ACTS_F32 where
 * this build's float32 GEMM is the faster kernel for w (acts.c) */
int32_t kt_acts_expert_kind(const kt_matrix *w, int64_t m);

/* quant.c helpers that acts.c shares: max |x[i]| (NaN ignored), and one token row
 * in int8 blocks of KT_ACT_BLOCK, q = rint(x / s), s = max |x| over the block / 127. */
float kt_abs_max(const float *x, int64_t n);
void kt_quantize_blocks_i8(int8_t *q, float *scale, const float *x, int64_t n);

/* Rows [r0, r1) of W against acts->xt (acts prepared for the GEMM): the same
 * contract as kt_matrix_rows_f32. KT_ENOMEM if the per-thread panel could not be
 * allocated (nothing written); KT_EUNSUPPORTED on builds without the GEMM. */
int kt_gemm_rows(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                 const kt_acts *acts);

/* Rows [r0, r1) of a BF16 W against acts->bf16_pairs: the same contract as
 * kt_matrix_rows_f32 (a no-op on builds without AVX512-BF16, which never set them). */
void kt_bf16_gemm_rows(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                       const kt_acts *acts);

/* ---- where a row's codes lie (kt.h, enum kt_layout) ------------------------------
 * A row is read through its start and chunk stride: byte b of the row is at
 * start + (b / KT_TILE_CHUNK) * chunk_stride + b % KT_TILE_CHUNK. Rows layout:
 * start = the row, chunk stride 64 (contiguous); tiles: start = the tile + (r % 4)
 * * 64, chunk stride 256. Kernels never load across a 64-byte chunk boundary. */
/* Decode kernels on the tiled layout prefetch this many chunks ahead of their reads
 * (1 KB: measured best of 0.5-2 KB, I4 decode on a 2-core Zen 3 guest). */
#define KT_PREFETCH_CHUNKS 4

/* Which lines a row tile asks for while it reads its rows (linear.c's
 * tile_prefetch): at every `every`-th 64-byte step from step `phase`, the lines
 * `ahead` bytes further on in each row, into L2 (prefetcht1: as fast as or
 * faster than into L1 for every case measured on Zen 4). ahead 0: none. */
typedef struct kt_tile_prefetch {
    int64_t ahead, every, phase;
} kt_tile_prefetch;

static inline int64_t kt_row_bytes(const kt_matrix *w)
{
    switch (w->format) {
    case KT_F32: return w->cols * 4;
    case KT_BF16: case KT_F16: return w->cols * 2;
    case KT_I8: return w->cols;
    case KT_I6: return w->cols / 4 * 3;
    default: return w->cols / 2;
    }
}

static inline int64_t kt_chunk_stride(const kt_matrix *w)
{
    return w->layout == KT_LAYOUT_TILES ? (int64_t)KT_TILE_CHUNK * KT_TILE_ROWS : KT_TILE_CHUNK;
}

static inline const uint8_t *kt_row_start(const kt_matrix *w, int64_t r)
{
    const uint8_t *data = (const uint8_t *)w->data;
    if (w->layout != KT_LAYOUT_TILES)
        return data + r * kt_row_bytes(w);
    return data + (r / KT_TILE_ROWS) * KT_TILE_ROWS * kt_row_bytes(w) + (r % KT_TILE_ROWS) * KT_TILE_CHUNK;
}

static inline const uint8_t *kt_code_at(const uint8_t *start, int64_t chunk_stride, int64_t b)
{
    uint64_t u = (uint64_t)b;      /* b >= 0: unsigned, so / and % are a shift and a mask */
    return start + (int64_t)(u / KT_TILE_CHUNK) * chunk_stride + (int64_t)(u % KT_TILE_CHUNK);
}

/* ---- KT_LAYOUT_ROW8 (row8.c) ------------------------------------------------------
 * Rows [r0, r1) of a ROW8 matrix, r0 % 8 == 0 and r1 % 8 == 0 (rows % 8 == 0):
 * int8 activations, and int16 ones split into int8 pairs (above), run the 8-row
 * kernel on AVX2 builds (simd_row8.h); float activations, the GEMM and builds
 * without AVX2 copy the rows into the row layout, 24 at a time, and run the row
 * kernels on the copy (split pairs summed afterwards either way). */
void kt_row8_rows_f32(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                      const kt_acts *acts);

/* Per-thread buffers (threadbuf.c), grown on demand and kept; one per slot. */
enum {
    KT_BUF_ACTS = 0, KT_BUF_GEMM_PANEL = 1, KT_BUF_ROW8 = 2, KT_BUF_AMX_PANEL = 3, KT_BUF_ROW8_SETS = 4,
    KT_BUF_ROW8_SPLIT = 5, KT_THREAD_BUF_SLOTS = 6
};
void *kt_thread_buffer(int slot, size_t bytes);

/* out[i * ldo + (r - r0)] = dot(W row r, token i) for i in [0, acts->m), r in [r0, r1).
 * Single-threaded: callers split rows (and experts) across the pool. */
void kt_matrix_rows_f32(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                        const kt_acts *acts);

/* Checks a matrix descriptor's internal consistency (format, group, sizes). */
int kt_matrix_check(const kt_matrix *w);

/* A kt_moe's hidden size and expert count (moe.c). */
void kt_moe_dims(const kt_moe *moe, int64_t *hidden, int32_t *n_experts);

#endif
