/* kt.h: the whole C ABI of kt's native kernels.
 *
 * This file is also the cffi cdef, so it holds declarations only: no #include,
 * no #define, no inline code. <stdint.h> and <stddef.h> come from the build.
 *
 * Conventions
 *   - Outputs first, then inputs, then sizes.
 *   - A weight matrix W is (rows, cols), row-major; linear layers compute
 *     out (m, rows) = x (m, cols) @ W^T, as torch.nn.Linear does.
 *   - Every function that takes sizes checks their consistency and returns a
 *     negative KT_E* code instead of touching memory when they do not add up.
 *     Buffer lengths cannot be verified here: the Python wrappers in
 *     kt_cli/ops/ check them against the tensors before every call.
 */

enum kt_status {
    KT_OK = 0,
    KT_EINVAL = -1,     /* sizes or formats that do not add up */
    KT_ENOMEM = -2,
    KT_EBUSY = -3,      /* an asynchronous job is still running on this pool */
    KT_EUNSUPPORTED = -4
};

/* ---- identity -------------------------------------------------------------- */

const char *kt_variant_name(void);      /* the variant this library was built as */
int kt_abi_version(void);
int kt_amx_request_permission(void);    /* Linux arch_prctl(ARCH_REQ_XCOMP_PERM); 0 ok */
/* XCR0 (xgetbv 0): which register state the OS saves; 0 when OSXSAVE is off or not x86 */
uint64_t kt_os_xcr0(void);

/* ---- thread pool -------------------------------------------------------------
 * Persistent workers; every parallel kernel below runs on one. n_threads counts
 * the calling thread. A pool runs one job at a time. */

typedef struct kt_pool kt_pool;

kt_pool *kt_pool_new(int n_threads);
void kt_pool_free(kt_pool *pool);
int kt_pool_threads(const kt_pool *pool);
/* How long an idle worker polls for the next job before it sleeps, in pause
 * rounds (default -1: 16384, about 0.2-2 ms, which covers the Python gap between
 * decode kernels). 0 sleeps at once: for stretches where other threads, such as
 * torch's, run between kt's kernels and need the cores. At most 2^24. */
int kt_pool_set_spin(kt_pool *pool, int32_t rounds);
/* Lets kernels on this pool use the AMX tile path (BF16 weights from 4 tokens, I8 from 16);
 * off in a new pool (kt's Python pools turn it on for the amx variant). Requests the
 * OS permission for the tile state when enabling. Call while no job runs.
 * Enabling is KT_EUNSUPPORTED on builds other than amx, or when the OS refuses
 * the tile state; disabling always succeeds. */
int kt_pool_set_amx_tiles(kt_pool *pool, int enabled);

/* ---- NUMA placement (Linux; KT_EUNSUPPORTED elsewhere) ------------------------
 * kt_pool_pin_workers pins the pool's worker threads, never the caller's:
 * worker w (kt_pool_run's thread w + 1, an async job's thread w) to the one CPU
 * cpus[w % n_cpus]. Every cpu must be in 0..1023; KT_EINVAL when an argument is
 * out of range or the OS refuses a CPU (offline, outside this process's cpuset),
 * after pinning the workers it could.
 * kt_mem_interleave spreads the whole pages inside [addr, addr + bytes) round-robin
 * over the NUMA nodes `nodes` (ids 0..1023), moving pages already allocated: one
 * copy of the data, split across the nodes' memory. Partial pages at either end
 * are left alone; a range without a whole page is KT_OK. KT_EUNSUPPORTED when the
 * kernel refuses the call (no NUMA support, or a sandbox: ENOSYS, EPERM), KT_ENOMEM
 * when it runs out of memory or memory mappings, KT_EINVAL for a bad range. */

int kt_pool_pin_workers(kt_pool *pool, const int32_t *cpus, int32_t n_cpus);
int kt_mem_interleave(void *addr, int64_t bytes, const int32_t *nodes, int32_t n_nodes);

/* ---- memory bandwidth probe ---------------------------------------------------
 * Reads a private buffer of n_bytes `repeats` times across the pool's threads and
 * returns the best pass in GB/s (1e9 bytes/s); negative on failure. */

