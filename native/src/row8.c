/* row8.c: rows of a KT_LAYOUT_ROW8 matrix (kt.h): the 8-row decode kernel where it
 * applies, else a copy into the row layout that the row kernels then read. */
#include <string.h>
#include "kt_internal.h"
#include "simd_row8.h"
#include "simd_row8_pair.h"

enum { COPY_ROWS = 24 };    /* rows a fallback copy holds: whole 8-row groups, and whole
                             * tiles of the GEMM (6 or 12 rows) and of the int kernels (4) */

static int64_t n_groups(const kt_matrix *w) { return w->cols / w->group; }

/* Rows [r0, r0 + n) of w (r0, n multiples of 8) into the row layout: codes
 * [n, row bytes], scale and (when w has one) min [n, n_groups]. Word i (bytes
 * 4i..4i+3) of row r sits at word i * 8 + r % 8 of its 8-row group (kt.h). */
static void copy_rows(uint8_t *codes, float *scale, float *min, const kt_matrix *w, int64_t r0, int64_t n)
{
    const int64_t rb = kt_row_bytes(w), ng = n_groups(w);
    for (int64_t r = r0; r < r0 + n; r++) {
        const uint8_t *group = (const uint8_t *)w->data + (r / KT_ROW8_ROWS) * KT_ROW8_ROWS * rb;
        uint8_t *dst = codes + (r - r0) * rb;
        for (int64_t i = 0; i < rb / 4; i++)
            memcpy(dst + i * 4, group + i * 32 + (r % KT_ROW8_ROWS) * 4, 4);
        const int64_t at = (r / KT_ROW8_ROWS) * KT_ROW8_ROWS * ng + r % KT_ROW8_ROWS;
        for (int64_t g = 0; g < ng; g++) {
            scale[(r - r0) * ng + g] = kt_row8_scale_at(w, 0, at + g * KT_ROW8_ROWS);
            if (min)
                min[(r - r0) * ng + g] = kt_row8_scale_at(w, 1, at + g * KT_ROW8_ROWS);
        }
    }
}

