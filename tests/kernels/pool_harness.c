/* pool_harness.c: drives native/src/threadpool.c's internal job API (not in the
 * cffi ABI) for tests/kernels/test_pool.py. Prints one line per check:
 * "ok <name>" or "FAIL <name>: <detail>". */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "kt_internal.h"

#define MAX_TASKS 5000

struct counts {
    _Atomic int runs[MAX_TASKS];
    _Atomic int bad_thread;
    _Atomic int last_thread_runs;   /* tasks run as thread n_threads - 1 */
    int n_threads;
    int sleep_us;
};

static void count_task(void *ctx, int64_t task, int thread)
{
    struct counts *c = ctx;
    if (c->sleep_us) {
        struct timespec ts = {0, (long)c->sleep_us * 1000};
        nanosleep(&ts, NULL);
    }
    if (thread < 0 || thread >= c->n_threads)
        atomic_fetch_add(&c->bad_thread, 1);
    if (thread == c->n_threads - 1)
        atomic_fetch_add(&c->last_thread_runs, 1);
    atomic_fetch_add(&c->runs[task], 1);
}

static int each_once(struct counts *c, int64_t n, const char *name)
{
    for (int64_t t = 0; t < n; t++)
        if (atomic_load(&c->runs[t]) != 1) {
            printf("FAIL %s: task %lld ran %d times\n", name, (long long)t, atomic_load(&c->runs[t]));
            return 0;
        }
    if (atomic_load(&c->bad_thread)) {
        printf("FAIL %s: thread index out of range\n", name);
        return 0;
    }
    return 1;
}

static void reset(struct counts *c, int n_threads, int sleep_us)
{
    for (int t = 0; t < MAX_TASKS; t++)
        atomic_store(&c->runs[t], 0);
    atomic_store(&c->bad_thread, 0);
    atomic_store(&c->last_thread_runs, 0);
    c->n_threads = n_threads;
    c->sleep_us = sleep_us;
}

static void check_sync(kt_pool *pool, int threads, struct counts *c)
{
    static const int64_t sizes[] = {0, 1, 2, 7, 64, MAX_TASKS};
    char name[64];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        reset(c, threads, 0);
        kt_pool_run(pool, count_task, c, sizes[i]);
        snprintf(name, sizeof name, "sync threads=%d tasks=%lld", threads, (long long)sizes[i]);
        if (each_once(c, sizes[i], name))
            printf("ok %s\n", name);
    }
    int ok = 1;                              /* many back-to-back small jobs */
    for (int rep = 0; rep < 3000 && ok; rep++) {
        reset(c, threads, 0);
        kt_pool_run(pool, count_task, c, 1 + rep % 5);
        ok = each_once(c, 1 + rep % 5, "sync repeated");
    }
    if (ok)
        printf("ok sync repeated threads=%d\n", threads);
}

static void check_async(kt_pool *pool, int threads, struct counts *c)
{
    char name[64];
    snprintf(name, sizeof name, "async threads=%d", threads);
    reset(c, threads, 2000);                 /* 8 tasks of 2 ms each */
    if (kt_pool_run_async(pool, count_task, c, 8) != KT_OK) {
        printf("FAIL %s: submit refused\n", name);
        return;
    }
    int started_done = 0;
    for (int t = 0; t < 8; t++)
        started_done += atomic_load(&c->runs[t]);
    int busy = kt_pool_run_async(pool, count_task, c, 8) == KT_EBUSY;
    int waited = kt_pool_wait(pool) == KT_OK;
    if (started_done == 8)
        printf("FAIL %s: all tasks had finished before submit returned\n", name);
    else if (!busy)
        printf("FAIL %s: second submit was not refused with KT_EBUSY\n", name);
    else if (threads > 1 && atomic_load(&c->last_thread_runs) == 0)   /* 16 ms of work left to share */
        printf("FAIL %s: the waiting caller (thread %d) ran none of the tasks\n", name, threads - 1);
    else if (waited && each_once(c, 8, name))
        printf("ok %s\n", name);
    reset(c, threads, 0);                    /* a sync job right after an async one */
    kt_pool_run_async(pool, count_task, c, 100);
    kt_pool_run(pool, count_task, c, 50);
    kt_pool_wait(pool);
    snprintf(name, sizeof name, "async then sync threads=%d", threads);
    int ok = 1;
    for (int t = 0; t < 100; t++)
        ok &= atomic_load(&c->runs[t]) == (t < 50 ? 2 : 1);
    printf(ok ? "ok %s\n" : "FAIL %s: task counts wrong\n", name);
}

static double cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Process CPU time while the pool idles for 100 ms after a job, the workers
 * spinning `rounds` before they sleep. */
static double idle_cpu_ms(kt_pool *pool, int32_t rounds, struct counts *c)
{
    kt_pool_set_spin(pool, rounds);
    reset(c, kt_pool_threads(pool), 0);
    kt_pool_run(pool, count_task, c, 64);
    double before = cpu_ms();
    struct timespec ts = {0, 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
    return cpu_ms() - before;
}

/* kt_pool_set_spin: bounds checked; with 0 idle workers sleep at once (no CPU
 * while idle), with 2^24 rounds they poll through the whole 100 ms; jobs run
 * every task once either way. */
static void check_spin(struct counts *c)
{
    kt_pool *pool = kt_pool_new(3);
    const char *name = "spin control threads=3";
    if (kt_pool_set_spin(pool, -2) != KT_EINVAL || kt_pool_set_spin(pool, (1 << 24) + 1) != KT_EINVAL ||
        kt_pool_set_spin(NULL, 0) != KT_EINVAL) {
        printf("FAIL %s: bad spin counts accepted\n", name);
    } else {
        double spinning = idle_cpu_ms(pool, 1 << 24, c), sleeping = idle_cpu_ms(pool, 0, c);
        int ok = 1;
        for (int rep = 0; rep < 300 && ok; rep++) {     /* every job wakes sleeping workers */
            reset(c, 3, 0);
            kt_pool_run(pool, count_task, c, 1 + rep % 7);
            ok = each_once(c, 1 + rep % 7, name);
        }
        if (ok && (sleeping > 15.0 || spinning < 30.0))
            printf("FAIL %s: idle CPU %.1f ms sleeping, %.1f ms spinning\n", name, sleeping, spinning);
        else if (ok)
            printf("ok %s\n", name);
    }
    kt_pool_free(pool);
}

int main(void)
{
    static struct counts c;
    static const int thread_counts[] = {1, 2, 3, 8};
    if (kt_pool_new(0) != NULL || kt_pool_threads(NULL) != 0)
        printf("FAIL bad sizes: pool of 0 threads accepted\n");
    else
        printf("ok bad sizes\n");
    for (size_t i = 0; i < 4; i++) {
        kt_pool *pool = kt_pool_new(thread_counts[i]);
        if (!pool || kt_pool_threads(pool) != thread_counts[i]) {
            printf("FAIL new threads=%d\n", thread_counts[i]);
            continue;
        }
        check_sync(pool, thread_counts[i], &c);
        check_async(pool, thread_counts[i], &c);
        kt_pool_free(pool);
    }
    check_spin(&c);
    return 0;
}
