/* numa_harness.c: pins a pool's workers (native/src/numa.c) and checks, with
 * sched_getcpu() inside tasks, that tasks run by workers execute on the pinned
 * CPU while the caller's affinity stays as it was. For tests/kernels/test_numa.py.
 * Usage: numa_harness CPU. Prints "ok <name>" or "FAIL <name>: <detail>" per check. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "kt_internal.h"

#define N_TASKS 48

struct where {
    int caller;                   /* the thread index the caller runs tasks as */
    int target;                   /* the CPU the workers are pinned to */
    _Atomic int worker_tasks;     /* tasks run by workers */
    _Atomic int worker_elsewhere; /* ... on another CPU than target */
    _Atomic int last_bad_cpu;
};

static void record_cpu(void *ctx, int64_t task, int thread)
{
    struct where *w = ctx;
    (void)task;
    struct timespec ts = {0, 200 * 1000};
    nanosleep(&ts, NULL);          /* long enough for every worker to claim tasks */
    if (thread == w->caller)
        return;
    atomic_fetch_add(&w->worker_tasks, 1);
    int cpu = sched_getcpu();
    if (cpu != w->target) {
        atomic_fetch_add(&w->worker_elsewhere, 1);
        atomic_store(&w->last_bad_cpu, cpu);
    }
}

static void report(const char *name, struct where *w)
{
    if (atomic_load(&w->worker_tasks) == 0)
        printf("FAIL %s: no task ran on a worker\n", name);
    else if (atomic_load(&w->worker_elsewhere))
        printf("FAIL %s: %d of %d worker tasks ran off cpu %d (last on %d)\n", name,
               atomic_load(&w->worker_elsewhere), atomic_load(&w->worker_tasks), w->target,
               atomic_load(&w->last_bad_cpu));
    else
        printf("ok %s\n", name);
}

/* Each worker's affinity mask, as the OS reports it, is exactly {cpu}. */
static int workers_masked(kt_pool *pool, int cpu, const char *name)
{
    for (int w = 0; w < kt_pool_worker_count(pool); w++) {
        cpu_set_t set;
        if (pthread_getaffinity_np(kt_pool_worker_thread(pool, w), sizeof set, &set) != 0
            || CPU_COUNT(&set) != 1 || !CPU_ISSET(cpu, &set)) {
            printf("FAIL %s: worker %d's affinity is not {%d} (%d CPUs)\n", name, w, cpu, CPU_COUNT(&set));
            return 0;
        }
    }
    return 1;
}

static kt_pool *pinned_pool(int threads, int cpu, const char *name)
{
    kt_pool *pool = kt_pool_new(threads);
    int32_t cpus[1] = {cpu};
    int rc = pool ? kt_pool_pin_workers(pool, cpus, 1) : KT_ENOMEM;
    if (rc != KT_OK)
        printf("FAIL %s: kt_pool_pin_workers returned %d\n", name, rc);
    if (rc != KT_OK || !workers_masked(pool, cpu, name)) {
        kt_pool_free(pool);
        return NULL;
    }
    return pool;
}

static void check_sync(int threads, int cpu)
{
    char name[64];
    snprintf(name, sizeof name, "pinned sync threads=%d", threads);
    kt_pool *pool = pinned_pool(threads, cpu, name);
    if (!pool)
        return;
    struct where w = {.caller = 0, .target = cpu};
    kt_pool_run(pool, record_cpu, &w, N_TASKS);
    report(name, &w);
    kt_pool_free(pool);
}

/* Async: workers are threads 0 .. n - 2; the caller joins in kt_pool_wait as n - 1
 * (only when n > 1). */
static void check_async(int threads, int cpu)
{
    char name[64];
    snprintf(name, sizeof name, "pinned async threads=%d", threads);
    kt_pool *pool = pinned_pool(threads, cpu, name);
    if (!pool)
        return;
    struct where w = {.caller = threads > 1 ? threads - 1 : -1, .target = cpu};
    if (kt_pool_run_async(pool, record_cpu, &w, N_TASKS) != KT_OK)
        printf("FAIL %s: kt_pool_run_async refused\n", name);
    struct timespec ts = {0, 2 * 1000 * 1000};
    nanosleep(&ts, NULL);
    kt_pool_wait(pool);
    report(name, &w);
    kt_pool_free(pool);
}

static void check_caller_untouched(int cpu)
{
    cpu_set_t before, after;
    sched_getaffinity(0, sizeof before, &before);
    kt_pool *pool = pinned_pool(3, cpu, "caller affinity untouched");
    if (!pool)
        return;
    sched_getaffinity(0, sizeof after, &after);
    kt_pool_free(pool);
    if (!CPU_EQUAL(&before, &after))
        printf("FAIL caller affinity untouched: %d CPUs before, %d after\n", CPU_COUNT(&before), CPU_COUNT(&after));
    else
        printf("ok caller affinity untouched\n");
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CPU\n", argv[0]);
        return 2;
    }
    int cpu = atoi(argv[1]);
    for (int threads = 1; threads <= 3; threads++) {
        if (threads > 1)            /* one thread: the caller runs a sync job alone */
            check_sync(threads, cpu);
        check_async(threads, cpu);
    }
    check_caller_untouched(cpu);
    return 0;
}