double kt_membw_read_gbps(kt_pool *pool, int64_t n_bytes, int repeats);

/* ---- weight formats -------------------------------------------------------------
 * The kt on-disk/in-memory layout "kt-q1" (see weights/layout.py):
 *   KT_F32   data float[rows*cols]
 *   KT_BF16  data uint16[rows*cols] (bfloat16 bits)
 *   KT_F16   data uint16[rows*cols] (IEEE half bits)
 *   KT_I8    data int8[rows*cols];  w = scale*q (+ min when min != NULL)
 *   KT_I4    data uint8[rows*cols/2]; along each row, every 32 weights are one
 *            16-byte block where byte j holds q[j] in its low nibble and q[j+16]
 *            in its high nibble (q in 0..15);
 *            w = scale*(q-8) when min == NULL, else w = scale*q + min
 *   KT_I6    KT_LAYOUT_ROW8 only (below), in memory only: 6-bit codes q in 0..63,
 *            w = scale*(q-32) when min == NULL, else w = scale*q + min; 3/4 of a
 *            byte a weight. GGUF's Q6_K and Q5_K codes, which I8 holds in 8 bits.
 *   scale, min: float[rows * (cols/group)], one per group of `group` weights
 *   along a row. I4: group % 32 == 0; I8: group % 16 == 0; I6: group 16 or a
 *   multiple of 32; cols % group == 0. */

enum kt_format { KT_F32 = 0, KT_BF16 = 1, KT_F16 = 2, KT_I8 = 3, KT_I4 = 4, KT_I6 = 5 };

typedef struct kt_matrix {
    int32_t format;
    int32_t group;          /* I8/I4 only; 0 for float formats */
    int64_t rows;
    int64_t cols;
    const void *data;
    const float *scale;
    const float *min;
    int32_t layout;         /* enum kt_layout; 0 (rows) when zero-initialized */
    int32_t scale_type;     /* enum kt_scale_type of scale and min; 0 (float32) when zero-initialized */
    const uint16_t *scale_base, *min_base;     /* KT_SCALE_K only (min_base: where min is set) */
} kt_matrix;

/* KT_SCALE_F16: scale and min (both) hold IEEE half floats, cast to const float *;
 * ROW8 layout only. Decode streams 2 bytes less per group and row: 10% of an INT4
 * g32 matrix without mins, 17% with. Loaders pick it only where every value is
 * exactly a half (GGUF's Q4_0 and Q4_1 store theirs so), so results do not change.
 * KT_SCALE_K: two levels, as GGUF's K-quants (Q4_K, Q5_K) store theirs; ROW8 layout only,
 * n_groups % KT_SCALE_K_GROUPS == 0. scale (min alike) holds one uint8 per row and group,
 * where KT_SCALE_F32 holds its float, and scale_base (min_base) one half per row and
 * KT_SCALE_K_GROUPS groups, at [(r / 8) * n_groups + (g / KT_SCALE_K_GROUPS) * 8 + r % 8];
 * the value is base * sub, which a float32 holds exactly (11 by 8 significant bits). A Q4_K
 * matrix then streams 4.625 bits a weight instead of 6 with float32 scale and min; loaders
 * pick it only where every value factors so exactly.
 * KT_SCALE_KS: as KT_SCALE_K with int8 subs (-128..127): GGUF's Q6_K, whose int8
 * sub-scales change sign within a block. */
enum kt_scale_type { KT_SCALE_F32 = 0, KT_SCALE_F16 = 1, KT_SCALE_K = 2, KT_SCALE_KS = 3 };
enum { KT_SCALE_K_GROUPS = 8 };

