/* dequant.c: picked rows of a matrix as float32 (kt.h kt_dequantize_rows_f32), the
 * token-embedding lookup of a step: a few rows, so plain scalar code in every build. */
#include "kt_internal.h"
#include "simd_float.h"

/* The code of column k of a row whose bytes start at `start` (kt_row_start): I4 column k of
 * block k / 32 sits in byte k % 16 of the block, low nibble for k % 32 < 16, else high. */
static int code_at(const kt_matrix *w, const uint8_t *start, int64_t stride, int64_t k)
{
    if (w->format == KT_I8)
        return *(const int8_t *)kt_code_at(start, stride, k);
    const int64_t in_block = k % 32;
    const uint8_t byte = *kt_code_at(start, stride, (k / 32) * 16 + in_block % 16);
    return in_block < 16 ? byte & 0x0F : byte >> 4;
}

static void dequantize_row(float *dst, const kt_matrix *w, int64_t r)
{
    if (w->format == KT_F32 || w->format == KT_BF16 || w->format == KT_F16) {
        const void *row = (const char *)w->data + r * w->cols * (w->format == KT_F32 ? 4 : 2);
        for (int64_t k = 0; k < w->cols; k++)
            dst[k] = weight_f(row, k, w->format);
        return;
    }
    const int64_t n_groups = w->cols / w->group, stride = kt_chunk_stride(w);
    const uint8_t *start = kt_row_start(w, r);
    const float *scale = w->scale + r * n_groups, *mins = w->min ? w->min + r * n_groups : NULL;
    const int zero = w->format == KT_I4 && !mins ? 8 : 0;
    for (int64_t k = 0; k < w->cols; k++) {
        const int64_t g = k / w->group;
        const float q = (float)(code_at(w, start, stride, k) - zero);
        dst[k] = mins ? q * scale[g] + mins[g] : q * scale[g];
    }
}

int kt_dequantize_rows_f32(float *out, const kt_matrix *w, const int64_t *rows, int64_t n)
{
    if (n < 0 || (n > 0 && (!out || !rows)) || kt_matrix_check(w) != KT_OK)
        return KT_EINVAL;
    if (w->layout == KT_LAYOUT_ROW8)
        return KT_EUNSUPPORTED;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= w->rows)
            return KT_EINVAL;
    for (int64_t i = 0; i < n; i++)
        dequantize_row(out + i * w->cols, w, rows[i]);
    return KT_OK;
}
