/* threadpool.c: persistent worker threads that run one job at a time.
 *
 * Threads
 *   A pool of n threads keeps max(n - 1, 1) worker threads.
 *   - kt_pool_run (synchronous): the caller is thread 0 and worker w is thread
 *     w + 1; with n == 1 the caller runs every task alone.
 *   - kt_pool_run_async: only the workers run, worker w being thread w; so with
 *     n == 1 the single worker computes while the caller goes on, and with n > 1
 *     the caller's core stays free for other work (the GPU side, Python). When
 *     the caller then waits (kt_pool_wait) with n > 1, it joins the job as
 *     thread n - 1 for the tasks left: with nothing to overlap (CPU-only decode
 *     of a layer without shared experts) the job still gets every core.
 *
 * Task hand-out
 *   One 64-bit atomic `ticket` = (job sequence << 40) | next task index. A thread
 *   claims a task with a compare-and-swap that also checks the sequence, so a
 *   worker that is late from an earlier job can never claim (or run with the old
 *   function) a task of the next one. Before the job fields are rewritten the
 *   ticket is first set to (new sequence, CLOSED), which fails every stale CAS.
 *
 * Sleeping
 *   Idle workers spin briefly on the ticket (back-to-back kernels stay cheap),
 *   then sleep on a condition variable; kt_pool_set_spin shortens the spin
 *   while other threads (torch's) need the cores between kernels. The thread that completes the last task
 *   marks the job done and wakes whoever waits for it.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include "kt_internal.h"

#define SEQ_SHIFT 40
#define INDEX_MASK ((UINT64_C(1) << SEQ_SHIFT) - 1)
#define CLOSED INDEX_MASK
#define SPIN_ROUNDS 16384         /* ~0.2-2 ms of pause: covers the Python gap between kernels */
#define MAX_SPIN_ROUNDS (1 << 24)

struct kt_pool {
    int n_threads;
    int n_workers;
    pthread_t *workers;

    pthread_mutex_t mu;
    pthread_cond_t wake;        /* workers: a new job was posted (or stop) */
    pthread_cond_t finished;    /* callers: the current job is done */
    int sleepers;               /* workers waiting on `wake` (under mu) */
    int done;                   /* the current job is finished (under mu) */
    int async_pending;          /* an async job was posted and not yet waited (under mu) */

    _Atomic uint64_t ticket;
    _Atomic int64_t tasks_done;
    _Atomic int done_flag;      /* mirror of `done` for spinning waiters */
    _Atomic int stop;
    _Atomic int32_t idle_spin;  /* kt_pool_set_spin: rounds an idle worker spins before sleeping */
    int amx_tiles;              /* kt_pool_set_amx_tiles; read by the kernels' callers */

    /* the current job; written only while no job runs and the ticket is CLOSED */
    kt_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    int async;
};

struct worker_arg {
    kt_pool *pool;
    int index;
};

/* ---- running tasks ----------------------------------------------------------- */

