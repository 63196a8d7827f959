/* Prints kt_matrix_rows_f32 of KT_LAYOUT_ROW8 I4 matrices against int8 activations, one float
 * per line in %a (exact), for shapes covering every token count of the 8-row kernel's switch,
 * groups of 32-128 columns, with and without mins. Built twice by test_row8_dpbusd.py: as the
 * AVX2 build, and with KT_ROW8_EMULATE_DPBUSD (the AVX512-VNNI code path); both must agree. */
#include <stdio.h>
#include <stdlib.h>
#include "kt_internal.h"

static uint32_t state = 12345;
static uint32_t next(void) { state = state * 1664525u + 1013904223u; return state >> 8; }

static int one_case(int64_t cols, int group, int with_min, int64_t m)
{
    const int64_t rows = 16, ng = cols / group;
    uint8_t *codes = aligned_alloc(64, (size_t)(rows * cols / 2));
    float *scale = malloc((size_t)(rows * ng) * 4), *mins = malloc((size_t)(rows * ng) * 4);
    float *x = malloc((size_t)(m * cols) * 4), *out = calloc((size_t)(m * rows), 4);
    if (!codes || !scale || !mins || !x || !out) {
        printf("FAIL out of memory\n");
        return KT_ENOMEM;
    }
    for (int64_t i = 0; i < rows * cols / 2; i++)
        codes[i] = (uint8_t)next();
    for (int64_t i = 0; i < rows * ng; i++) {
        scale[i] = (float)(next() % 1000 + 1) * 1e-4f;
        mins[i] = -(float)(next() % 1000) * 1e-4f;
    }
    for (int64_t i = 0; i < m * cols; i++)     /* a third at +-5: full-scale int8 codes */
        x[i] = next() % 3 == 0 ? (next() & 1 ? 5.0f : -5.0f) : (float)((int)(next() % 2001) - 1000) / 300.0f;
    kt_matrix w = {KT_I4, group, rows, cols, codes, scale, with_min ? mins : NULL, KT_LAYOUT_ROW8};
    size_t bytes = (kt_acts_scratch_bytes(&w, m, 0, KT_ACTS_INT8) + 63) / 64 * 64;
    void *scratch = aligned_alloc(64, bytes ? bytes : 64);
    kt_acts acts;
    int rc = scratch ? kt_acts_prepare(&acts, x, m, &w, 0, KT_ACTS_INT8, scratch) : KT_ENOMEM;
    if (rc == KT_OK) {
        kt_matrix_rows_f32(out, rows, &w, 0, rows, &acts);
        printf("case cols=%lld group=%d min=%d m=%lld\n", (long long)cols, group, with_min, (long long)m);
        for (int64_t i = 0; i < m * rows; i++)
            printf("%a\n", out[i]);
    }
    free(codes);
    free(scale);
    free(mins);
    free(x);
    free(out);
    free(scratch);
    return rc;
}

int main(void)
{
    const int64_t cols[] = {64, 768};
    const int groups[] = {32, 64, 128};
    const int64_t tokens[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 70};
    for (int c = 0; c < 2; c++)
        for (int g = 0; g < 3; g++)
            for (int with_min = 0; with_min < 2; with_min++)
                for (int t = 0; t < 11; t++)
                    if (cols[c] % groups[g] == 0 && one_case(cols[c], groups[g], with_min, tokens[t]) != KT_OK) {
                        printf("FAIL prepare cols=%lld group=%d\n", (long long)cols[c], groups[g]);
                        return 1;
                    }
    return 0;
}
