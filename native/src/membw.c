/* membw.c: how fast this machine streams memory into the cores, the ceiling a
 * memory-bound kernel (decode GEMV, MoE experts) can reach.
 *
 * The buffer is written once across the pool (first touch places pages near the
 * thread that uses them), then each pass splits it into one slice per thread;
 * every slice is read with wide loads folded into a register sum that is stored
 * to a per-task sink, so the compiler cannot drop the loads. Best pass wins.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kt_internal.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define SLICE_ALIGN 4096
#define MAX_SINKS 4096

struct membw_job {
    char *buf;
    int64_t slice;          /* bytes per task, a multiple of SLICE_ALIGN */
    int64_t n_bytes;
    uint64_t sink[MAX_SINKS];
};

static uint64_t read_span(const char *p, int64_t n)
{
#if defined(__AVX2__)
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_load_si256((const __m256i *)(p + i + 32)));
        c = _mm256_add_epi64(c, _mm256_load_si256((const __m256i *)(p + i + 64)));
        d = _mm256_add_epi64(d, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, s);
    uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
    uint64_t sum = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    const uint64_t *w = (const uint64_t *)p;
    for (; i + 32 <= n; i += 32) {
        sum += w[i / 8];
        s1 += w[i / 8 + 1];
        s2 += w[i / 8 + 2];
        s3 += w[i / 8 + 3];
    }
    sum += s1 + s2 + s3;
#endif
    for (; i < n; i++)
        sum += (unsigned char)p[i];
    return sum;
}

static void span_of(const struct membw_job *job, int64_t task, int64_t *start, int64_t *len)
{
    *start = task * job->slice;
    int64_t end = *start + job->slice < job->n_bytes ? *start + job->slice : job->n_bytes;
    *len = end > *start ? end - *start : 0;
}

static void touch_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    struct membw_job *job = ctx;
    int64_t start, len;
    span_of(job, task, &start, &len);
    memset(job->buf + start, (int)(task & 0x7F) + 1, (size_t)len);
}

static void read_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    struct membw_job *job = ctx;
    int64_t start, len;
    span_of(job, task, &start, &len);
    job->sink[task] += read_span(job->buf + start, len);
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static char *alloc_buffer(int64_t n_bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 2 * 1024 * 1024, (size_t)n_bytes) != 0)
        return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p, (size_t)n_bytes, MADV_HUGEPAGE);     /* fewer page faults and TLB misses */
#endif
    return p;
}

double kt_membw_read_gbps(kt_pool *pool, int64_t n_bytes, int repeats)
{
    if (!pool || n_bytes < SLICE_ALIGN || repeats < 1)
        return KT_EINVAL;
    struct membw_job *job = calloc(1, sizeof *job);
    if (!job)
        return KT_ENOMEM;
    int64_t n_tasks = kt_pool_threads(pool);
    int64_t slice = (n_bytes / n_tasks + SLICE_ALIGN - 1) / SLICE_ALIGN * SLICE_ALIGN;
    job->n_bytes = n_bytes;
    job->slice = slice;
    n_tasks = (n_bytes + slice - 1) / slice;
    job->buf = n_tasks <= MAX_SINKS ? alloc_buffer(n_bytes) : NULL;
    if (!job->buf) {
        free(job);
        return KT_ENOMEM;
    }
    kt_pool_run(pool, touch_task, job, n_tasks);
    double best = 0.0;
    for (int i = 0; i < repeats; i++) {
        double t0 = now_seconds();
        kt_pool_run(pool, read_task, job, n_tasks);
        double dt = now_seconds() - t0;
        if (dt > 0 && (double)n_bytes / dt / 1e9 > best)
            best = (double)n_bytes / dt / 1e9;
    }
    free(job->buf);
    free(job);
    return best;
}