/* How the codes of an I8/I4 matrix lie in `data` (scale and min are always row-major):
 *   KT_LAYOUT_ROWS   row r's bytes at data + r * row_bytes (the layout above)
 *   KT_LAYOUT_TILES  rows in tiles of KT_TILE_ROWS; each row's bytes cut into
 *                    KT_TILE_CHUNK-byte chunks, and a tile stores chunk 0 of its
 *                    rows 0..3, then chunk 1 of rows 0..3, ...: byte b of row r at
 *                    data + (r / 4) * 4 * row_bytes + ((b / 64) * 4 + r % 4) * 64 + b % 64.
 * Decode streams a tile of rows side by side; tiled, that is one sequential run of
 * memory instead of four short ones the hardware prefetchers barely follow.
 * KT_LAYOUT_TILES needs rows % 4 == 0 and row_bytes % 64 == 0.
 *   KT_LAYOUT_ROW8   I4 and I8: rows in groups of 8 whose bytes are interleaved 4 at
 *                    a time: bytes 4i..4i+3 of row r at data + (r / 8) * 8 * row_bytes
 *                    + i * 32 + (r % 8) * 4 (for I4 that puts bytes 4j..4j+3 of row r's
 *                    block b, 16 bytes a row, at b * 128 + j * 32; for I8, 32 bytes a
 *                    row, at b * 256 + j * 32), and scale (min alike) of row r, group g
 *                    at scale[(r / 8) * 8 * n_groups + g * 8 + r % 8].
 * In ROW8 one 32-byte load holds the same columns of 8 rows: the kernels broadcast
 * each 4 activations to the rows and sum a block of 8 (or 16) rows in one register,
 * with one conversion and scaling per block instead of one per row and block.
 * I6 keeps I4's 128-byte block of the codes' low 4 bits and puts their top 2 bits in
 * 64 bytes after it: a block is 192 bytes (b * 192), and its high byte p (0..63) holds,
 * from bit 0, 2 bits a code: the low then the high nibble's code of the block's byte p,
 * then those of byte p + 64. Its low-nibble codes are columns 0-15 of the block, the
 * high ones 16-31, so group 16 takes one scale for each.
 * KT_LAYOUT_ROW8 needs rows % 8 == 0, cols % 64 == 0, and for I8 group % 32 == 0. */
enum kt_layout { KT_LAYOUT_ROWS = 0, KT_LAYOUT_TILES = 1, KT_LAYOUT_ROW8 = 2 };
enum kt_row8 { KT_ROW8_ROWS = 8 };

/* Which ROW8 matrices this build runs on its 8-row kernel, as bits; the others go
 * through a copy into the row layout (correct, slower):
 *   KT_ROW8_I4          INT4 with int8 activations (plain or int16 split into pairs)
 *   KT_ROW8_I4_PREFILL  and the 16-row AVX-512 form from 3 rows of activations on
 *                       (two 8-row groups a 512-bit register)
 *   KT_ROW8_I8          I8 at any token count (every build with KT_ROW8_I4): on the
 *                       16-row form on AVX-512 builds (decode one 8-row group at a time;
 *                       on amx too: it ran one MoE layer's I8 prefill 1.8x faster than
 *                       the AMX tiles, which keep I8 matrices ROW8 cannot hold; with the
 *                       tiles on, amx takes ROW8 INT4 from 24 tokens and I8 from 64 to
 *                       the BF16 tiles through bf16 copies of the rows), on the 8-row
 *                       form on AVX2 (its codes split into nibbles, as below; split int16
 *                       activations, and 1-2 tokens of int8 ones, on codes widened to int16
 *                       for vpmaddwd instead)
 *   KT_ROW8_DPBUSD      the 16-row form sums with vpdpbusd (AVX512-VNNI builds); without
 *                       it, vpmaddubsw into int16 (I8: its codes split into nibbles)
 *   KT_ROW8_I6          I6 on its 8-row kernel (every build with KT_ROW8_I4); elsewhere I6
 *                       rows are copied as I8 rows (codes q - 32, or q with mins)
 *   KT_ROW8_I8_WIDE     I8 with int16 activations on codes widened to int16 (AVX2): faster
 *                       than the float GEMM up to ~48 tokens, so dense layers keep int16 there */
enum kt_row8_kernels { KT_ROW8_I4 = 1, KT_ROW8_I4_PREFILL = 2, KT_ROW8_I8 = 4, KT_ROW8_DPBUSD = 8, KT_ROW8_I6 = 16,
                       KT_ROW8_I8_WIDE = 32 };
int kt_row8_kernel(void);
enum kt_tile { KT_TILE_ROWS = 4, KT_TILE_CHUNK = 64 };

