/* row8.c: rows of a KT_LAYOUT_ROW8 matrix (kt.h): the 8-row decode kernel where it
 * applies, else a copy into the row layout that the row kernels then read. */
#include <string.h>
#include "kt_internal.h"
#include "simd_row8.h"
#include "simd_row8_i8.h"
#include "simd_row8_i8w.h"
#include "simd_row8_pair.h"
#include "simd_row8_i6.h"

enum { COPY_ROWS = 24 };    /* rows a fallback copy holds: whole 8-row groups, and whole
                             * tiles of the GEMM (6 or 12 rows) and of the int kernels (4) */

static int64_t n_groups(const kt_matrix *w) { return w->cols / w->group; }

/* The 6-bit code of weight (r % 8, k) of an I6 8-row group (kt.h KT_LAYOUT_ROW8) */
static int i6_code(const uint8_t *group, int64_t r, int64_t k)
{
    const uint8_t *block = group + (k / 32) * 192;
    const int64_t j = (k % 16) / 4, byte = j * 32 + (r % KT_ROW8_ROWS) * 4 + k % 4, high = k % 32 >= 16;
    const int nibble = high ? block[byte] >> 4 : block[byte] & 0x0F;
    const int top = (block[128 + byte % 64] >> (4 * (byte / 64) + 2 * high)) & 3;
    return nibble | top << 4;
}

/* The format and row bytes a copy of w's rows takes: I6 becomes I8 (codes q - 32, or q with mins) */
static int32_t copy_format(const kt_matrix *w) { return w->format == KT_I6 ? KT_I8 : w->format; }
static int64_t copy_row_bytes(const kt_matrix *w) { return w->format == KT_I6 ? w->cols : kt_row_bytes(w); }

/* Row r's codes of I6 matrix w as I8 codes into dst */
static void copy_i6_row(int8_t *dst, const kt_matrix *w, int64_t r)
{
    const uint8_t *group = (const uint8_t *)w->data + (r / KT_ROW8_ROWS) * KT_ROW8_ROWS * kt_row_bytes(w);
    const int zero = w->min ? 0 : 32;
    for (int64_t k = 0; k < w->cols; k++)
        dst[k] = (int8_t)(i6_code(group, r, k) - zero);
}

/* Rows [r0, r0 + n) of w (r0, n multiples of 8) into the row layout: codes
 * [n, copy_row_bytes], scale and (when w has one) min [n, n_groups]. Word i (bytes
 * 4i..4i+3) of row r sits at word i * 8 + r % 8 of its 8-row group (kt.h). */
static void copy_rows(uint8_t *codes, float *scale, float *min, const kt_matrix *w, int64_t r0, int64_t n)
{
    const int64_t rb = kt_row_bytes(w), ng = n_groups(w);
    for (int64_t r = r0; r < r0 + n; r++) {
        const uint8_t *group = (const uint8_t *)w->data + (r / KT_ROW8_ROWS) * KT_ROW8_ROWS * rb;
        uint8_t *dst = codes + (r - r0) * copy_row_bytes(w);
        if (w->format == KT_I6)
            copy_i6_row((int8_t *)dst, w, r);
        else
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
    if (w->format == KT_I6) {
        const int code = i6_code(group, r, k);
        return w->min ? s * (float)code + mn : s * (float)(code - 32);
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
    const int64_t rb = copy_row_bytes(w), ng = n_groups(w);
    const size_t codes_bytes = (size_t)(COPY_ROWS * rb + 63) / 64 * 64;
    float *scale = (float *)(buf + codes_bytes), *min = w->min ? scale + COPY_ROWS * ng : NULL;
    for (int64_t r = r0; r < r1; r += COPY_ROWS) {
        const int64_t n = r1 - r < COPY_ROWS ? r1 - r : COPY_ROWS;
        copy_rows(buf, scale, min, w, r, n);
        kt_matrix part = {copy_format(w), w->group, n, w->cols, buf, scale, min, KT_LAYOUT_ROWS};
        kt_matrix_rows_f32(out + (r - r0), ldo, &part, 0, n, a);
    }
}

static size_t copy_bytes(const kt_matrix *w)
{
    return (size_t)(COPY_ROWS * copy_row_bytes(w) + 63) / 64 * 64 + 2 * (size_t)(COPY_ROWS * n_groups(w)) * 4;
}

/* Whether this build's 8-row kernel takes a (int8 rows: plain or split pairs) for w:
 * INT4, I8 and I6 where it has the kernel */
static int kernel_takes(const kt_matrix *w, const kt_acts *a)
{
    if (!a->q || a->q16 || a->float_acts)
        return 0;
#if defined(KT_I8_NIBBLES)
    if (w->format == KT_I8 && !a->q_nibble_bias)     /* where its nibble sums start */
        return 0;
#endif
#if defined(KT_ROW8_I6_KERNEL)
    if (w->format == KT_I6)
        return 1;
#endif
#if defined(KT_ROW8_PAIR_KERNEL)
    return 1;
#elif defined(KT_ROW8_KERNEL)
    return w->format == KT_I4 || w->format == KT_I8;
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
#if defined(KT_ROW8_I6_KERNEL)
        if (w->format == KT_I6) {
            row8_rows_i6(out, ldo, w, r0, r1, a);
            return;
        }
#endif
#if defined(KT_ROW8_PAIR_KERNEL)
        if (w->format == KT_I8 || a->m >= PAIR_MIN_TOKENS) {
            row8_pair_rows(out, ldo, w, r0, r1, a);
            return;
        }
#else
        if (w->format == KT_I8) {
            row8_rows_i8(out, ldo, w, r0, r1, a);
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
    return KT_ROW8_I4 | KT_ROW8_I4_PREFILL | KT_ROW8_I8 | KT_ROW8_DPBUSD | KT_ROW8_I6;
#elif defined(KT_ROW8_PAIR_KERNEL)
    return KT_ROW8_I4 | KT_ROW8_I4_PREFILL | KT_ROW8_I8 | KT_ROW8_I6;
#elif defined(KT_ROW8_I8W_KERNEL)
    return KT_ROW8_I4 | KT_ROW8_I8 | KT_ROW8_I6 | KT_ROW8_I8_WIDE;
#elif defined(KT_ROW8_KERNEL)
    return KT_ROW8_I4 | KT_ROW8_I8 | KT_ROW8_I6;
#else
    return 0;
#endif
}

/* I8 decode on the widened kernel where the build has it (simd_row8_i8w.h): 1 if it ran */
static int rows_widened(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1, const kt_acts *a)
{
#if defined(KT_ROW8_I8W_KERNEL)
    if (!row8_i8w_takes(w, a))
        return 0;
    uint8_t *buf = kt_thread_buffer(KT_BUF_ROW8_SETS, i8w_buffer_bytes(a));
    if (!buf)
        return 0;
    row8_rows_i8w(out, ldo, w, r0, r1, a, buf);
    return 1;
#else
    (void)out, (void)ldo, (void)w, (void)r0, (void)r1, (void)a;
    return 0;
#endif
}

/* Split int16 activations (kt_internal.h): both int8 rows of each token into
 * pairs [2 * tokens, r1 - r0], then each token's output is the sum of its two. */
void kt_row8_rows_f32(float *out, int64_t ldo, const kt_matrix *w, int64_t r0, int64_t r1,
                      const kt_acts *acts)
{
    if (rows_widened(out, ldo, w, r0, r1, acts))
        return;
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