static int claim_task(kt_pool *pool, uint64_t seq, int64_t n_tasks, int64_t *task)
{
    uint64_t t = atomic_load_explicit(&pool->ticket, memory_order_acquire);
    for (;;) {
        if ((t >> SEQ_SHIFT) != seq || (int64_t)(t & INDEX_MASK) >= n_tasks)
            return 0;
        if (atomic_compare_exchange_weak_explicit(&pool->ticket, &t, t + 1,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            *task = (int64_t)(t & INDEX_MASK);
            return 1;
        }
    }
}

static void mark_done(kt_pool *pool)
{
    pthread_mutex_lock(&pool->mu);
    pool->done = 1;
    atomic_store_explicit(&pool->done_flag, 1, memory_order_release);
    pthread_cond_broadcast(&pool->finished);
    pthread_mutex_unlock(&pool->mu);
}

/* Runs tasks of job `seq` until none is left. fn/ctx/n were read after the ticket
 * showed `seq` open, so they belong to it whenever a claim succeeds. */
static void run_tasks(kt_pool *pool, uint64_t seq, kt_task_fn fn, void *ctx, int64_t n, int thread)
{
    int64_t task;
    while (claim_task(pool, seq, n, &task)) {
        fn(ctx, task, thread);
        if (atomic_fetch_add_explicit(&pool->tasks_done, 1, memory_order_acq_rel) + 1 == n)
            mark_done(pool);
    }
}

/* ---- workers ----------------------------------------------------------------- */

static int job_open(uint64_t t, uint64_t seen_seq)
{
    return (t >> SEQ_SHIFT) != seen_seq && (t & INDEX_MASK) != CLOSED;
}

static uint64_t wait_for_job(kt_pool *pool, uint64_t seen_seq)
{
    int32_t rounds = atomic_load_explicit(&pool->idle_spin, memory_order_relaxed);
    for (int32_t i = 0; i < rounds; i++) {
        uint64_t t = atomic_load_explicit(&pool->ticket, memory_order_acquire);
        if (job_open(t, seen_seq) || atomic_load_explicit(&pool->stop, memory_order_acquire))
            return t;
        cpu_relax();
    }
    pthread_mutex_lock(&pool->mu);
    uint64_t t = atomic_load_explicit(&pool->ticket, memory_order_acquire);
    while (!job_open(t, seen_seq) && !atomic_load_explicit(&pool->stop, memory_order_acquire)) {
        pool->sleepers++;
        pthread_cond_wait(&pool->wake, &pool->mu);
        pool->sleepers--;
        t = atomic_load_explicit(&pool->ticket, memory_order_acquire);
    }
    pthread_mutex_unlock(&pool->mu);
    return t;
}

static void *worker_main(void *arg_)
{
    struct worker_arg *arg = arg_;
    kt_pool *pool = arg->pool;
    int index = arg->index;
    free(arg);
    uint64_t seen_seq = 0;
    for (;;) {
        uint64_t t = wait_for_job(pool, seen_seq);
        if (atomic_load_explicit(&pool->stop, memory_order_acquire))
            return NULL;
        seen_seq = t >> SEQ_SHIFT;
        int thread = pool->async ? index : index + 1;
        if (thread < pool->n_threads)
            run_tasks(pool, seen_seq, pool->fn, pool->ctx, pool->n_tasks, thread);
    }
}

/* ---- lifecycle --------------------------------------------------------------- */

static int start_workers(kt_pool *pool)
{
    for (int w = 0; w < pool->n_workers; w++) {
        struct worker_arg *arg = malloc(sizeof *arg);
        if (!arg)
            return w;
        arg->pool = pool;
        arg->index = w;
        if (pthread_create(&pool->workers[w], NULL, worker_main, arg) != 0) {
            free(arg);
            return w;
        }
    }
    return pool->n_workers;
}

static void stop_workers(kt_pool *pool, int started)
{
    pthread_mutex_lock(&pool->mu);
    atomic_store_explicit(&pool->stop, 1, memory_order_release);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);
    for (int w = 0; w < started; w++)
        pthread_join(pool->workers[w], NULL);
}

kt_pool *kt_pool_new(int n_threads)
{
    if (n_threads < 1 || n_threads > 4096)
        return NULL;
    kt_pool *pool = calloc(1, sizeof *pool);
    if (!pool)
        return NULL;
    pool->n_threads = n_threads;
    pool->n_workers = n_threads > 1 ? n_threads - 1 : 1;
    pool->workers = calloc((size_t)pool->n_workers, sizeof(pthread_t));
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->finished, NULL);
    pool->done = 1;
    atomic_init(&pool->done_flag, 1);
    atomic_init(&pool->ticket, CLOSED);
    atomic_init(&pool->tasks_done, 0);
    atomic_init(&pool->stop, 0);
    atomic_init(&pool->idle_spin, SPIN_ROUNDS);
    int started = pool->workers ? start_workers(pool) : -1;
    if (started != pool->n_workers) {
        stop_workers(pool, started < 0 ? 0 : started);
        pthread_cond_destroy(&pool->wake);
        pthread_cond_destroy(&pool->finished);
        pthread_mutex_destroy(&pool->mu);
        free(pool->workers);
        free(pool);
        return NULL;
    }
    return pool;
}

static void wait_done_locked(kt_pool *pool)
{
    while (!pool->done)
        pthread_cond_wait(&pool->finished, &pool->mu);
}

void kt_pool_free(kt_pool *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->mu);
    wait_done_locked(pool);
    pthread_mutex_unlock(&pool->mu);
    stop_workers(pool, pool->n_workers);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->finished);
    pthread_mutex_destroy(&pool->mu);
    free(pool->workers);
    free(pool);
}

int kt_pool_threads(const kt_pool *pool)
{
    return pool ? pool->n_threads : 0;
}

int kt_pool_worker_count(const kt_pool *pool)
{
    return pool ? pool->n_workers : 0;
}

pthread_t kt_pool_worker_thread(const kt_pool *pool, int w)
{
    return pool->workers[w];
}

int kt_pool_set_spin(kt_pool *pool, int32_t rounds)
{
    if (!pool || rounds < -1 || rounds > MAX_SPIN_ROUNDS)
        return KT_EINVAL;
    atomic_store_explicit(&pool->idle_spin, rounds < 0 ? SPIN_ROUNDS : rounds, memory_order_relaxed);
    return KT_OK;
}

