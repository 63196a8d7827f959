/* numa.c: where the pool's workers run and where expert weights live on hosts
 * with several NUMA nodes. Linux only; every call is KT_EUNSUPPORTED elsewhere.
 *
 * Workers
 *   kt_pool_pin_workers gives each worker thread one CPU (pthread_setaffinity_np).
 *   The caller's thread is left as it is: it runs Python and torch too.
 *
 * Memory
 *   kt_mem_interleave sets the policy MPOL_INTERLEAVE on the whole pages of a
 *   range (mbind, as a raw syscall: no libnuma) and asks the kernel to move the
 *   pages already allocated (MPOL_MF_MOVE). Consecutive pages then lie on
 *   consecutive nodes of the list, so one copy of the weights is split evenly
 *   across every node's memory controllers and all of them serve a decode step
 *   (what `numactl --interleave=all` does to a whole process, here only for the
 *   ranges asked for). Without MPOL_MF_STRICT a page the kernel cannot move (shared
 *   with another process) stays where it is without an error.
 *   mbind gives the range its own memory mappings (VMAs): callers should join
 *   neighbouring ranges, as the Linux limit on mappings per process is ~65k.
 */
#define _GNU_SOURCE

#include <errno.h>
#include <limits.h>
#include <string.h>
#include "kt_internal.h"

#if defined(__linux__)
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* Linux uapi <linux/mempolicy.h>: mbind modes and flags (kernel ABI, stable). */
#define KT_MPOL_INTERLEAVE 3
#define KT_MPOL_MF_MOVE (1 << 1)

#define KT_MAX_NODES 1024          /* node ids 0..1023: the kernel's MAX_NUMNODES on x86-64 distributions */
#define KT_MAX_CPUS 1024           /* glibc's CPU_SETSIZE */
#define MASK_BITS_PER_WORD (CHAR_BIT * sizeof(unsigned long))
#define MASK_WORDS (KT_MAX_NODES / MASK_BITS_PER_WORD)

/* ---- worker pinning ------------------------------------------------------------ */

static int cpus_valid(const int32_t *cpus, int32_t n_cpus)
{
    if (!cpus || n_cpus < 1)
        return 0;
    for (int32_t i = 0; i < n_cpus; i++)
        if (cpus[i] < 0 || cpus[i] >= KT_MAX_CPUS)
            return 0;
    return 1;
}

#if defined(__linux__)
static int pin_thread(pthread_t thread, int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    int rc = pthread_setaffinity_np(thread, sizeof set, &set);
    if (rc == 0)
        return KT_OK;
    return rc == EINVAL ? KT_EINVAL : KT_EUNSUPPORTED;
}
#endif

int kt_pool_pin_workers(kt_pool *pool, const int32_t *cpus, int32_t n_cpus)
{
    if (!pool || !cpus_valid(cpus, n_cpus))
        return KT_EINVAL;
#if defined(__linux__)
    int status = KT_OK;
    int n_workers = kt_pool_worker_count(pool);
    for (int w = 0; w < n_workers; w++) {
        int rc = pin_thread(kt_pool_worker_thread(pool, w), cpus[w % n_cpus]);
        if (rc != KT_OK)
            status = rc;
    }
    return status;
#else
    return KT_EUNSUPPORTED;
#endif
}

/* ---- interleaved memory ---------------------------------------------------------- */

static int nodes_to_mask(unsigned long mask[MASK_WORDS], const int32_t *nodes, int32_t n_nodes)
{
    if (!nodes || n_nodes < 1 || n_nodes > KT_MAX_NODES)
        return KT_EINVAL;
    memset(mask, 0, MASK_WORDS * sizeof(unsigned long));
    for (int32_t i = 0; i < n_nodes; i++) {
        if (nodes[i] < 0 || nodes[i] >= KT_MAX_NODES)
            return KT_EINVAL;
        mask[nodes[i] / MASK_BITS_PER_WORD] |= 1UL << (nodes[i] % MASK_BITS_PER_WORD);
    }
    return KT_OK;
}

#if defined(__linux__) && defined(SYS_mbind)
static int status_of_errno(int err)
{
    switch (err) {
    case ENOSYS: case EPERM: return KT_EUNSUPPORTED;
    case ENOMEM: return KT_ENOMEM;
    default: return KT_EINVAL;     /* EINVAL, EFAULT (a hole in the range), EIO */
    }
}

/* The whole pages inside [addr, addr + bytes): start rounded up, end rounded down. */
static int interleave_pages(uintptr_t start, uintptr_t end, const unsigned long *mask)
{
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        return KT_EUNSUPPORTED;
    uintptr_t first = (start + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
    uintptr_t last = end & ~((uintptr_t)page - 1);
    if (first >= last)
        return KT_OK;
    /* maxnode counts one bit more than the mask holds: the kernel reads maxnode - 1 bits */
    long rc = syscall(SYS_mbind, (void *)first, (unsigned long)(last - first), KT_MPOL_INTERLEAVE,
                      mask, (unsigned long)KT_MAX_NODES + 1, (unsigned)KT_MPOL_MF_MOVE);
    return rc == 0 ? KT_OK : status_of_errno(errno);
}
#endif

int kt_mem_interleave(void *addr, int64_t bytes, const int32_t *nodes, int32_t n_nodes)
{
    unsigned long mask[MASK_WORDS];
    uintptr_t start = (uintptr_t)addr;
    if (!addr || bytes <= 0 || (uint64_t)bytes > UINTPTR_MAX - start)
        return KT_EINVAL;
    if (nodes_to_mask(mask, nodes, n_nodes) != KT_OK)
        return KT_EINVAL;
#if defined(__linux__) && defined(SYS_mbind)
    return interleave_pages(start, start + (uintptr_t)bytes, mask);
#else
    return KT_EUNSUPPORTED;
#endif
}
