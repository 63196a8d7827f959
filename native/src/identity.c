/* identity.c: what this build is, so the loader can confirm it loaded the
 * variant it asked for, and the AMX permission request Linux requires. */

#define _GNU_SOURCE
#include <stdint.h>
#include "kt.h"

#ifndef KT_VARIANT
#error "KT_VARIANT must name the build variant (set by native/build.py)"
#endif

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#define KT_ARCH_REQ_XCOMP_PERM 0x1023
#define KT_XFEATURE_XTILEDATA 18
#endif

const char *kt_variant_name(void) { return KT_VARIANT; }

int kt_abi_version(void) { return 11; }

/* Linux keeps the 8 KiB AMX tile state off until a process asks for it; an AMX
 * instruction before that raises SIGILL even on hardware that has AMX. */
int kt_amx_request_permission(void)
{
#if defined(__linux__) && defined(__x86_64__)
    long rc = syscall(SYS_arch_prctl, KT_ARCH_REQ_XCOMP_PERM, KT_XFEATURE_XTILEDATA);
    return rc == 0 ? KT_OK : KT_EUNSUPPORTED;
#else
    return KT_EUNSUPPORTED;
#endif
}

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* Only the OS decides whether AVX (XCR0 bits 1-2), AVX-512 (bits 5-7) and AMX
 * (bits 17-18) register state is saved across context switches; a CPU flag
 * without that bit set still faults. xgetbv itself needs OSXSAVE (CPUID.1:ECX.27). */
uint64_t kt_os_xcr0(void)
{
#if defined(__x86_64__) || defined(__i386__)
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27)))
        return 0;
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
#else
    return 0;
#endif
}