/* dst = the codes src (rows x row_bytes, row layout) in the tiled layout; the
 * buffers must not overlap. KT_EINVAL unless rows % 4 == 0 and row_bytes % 64 == 0.
 * Runs on the pool's threads when pool is not NULL. */
int kt_tile_codes(kt_pool *pool, void *dst, const void *src, int64_t rows, int64_t row_bytes);

/* out (n, w->cols) = rows rows[0..n) of W as float32 (a token-embedding lookup): the
 * values kt_cli's QMatrix.dequantize gives, bit for bit (w = scale*(q-8) or scale*q + min,
 * rounded after each operation). Rows and tiled layouts; KT_EUNSUPPORTED for ROW8;
 * KT_EINVAL for an invalid matrix or a row id outside [0, w->rows); n may be 0. */
int kt_dequantize_rows_f32(float *out, const kt_matrix *w, const int64_t *rows, int64_t n);

/* ---- activation quantization ----------------------------------------------------
 * Per-row symmetric INT8: x[r, :] ~= scale[r] * q[r, :], q in -127..127.
 * (A utility: the I8/I4 linear and MoE kernels quantize activations themselves,
 * with one scale per 32 values of a row; see kt_linear_f32.) */

int kt_quantize_rows_f32_i8(int8_t *q, float *scale, const float *x, int64_t rows, int64_t n);

/* ---- weight quantization (used by kt convert and the load-time repack) -----------
 * Quantizes w (rows, cols) float32 into the I8 or I4 format of `dst`.
 * dst->data, dst->scale (and dst->min when asymmetric) must be writable buffers
 * of the sizes above; round-to-nearest. */

int kt_quantize_matrix_f32(kt_pool *pool, const kt_matrix *dst, const float *w);

/* ---- dense linear --------------------------------------------------------------
 * out (m, w->rows) = x (m, w->cols) @ W^T, any format above. For I8/I4 weights x
 * is first quantized to symmetric int8 with one scale per block of 32 values of
 * each row (x[t, k] ~= s[t, k/32] * q[t, k], s = max |x| over the block / 127);
 * the result is exact for that quantized x up to f32 rounding. */

int kt_linear_f32(kt_pool *pool, float *out, const float *x, int64_t m, const kt_matrix *w);

/* The same with a choice of activations: KT_ACTS_INT8 as kt_linear_f32;
 * KT_ACTS_F32 keeps x in float32 for every format, so the result is W . x up to
 * f32 rounding: I8/I4 weights are dequantized in registers (m < 16) or per row
 * panel into a float32 GEMM (m >= 16, AVX2 and AVX-512 builds). What dense
 * layers use, where int8 activations can flip a near-tie between two tokens.
 * KT_ACTS_INT16: for I8/I4 weights x is quantized to int16, one scale per block
 * of 32 values (s = max |x| over the block / 32767, so every value is within
 * max |x| / 65534 of x), and multiplied in integers: decode of the dense layers
 * at near float32 accuracy without converting every weight to float. Float
 * formats take KT_ACTS_F32 instead.
 * KT_ACTS_BF16: prefill of ROW8 I8/I4 weights on a pool with AMX tiles on (amx
 * variant): every full 16-row block multiplies x rounded to bf16 by a bf16 copy
 * of its rows (each weight within 2^-9 of its value) on the BF16 tiles, the rows
 * left over take KT_ACTS_INT16; everywhere else it is KT_ACTS_INT16. */
enum kt_acts_kind { KT_ACTS_INT8 = 0, KT_ACTS_F32 = 1, KT_ACTS_INT16 = 2, KT_ACTS_BF16 = 3 };

int kt_linear(kt_pool *pool, float *out, const float *x, int64_t m, const kt_matrix *w, int32_t acts);

/* ---- RMSNorm -------------------------------------------------------------------
 * out (rows, cols) = x / sqrt(mean(x^2 over the row) + eps) * w[r % w_rows], all
 * float32 (w: w_rows rows of cols, e.g. one per attention head); the mean is
 * accumulated in double. Single-threaded: meant for decode-sized inputs. */

