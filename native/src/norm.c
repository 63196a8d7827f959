/* norm.c: RMSNorm over float32 rows, for the small calls of decode (the layers
 * keep torch's ops for prefill-sized inputs).
 *
 *   out[r, k] = (x[r, k] * inv_r) * w[r % w_rows, k],  inv_r = 1 / sqrt(mean_k x[r, k]^2 + eps)
 *
 * The mean of squares is accumulated in double, so inv_r is the correctly rounded
 * float of the exact value; the two products are float32, in transformers' order. */
#include <math.h>
#include "kt_internal.h"

static float inverse_rms(const float *x, int64_t cols, float eps)
{
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t k = 0;
    for (; k + 4 <= cols; k += 4)
        for (int j = 0; j < 4; j++)
            acc[j] += (double)x[k + j] * (double)x[k + j];
    for (; k < cols; k++)
        acc[0] += (double)x[k] * (double)x[k];
    double mean = (acc[0] + acc[1] + acc[2] + acc[3]) / (double)cols;
    return (float)(1.0 / sqrt(mean + (double)eps));
}

int kt_rmsnorm_f32(float *out, const float *x, const float *w, int64_t rows, int64_t cols, int64_t w_rows,
                   float eps)
{
    if (!out || !x || !w || rows < 1 || cols < 1 || w_rows < 1 || !(eps >= 0.0f))
        return KT_EINVAL;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols, *wr = w + (r % w_rows) * cols;
        float *o = out + r * cols;
        float inv = inverse_rms(xr, cols, eps);
        for (int64_t k = 0; k < cols; k++)
            o[k] = (xr[k] * inv) * wr[k];
    }
    return KT_OK;
}