int kt_pool_set_amx_tiles(kt_pool *pool, int enabled)
{
    if (!pool)
        return KT_EINVAL;
#if defined(KT_AMX_BUILD)
    if (enabled && kt_amx_request_permission() != KT_OK)
        return KT_EUNSUPPORTED;
    pool->amx_tiles = enabled != 0;
    return KT_OK;
#else
    return enabled ? KT_EUNSUPPORTED : KT_OK;
#endif
}

int kt_pool_amx_tiles(const kt_pool *pool)
{
    return pool ? pool->amx_tiles : 0;
}

/* ---- posting jobs ------------------------------------------------------------ */

/* Called with mu held and the previous job done. Returns the new job's sequence. */
static uint64_t post_locked(kt_pool *pool, kt_task_fn fn, void *ctx, int64_t n_tasks, int async)
{
    uint64_t seq = (atomic_load_explicit(&pool->ticket, memory_order_relaxed) >> SEQ_SHIFT) + 1;
    seq &= (UINT64_C(1) << (64 - SEQ_SHIFT)) - 1;
    atomic_store_explicit(&pool->ticket, (seq << SEQ_SHIFT) | CLOSED, memory_order_seq_cst);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_tasks = n_tasks;
    pool->async = async;
    pool->done = 0;
    atomic_store_explicit(&pool->done_flag, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->tasks_done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->ticket, seq << SEQ_SHIFT, memory_order_release);
    if (pool->sleepers > 0)
        pthread_cond_broadcast(&pool->wake);
    return seq;
}

static void wait_done(kt_pool *pool)
{
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        if (atomic_load_explicit(&pool->done_flag, memory_order_acquire))
            break;
        cpu_relax();
    }
    pthread_mutex_lock(&pool->mu);
    wait_done_locked(pool);
    pthread_mutex_unlock(&pool->mu);
}

void kt_pool_run(kt_pool *pool, kt_task_fn fn, void *ctx, int64_t n_tasks)
{
    if (!pool || !fn || n_tasks <= 0)
        return;
    if (n_tasks >= (int64_t)CLOSED)
        return;
    if (pool->n_threads == 1) {
        pthread_mutex_lock(&pool->mu);
        wait_done_locked(pool);     /* an async job may still run on the worker */
        for (int64_t t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        pthread_mutex_unlock(&pool->mu);
        return;
    }
    pthread_mutex_lock(&pool->mu);
    wait_done_locked(pool);
    uint64_t seq = post_locked(pool, fn, ctx, n_tasks, 0);
    pthread_mutex_unlock(&pool->mu);
    run_tasks(pool, seq, fn, ctx, n_tasks, 0);
    wait_done(pool);
}

int kt_pool_run_async(kt_pool *pool, kt_task_fn fn, void *ctx, int64_t n_tasks)
{
    if (!pool || !fn || n_tasks < 0 || n_tasks >= (int64_t)CLOSED)
        return KT_EINVAL;
    pthread_mutex_lock(&pool->mu);
    if (!pool->done || pool->async_pending) {
        pthread_mutex_unlock(&pool->mu);
        return KT_EBUSY;
    }
    if (n_tasks > 0)
        post_locked(pool, fn, ctx, n_tasks, 1);
    pool->async_pending = 1;
    pthread_mutex_unlock(&pool->mu);
    return KT_OK;
}

/* The caller of kt_pool_wait runs what is left of the async job as thread
 * n - 1 (the workers are threads 0 .. n - 2 in async jobs). The job is read
 * under mu; claim_task checks its sequence, so a later job is never touched. */
static void join_async_job(kt_pool *pool)
{
    pthread_mutex_lock(&pool->mu);
    int join = pool->n_threads > 1 && pool->async && !pool->done;
    uint64_t seq = atomic_load_explicit(&pool->ticket, memory_order_acquire) >> SEQ_SHIFT;
    kt_task_fn fn = pool->fn;
    void *ctx = pool->ctx;
    int64_t n = pool->n_tasks;
    pthread_mutex_unlock(&pool->mu);
    if (join)
        run_tasks(pool, seq, fn, ctx, n, pool->n_threads - 1);
}

int kt_pool_wait(kt_pool *pool)
{
    if (!pool)
        return KT_EINVAL;
    join_async_job(pool);
    wait_done(pool);
    pthread_mutex_lock(&pool->mu);
    pool->async_pending = 0;
    pthread_mutex_unlock(&pool->mu);
    return KT_OK;
}
