/* The vector width of tandem's CPU attention kernels, chosen when they are compiled from the target's features:
 * 16 floats (one 512-bit register) where the target has AVX-512, 8 (one 256-bit AVX2 register, or two NEON ones)
 * elsewhere. GCC/Clang vector extensions of that width, and the few helpers the kernels share.
 *
 * native.py compiles for this machine (-march=native) or, with TANDEM_CPU_ISA=avx2, for an AVX2-only x86 CPU
 * (-march=x86-64-v3), so the 8-float variant can run on an AVX-512 host too. Every lane computes the same float
 * operations in the same order at either width, and lane sums go over 16-float chunks (hsum16): neither kernel's
 * results depend on it.
 */
#ifndef TANDEM_SIMD_H
#define TANDEM_SIMD_H
#include <stdint.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif

typedef float vf __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4)));     /* unaligned loads and stores */
typedef int32_t vi __attribute__((vector_size(4 * VW)));

static inline vf ld(const float *p) { return *(const vfu *)p; }
static inline void st(float *p, vf v) { *(vfu *)p = v; }
static inline vf splat(float x) { return (vf){0} + x; }
/* lanes of a where m is set (all ones), of b elsewhere: C has no ?: on vectors */
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

/* Vectors per 16-float chunk: 1 with AVX-512, 2 with AVX2. Lane sums are taken over 16-float chunks held as VPC
 * vectors, so they add the same floats in the same order at either width. */
#define VPC (16 / VW)
typedef float vh8 __attribute__((vector_size(32)));
typedef float vh4 __attribute__((vector_size(16)));

/* The sum of a 16-float chunk's lanes (a[0 .. VPC-1]): its two 8-float halves added, then halving again. */
static inline float hsum16(const vf *a)
{
#if VW == 16
    union { vf v; vh8 h[2]; } u = { a[0] };
    const vh8 x = u.h[0] + u.h[1];
#else
    const vh8 x = (vh8)(a[0] + a[1]);
#endif
    union { vh8 v; vh4 h[2]; } w = { x };
    const vh4 y = w.h[0] + w.h[1];
    return (y[0] + y[2]) + (y[1] + y[3]);
}

/* exp(x) on VW lanes for x <= 0 (scores minus their running max): x = n ln2 + r with n an integer (the exponent
 * bits) and |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts), exp(r) from its degree-7 Taylor polynomial. Relative
 * error under 1.1e-7 on [-87, 0], as expf's rounding. */
static inline vf vexp_nonpos(vf x)
{
    const vf lo = splat(-87.0f), magic = splat(12582912.0f);          /* 1.5 * 2^23: round to nearest */
    x = vsel(x < lo, lo, x);
    const vf n = (x * splat(1.44269504088896341f) + magic) - magic;
    const vf r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
    vf p = splat(1.0f / 5040.0f);
    p = p * r + splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

#endif