/* Weight (r, k) of a ROW8 matrix, for the no-memory path. */
static float weight_at(const kt_matrix *w, int64_t r, int64_t k)
{
    const int64_t rb = kt_row_bytes(w), ng = n_groups(w);
    const uint8_t *group = (const uint8_t *)w->data + (r / KT_ROW8_ROWS) * KT_ROW8_ROWS * rb;
    const int64_t at = (r / KT_ROW8_ROWS) * KT_ROW8_ROWS * ng + (k / w->group) * KT_ROW8_ROWS + r % KT_ROW8_ROWS;
    const float s = kt_row8_scale_at(w, 0, at), mn = w->min ? kt_row8_scale_at(w, 1, at) : 0.0f;
    if (w->format == KT_I8) {
        const int8_t code = (int8_t)group[(k / 4) * 32 + (r % KT_ROW8_ROWS) * 4 + k % 4];
        return s * (float)code + mn;
    }
    const int64_t b = k / 32, j = (k % 16) / 4;
    uint8_t byte = group[b * 128 + j * 32 + (r % KT_ROW8_ROWS) * 4 + k % 4];
    int code = (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
    return w->min ? s * (float)code + mn : s * (float)(code - 8);
}

/* No scratch for a copy (allocation failed): exact float products from x. */
static void rows_exact(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1, const kt_acts *a)
{
    const int64_t tokens = a->split ? a->m / 2 : a->m;
    for (int64_t t = 0; t < tokens; t++) {
        const float *x = a->f32 + t * w->cols;
        for (int64_t r = r0; r < r1; r++) {
            float s = 0.0f;
            for (int64_t k = 0; k < w->cols; k++)
                s += weight_at(w, r, k) * x[k];
            out[t * ldo + (r - r0)] = s;
        }
    }
}

/* The row kernels on copies of COPY_ROWS rows in the row layout, in buf */
static void rows_by_copy(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1, const kt_acts *a,
                         uint8_t *buf)
{
    const int64_t rb = kt_row_bytes(w), ng = n_groups(w);
    const size_t codes_bytes = (size_t)(COPY_ROWS * rb + 63) / 64 * 64;
    float *scale = (float *)(buf + codes_bytes), *min = w->min ? scale + COPY_ROWS * ng : NULL;
    for (int64_t r = r0; r < r1; r += COPY_ROWS) {
        const int64_t n = r1 - r < COPY_ROWS ? r1 - r : COPY_ROWS;
        copy_rows(buf, scale, min, w, r, n);
        kt_matrix part = {w->format, w->group, n, w->cols, buf, scale, min, KT_LAYOUT_ROWS};
        kt_matrix_rows_f32(out + (r - r0), ldo, &part, 0, n, a);
    }
}

static size_t copy_bytes(const kt_matrix *w)
{
    return (size_t)(COPY_ROWS * kt_row_bytes(w) + 63) / 64 * 64 + 2 * (size_t)(COPY_ROWS * n_groups(w)) * 4;
}

/* Whether this build's 8-row kernel takes a (int8 rows: plain or split pairs) for w:
 * INT4 where it has the kernel, I8 where it has the 16-row AVX-512 form */
static int kernel_takes(const kt_matrix *w, const kt_acts *a)
{
    if (!a->q || a->q16 || a->float_acts)
        return 0;
#if defined(KT_ROW8_PAIR_KERNEL)
    return 1;
#elif defined(KT_ROW8_KERNEL)
    return w->format == KT_I4;
#else
    (void)w;
    return 0;
#endif
}

/* Rows [r0, r1) for every row of a (for split activations: both rows of each pair) */
static void rows_f32(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1, const kt_acts *a,
                     uint8_t *copy_buf)
{
#if defined(KT_ROW8_KERNEL)
    if (kernel_takes(w, a)) {
#if defined(KT_ROW8_PAIR_KERNEL)
        if (w->format == KT_I8 || a->m >= PAIR_MIN_TOKENS) {
            row8_pair_rows(out, ldo, w, r0, r1, a);
            return;
        }
#endif
#if defined(KT_ROW8_PAIR_DPBUSD)
        row8_rows_i4_decode(out, ldo, w, r0, r1, a);     /* 1-2 rows: below PAIR_MIN_TOKENS */
#else
        row8_rows_i4(out, ldo, w, r0, r1, a);
#endif
        return;
    }
#endif
    rows_by_copy(out, ldo, w, r0, r1, a, copy_buf);
}

int kt_row8_kernel(void)
{
#if defined(KT_ROW8_PAIR_DPBUSD)
    return KT_ROW8_I4 | KT_ROW8_I4_PREFILL | KT_ROW8_I8 | KT_ROW8_DPBUSD;
#elif defined(KT_ROW8_PAIR_KERNEL)
    return KT_ROW8_I4 | KT_ROW8_I4_PREFILL | KT_ROW8_I8;
#elif defined(KT_ROW8_KERNEL)
    return KT_ROW8_I4;
#else
    return 0;
#endif
}

/* Split int16 activations (kt_internal.h): both int8 rows of each token into
 * pairs [2 * tokens, r1 - r0], then each token's output is the sum of its two. */
void kt_row8_rows_f32(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                      const kt_acts *acts)
{
    if (!acts->split && kernel_takes(w, acts)) {
        rows_f32(out, ldo, w, r0, r1, acts, NULL);     /* the decode path: no scratch */
        return;
    }
    const int64_t nr = r1 - r0;
    const size_t pair_bytes = acts->split ? (size_t)(acts->m * nr) * 4 : 0, copy = copy_bytes(w);
    uint8_t *buf = kt_thread_buffer(KT_BUF_ROW8, pair_bytes + copy);
    if (!buf) {
        rows_exact(out, ldo, w, r0, r1, acts);
        return;
    }
    if (!acts->split) {
        rows_f32(out, ldo, w, r0, r1, acts, buf);
        return;
    }
    float *pairs = (float *)(buf + copy);
    rows_f32(pairs, nr, w, r0, r1, acts, buf);
    for (int64_t t = 0; t < acts->m / 2; t++)
        for (int64_t i = 0; i < nr; i++)
            out[t * ldo + i] = pairs[2 * t * nr + i] + pairs[(2 * t + 1) * nr + i];
}