int kt_rmsnorm_f32(float *out, const float *x, const float *w, int64_t rows, int64_t cols, int64_t w_rows,
                   float eps);

/* ---- MoE routing ------------------------------------------------------------------
 * Mixtral / Qwen-MoE routing of `tokens` rows of router logits [tokens, experts]:
 * per row p = softmax(logits) (float32, max subtracted), ids[t, :k] the k experts of
 * largest p in descending order (equal p: lower id first), weights[t, :k] their p,
 * divided by their sum when normalize != 0. counts (experts int64s, or NULL):
 * counts[e] += the times e was chosen. 1 <= k <= min(experts, KT_ROUTE_MAX_K). */
enum { KT_ROUTE_MAX_K = 64 };

int kt_route_softmax_topk(const float *logits, int64_t tokens, int64_t experts, int32_t k, int32_t normalize,
                          int32_t *ids, float *weights, int64_t *counts);

/* ---- rotary position embedding -------------------------------------------------------
 * In place on n rows of `heads` float32 vectors of `dim` (row i at x + i * row_stride,
 * its heads contiguous): x[k] <- x[k] * cos[i, k] + partner(x)[k] * sin[i, k], with
 * cos, sin [n, dim]; partner pairs k with k +- dim/2 (interleaved = 0) or with its
 * neighbour 2p <-> 2p + 1 (interleaved = 1). dim even and <= 1024; pool must not be
 * NULL (small calls run on the caller's thread). */

int kt_rope_f32(kt_pool *pool, float *x, int64_t n, int64_t row_stride, int32_t heads, int32_t dim,
                const float *cos, const float *sin, int32_t interleaved);

/* ---- attention over the paged cache (decode and prefill rows) ----------------------
 * Attention of n query rows over a paged float32 KV cache: row i attends to the
 * ctx_len[i] cache rows listed at slots[ctx_offset[i] ..] (a decode row's whole
 * context; a prefill row's causal share of its sequence's, so no mask), query head h
 * to KV head h / (heads / kv_heads):
 *   out[i, h] = sum_j softmax_j(scale * q[i, h] . K[slot_j, g]) V[slot_j, g]
 * Consecutive rows with the same ctx_offset (one sequence's new rows) are computed
 * together in blocks, each key and value row read once per block; a lone row (decode)
 * reads every KV head's run of a cache row together, and a long context is split
 * among the threads, its pieces merged. q float32 [n, heads, head_dim];
 * k_cache [cache_rows, kv_heads, head_dim];
 * v_cache [cache_rows, kv_heads, v_dim]; out [n, heads, v_dim]. The softmax runs
 * online in float32 on the pool's threads (pool must not be NULL). KT_EINVAL for an
 * empty context or a slot outside the cache. */

int kt_attention_decode_f32(kt_pool *pool, float *out, const float *q, int64_t n, int32_t heads,
                            const float *k_cache, const float *v_cache, int64_t cache_rows, int32_t kv_heads,
                            int32_t head_dim, int32_t v_dim, const int64_t *slots, int64_t n_slots,
                            const int64_t *ctx_offset, const int64_t *ctx_len, float scale);

/* ---- one decoder layer of a decode step ------------------------------------------
 * A plain GQA layer on n decode rows (one new token each), float32, in one call:
 *   x = rmsnorm(h_in, in_norm, eps); qkv = x @ qkv^T (+ qkv_bias)  (q, k, v heads;
 *   with qkv NULL, the rows of x @ q_proj^T, x @ k_proj^T and x @ v_proj^T side by side:
 *   GGUF files that keep v in another format, as Q4_K_M's Q6_K beside Q4_K q and k)
 *   optional per-head rmsnorm of the q and k heads (qk_norm [heads + kv_heads,
 *   head_dim], qk_eps); rope (cos, sin [n, head_dim] as kt_rope_f32, interleaved);
 *   k, v rows written to the caches at slot_mapping[i]; attention as
 *   kt_attention_decode_f32 over the step's contexts with `scale`;
 *   h_out = h_in + (attn @ o_proj^T (+ o_bias)); then, when inter > 0 (a dense MLP):
 *   h_out += down(silu(gate) * up), gate and up the first and last `inter` rows of
 *   gate_up applied to rmsnorm(h_out, post_norm, post_eps). inter == 0 leaves the
 *   MLP to the caller (MoE layers). Linear layers take `acts` as kt_linear.
 * h_in, h_out [n, hidden] (may be the same buffer); caches [cache_rows, kv_heads,
 * head_dim]; scratch of at least kt_decode_scratch_floats(L, n) floats.
 * KT_EINVAL for any size or slot that does not fit. */

