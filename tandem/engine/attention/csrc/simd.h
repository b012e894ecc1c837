/* The vector width of tandem's CPU attention kernels, chosen when they are compiled from the target's features:
 * 16 floats (one 512-bit register) where the target has AVX-512, 8 (one 256-bit AVX2 register, or two NEON ones)
 * elsewhere. GCC/Clang vector extensions of that width, and the few helpers the kernels share.
 *
 * native.py compiles for this machine (-march=native) or, with TANDEM_CPU_ISA=avx2, for an AVX2-only x86 CPU
 * (-march=x86-64-v3), so the 8-float variant can run on an AVX-512 host too. Every lane computes the same float
 * operations in the same order at either width: the prefill kernel's results do not depend on it.
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

#endif
