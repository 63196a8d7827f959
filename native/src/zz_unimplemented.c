/* TEMPORARY: entry points not written yet; each returns KT_EUNSUPPORTED.
 * Delete a function here when its real implementation lands. */
#include <stdint.h>
#include <stddef.h>
#include "kt.h"

kt_pool *kt_pool_new(int n_threads) { (void)n_threads; return NULL; }
void kt_pool_free(kt_pool *pool) { (void)pool; }
int kt_pool_threads(const kt_pool *pool) { (void)pool; return 0; }
double kt_membw_read_gbps(kt_pool *pool, int64_t n, int r) { (void)pool; (void)n; (void)r; return -1.0; }
int kt_quantize_rows_f32_i8(int8_t *q, float *s, const float *x, int64_t r, int64_t n) { (void)q; (void)s; (void)x; (void)r; (void)n; return KT_EUNSUPPORTED; }
int kt_quantize_matrix_f32(kt_pool *p, const kt_matrix *d, const float *w) { (void)p; (void)d; (void)w; return KT_EUNSUPPORTED; }
int kt_linear_f32(kt_pool *p, float *o, const float *x, int64_t m, const kt_matrix *w) { (void)p; (void)o; (void)x; (void)m; (void)w; return KT_EUNSUPPORTED; }
kt_moe *kt_moe_new(const kt_moe_desc *d) { (void)d; return NULL; }
void kt_moe_free(kt_moe *m) { (void)m; }
int kt_moe_forward(kt_pool *p, kt_moe *m, float *o, const float *x, const int32_t *i, const float *w, int64_t T, int64_t K) { (void)p; (void)m; (void)o; (void)x; (void)i; (void)w; (void)T; (void)K; return KT_EUNSUPPORTED; }
int kt_moe_submit(kt_pool *p, kt_moe *m, float *o, const float *x, const int32_t *i, const float *w, int64_t T, int64_t K) { (void)p; (void)m; (void)o; (void)x; (void)i; (void)w; (void)T; (void)K; return KT_EUNSUPPORTED; }
int kt_moe_sync(kt_pool *p) { (void)p; return KT_EUNSUPPORTED; }
