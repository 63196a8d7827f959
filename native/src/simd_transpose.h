/* simd_transpose.h: a 16 x 16 transpose of 32-bit lanes in AVX-512 registers, for
 * the AMX paths: C tiles hold (weight row, token) and the outputs are token-major;
 * the BF16 activation panels hold (column pair, token) and x is token-major. */
#ifndef KT_SIMD_TRANSPOSE_H
#define KT_SIMD_TRANSPOSE_H

#if defined(__AVX512F__)
#include <immintrin.h>

/* r[i] lane j -> r[j] lane i. Three stages, on 128-bit lanes L (columns 4L..4L+3):
 * unpack pairs rows (2i, 2i+1); shuffle_ps then gives r[4i+j] lane L = column 4L+j of
 * rows 4i..4i+3; shuffle_f32x4 twice collects a column's four lanes L from r[j],
 * r[4+j], r[8+j], r[12+j]. */
static inline void transpose16_ps(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);        /* lanes 0, 2 */
        __m512 b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);        /* lanes 1, 3 */
        __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        __m512 d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
        t[j] = _mm512_shuffle_f32x4(a, c, 0x88);                      /* column j */
        t[8 + j] = _mm512_shuffle_f32x4(a, c, 0xDD);                  /* column 8 + j */
        t[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);                  /* column 4 + j */
        t[12 + j] = _mm512_shuffle_f32x4(b, d, 0xDD);                 /* column 12 + j */
    }
    for (int i = 0; i < 16; i++)
        r[i] = t[i];
}

#endif
#endif