typedef struct kt_decode_layer {
    int32_t hidden, heads, kv_heads, head_dim, inter;
    const float *in_norm, *post_norm, *qk_norm;     /* post_norm: inter > 0; qk_norm may be NULL */
    float eps, post_eps, qk_eps, scale;
    const kt_matrix *qkv, *o_proj, *gate_up, *down; /* gate_up, down: inter > 0 */
    int32_t interleaved, acts;
    const float *qkv_bias, *o_bias;                 /* [Q + 2K] and [hidden], or NULL: none */
    const kt_matrix *q_proj, *k_proj, *v_proj;      /* qkv NULL only: [Q], [K], [K] rows of hidden */
} kt_decode_layer;

typedef struct kt_decode_step {
    int64_t n;
    const float *cos, *sin;
    const int64_t *slot_mapping;                     /* [n] cache rows of the new tokens */
    const int64_t *ctx_slots, *ctx_offset, *ctx_len; /* as kt_attention_decode_f32 */
    int64_t n_ctx_slots;
} kt_decode_step;

int64_t kt_decode_scratch_floats(const kt_decode_layer *L, int64_t n);
int kt_decode_layer_f32(kt_pool *pool, const kt_decode_layer *L, const kt_decode_step *s, const float *h_in,
                        float *h_out, float *k_cache, float *v_cache, int64_t cache_rows, float *scratch,
                        int64_t scratch_floats);

/* ---- fused MoE experts ------------------------------------------------------------
 * One MoE layer's routed experts. Expert e computes
 *   y_e(x) = down_e( act(gate_e x) * (up_e x) )
 * with act = SiLU, or for KT_ACT_SWIGLU_CLAMP: gate clamped to <= limit, up to
 * [-limit, limit], act(g) = g * sigmoid(alpha * g), y uses (up + 1).
 * The descriptor's matrices are borrowed: they must outlive the kt_moe. */

enum kt_activation { KT_ACT_SILU = 0, KT_ACT_SWIGLU_CLAMP = 1 };

typedef struct kt_moe_desc {
    int32_t n_experts;
    int32_t activation;
    int64_t hidden;
    int64_t inter;
    float clamp_limit;      /* KT_ACT_SWIGLU_CLAMP only */
    float alpha;            /* KT_ACT_SWIGLU_CLAMP only */
    const kt_matrix *gate;  /* [n_experts], each (inter, hidden); unused with gate_up */
    const kt_matrix *up;    /* [n_experts], each (inter, hidden); unused with gate_up */
    const kt_matrix *down;  /* [n_experts], each (hidden, inter) */
    const kt_matrix *gate_up;   /* [n_experts], each (2 inter, hidden), or NULL: gate and up in one
                                 * matrix, KT_GATE_UP_CHUNK rows of each in turn (below) */
} kt_moe_desc;

/* gate_up's rows: for every c = 0, CHUNK, 2 CHUNK, ... < inter and n = min(CHUNK, inter - c),
 * rows [2c, 2c + n) are gate's rows [c, c + n) and rows [2c + n, 2c + 2n) up's. A task's
 * gate and up rows are then one run of the matrix. */
enum { KT_GATE_UP_CHUNK = 16 };

typedef struct kt_moe kt_moe;

kt_moe *kt_moe_new(const kt_moe_desc *desc);  /* NULL when the descriptor is inconsistent */
void kt_moe_free(kt_moe *moe);

/* out (T, hidden) = sum_k weights[t, k] * y_{ids[t, k]}(x[t]) for x (T, hidden),
 * ids and weights (T, K). ids < 0 are skipped (masked or device-resident experts).
 * out is overwritten. */
