/* threadbuf.c: per-thread buffers that grow on demand and are kept between
 * calls, so steady-state kernels allocate nothing; freed when the thread exits.
 * Slots keep independent users apart on one thread (the caller of kt_linear
 * holds its activations in one while it also runs tasks that use another). */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdlib.h>
#include "kt_internal.h"

struct thread_bufs {
    void *p[KT_THREAD_BUF_SLOTS];
    size_t cap[KT_THREAD_BUF_SLOTS];
};

static pthread_key_t bufs_key;
static pthread_once_t bufs_once = PTHREAD_ONCE_INIT;

static void bufs_free(void *b_)
{
    struct thread_bufs *b = b_;
    for (int i = 0; i < KT_THREAD_BUF_SLOTS; i++)
        free(b->p[i]);
    free(b);
}

static void bufs_key_init(void) { pthread_key_create(&bufs_key, bufs_free); }

void *kt_thread_buffer(int slot, size_t bytes)
{
    if (slot < 0 || slot >= KT_THREAD_BUF_SLOTS)
        return NULL;
    pthread_once(&bufs_once, bufs_key_init);
    struct thread_bufs *b = pthread_getspecific(bufs_key);
    if (!b) {
        b = calloc(1, sizeof *b);
        if (!b || pthread_setspecific(bufs_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    if (bytes > b->cap[slot]) {
        void *p = NULL;
        if (posix_memalign(&p, 64, bytes) != 0)
            return NULL;
        free(b->p[slot]);
        b->p[slot] = p;
        b->cap[slot] = bytes;
    }
    return b->p[slot];
}