int kt_moe_forward(kt_pool *pool, kt_moe *moe, float *out, const float *x,
                   const int32_t *ids, const float *weights, int64_t T, int64_t K);

/* The same, asynchronous: returns at once while the pool's workers compute; the
 * buffers must stay untouched until kt_moe_sync(pool) returns. */
int kt_moe_submit(kt_pool *pool, kt_moe *moe, float *out, const float *x,
                  const int32_t *ids, const float *weights, int64_t T, int64_t K);
int kt_moe_sync(kt_pool *pool);

/* ---- the MoE half of a decode step ------------------------------------------------
 * In place on h [n, hidden], the output of kt_decode_layer_f32 with inter == 0:
 *   x = rmsnorm(h, post_norm)
 *   (ids, w) = softmax top-k of x @ router^T    (kt_route_softmax_topk; counts may be NULL)
 *   h += sum_k w[t, k] * y_{ids[t, k]}(x[t])    (kt_moe_forward)
 * router: (n_experts, hidden) in any format kt_linear takes, on float32 activations.
 * Scratch (floats, kt_decode_moe_scratch_floats): x [n, H], logits [n, E],
 * weights and ids [n, K] each, y [n, H]. */
typedef struct kt_decode_moe {
    int64_t hidden;
    int32_t n_experts, top_k, normalize;
    const float *post_norm;
    float post_eps;
    const kt_matrix *router;
    kt_moe *moe;
    int64_t *counts;                                 /* [n_experts], or NULL: not counted */
} kt_decode_moe;

int64_t kt_decode_moe_scratch_floats(const kt_decode_moe *M, int64_t n);
int kt_decode_moe_f32(kt_pool *pool, const kt_decode_moe *M, float *h, int64_t n, float *scratch,
                      int64_t scratch_floats);

/* ---- a decode step through a stack of layers --------------------------------------
 * For i = 0 .. n_layers - 1, in place on h [n, hidden]: kt_decode_layer_f32 with
 * layers[i].layer and its caches, then kt_decode_moe_f32 with layers[i].moe when that
 * is not NULL. moe_seconds (n_layers doubles, or NULL) receives each MoE half's wall
 * time (0 where there is none). Scratch: kt_decode_stack_scratch_floats floats.
 * Every layer is checked as the single-layer calls check it, and all must share
 * `hidden`; KT_EINVAL otherwise, with the layers before the bad one already applied. */
typedef struct kt_decode_stack_layer {
    const kt_decode_layer *layer;
    const kt_decode_moe *moe;                        /* NULL: none (layer->inter > 0, or no MLP) */
    float *k_cache, *v_cache;
    int64_t cache_rows;
} kt_decode_stack_layer;

int64_t kt_decode_stack_scratch_floats(const kt_decode_stack_layer *layers, int32_t n_layers, int64_t n);
int kt_decode_stack_f32(kt_pool *pool, const kt_decode_stack_layer *layers, int32_t n_layers,
                        const kt_decode_step *s, float *h, float *scratch, int64_t scratch_floats,
                        double *moe_seconds);

/* ---- the end of a decode step -----------------------------------------------------
 * For h [n, hidden], the last layer's output: x = rmsnorm(h, norm, eps), then
 * logits [n, vocab] = x @ lm_head^T with `acts` as kt_linear (vocab = lm_head's rows),
 * and, when argmax is not NULL, argmax[t] = the first index of row t's largest logit
 * (a NaN counts as the largest: torch.argmax's pick). Scratch: at least
 * kt_decode_head_scratch_floats(H, n) floats (-1: the descriptor is inconsistent). */
typedef struct kt_decode_head {
    int64_t hidden;
    const float *norm;                               /* [hidden] */
    float eps;
    const kt_matrix *lm_head;                        /* (vocab, hidden) */
    int32_t acts;
} kt_decode_head;

int64_t kt_decode_head_scratch_floats(const kt_decode_head *H, int64_t n);
int kt_decode_head_f32(kt_pool *pool, const kt_decode_head *H, const float *h, int64_t n, float *logits,
                       int64_t *argmax, float *scratch, int64_t scratch_floats);
