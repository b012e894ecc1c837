/* Paged decode attention for the CPU: each decode query attends to its sequence's K/V read in place from the
 * paged cache, in one pass with an online softmax (no gather into a contiguous copy, no second read).
 *
 * Layouts (float32, contiguous): q [T, Hq, D]; kv [2, num_blocks, block_size, Hkv, D]; block_tables int32
 * [S, max_blocks]; out [T, Hq, D]. Work item i attends query row rows[i] to the first seq_lens[i] tokens of the
 * sequence whose block-table row is seqs[i]. All heads of a sequence are done together, so each key and value
 * is read once per step. Sequences are spread over `nthreads` OpenMP threads.
 *
 * Built at run time by tandem/engine/attention/native.py with the machine's compiler (-O3 -march=native
 * -fopenmp); every loop over D is an `omp simd` reduction or update, so no -ffast-math is needed.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define MAX_H 64      /* query heads */
#define MAX_D 256     /* head dim */
#define MAX_BS 64     /* tokens per block */
#define PF_DIST 2     /* blocks ahead whose K and V are prefetched */

/* exp(x) for x <= 0 (scores minus their running max), vectorizable: x = n ln2 + r with n an integer (the exponent
 * bits) and |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts), exp(r) from its degree-7 Taylor polynomial. Relative
 * error under 1.1e-7 on [-87, 0], as expf's rounding. */
#pragma omp declare simd notinbranch
static inline float exp_nonpos(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

/* Floats per vector these kernels were compiled with (simd.h): 16 with AVX-512, else 8. */
int tandem_simd_width(void) { return VW; }

int tandem_paged_decode_limits(void) { return MAX_H * 1000000 + MAX_D * 1000 + MAX_BS; }

void tandem_paged_decode(const float *q, const float *kv, const int32_t *block_tables, int64_t max_blocks,
                         const int64_t *rows, const int64_t *seqs, const int64_t *seq_lens, int64_t n_items,
                         int64_t num_blocks, int64_t block_size, int64_t hq, int64_t hkv, int64_t d,
                         float scale, float *out, int nthreads)
{
    const int64_t G = hq / hkv;
    const int64_t tok_stride = hkv * d;                     /* floats between consecutive tokens of one block */
    const int64_t blk_stride = block_size * tok_stride;     /* floats between blocks */
    const float *K = kv;
    const float *V = kv + num_blocks * blk_stride;

    /* One sequence per work item, all its heads together: each token's K (and V) row of all KV heads is one
     * contiguous hkv * d run, read once and used by every query head. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t item = 0; item < n_items; item++) {
        const int64_t row = rows[item], L = seq_lens[item];
        const int32_t *table = block_tables + seqs[item] * max_blocks;
        const float *qr = q + row * hq * d;                  /* [Hq, D]: head h*G+g uses KV head h */
        float m[MAX_H], l[MAX_H], acc[MAX_H][MAX_D], sc[MAX_H][MAX_BS];
        for (int64_t i = 0; i < hq; i++) {
            m[i] = -INFINITY;
            l[i] = 0.0f;
            memset(acc[i], 0, (size_t)d * sizeof(float));
        }
        const int64_t nblk = (L + block_size - 1) / block_size;
        for (int64_t bi = 0; bi < nblk; bi++) {
            const int64_t b = table[bi];
            const int64_t n = (bi + 1) * block_size <= L ? block_size : L - bi * block_size;
            const float *kb = K + b * blk_stride;
            const float *vb = V + b * blk_stride;
            /* The next block sits anywhere in the pool, out of the hardware prefetchers' sight: its K and V rows
             * are requested one token at a time while this block's tokens are computed, so they stream in
             * meanwhile (cold KV is the usual case: a step's weights evict it between layers). */
            const float *kn = bi + PF_DIST < nblk ? K + table[bi + PF_DIST] * blk_stride : NULL;
            const float *vn = bi + PF_DIST < nblk ? V + table[bi + PF_DIST] * blk_stride : NULL;
            for (int64_t t = 0; t < n; t++) {
                const float *kt = kb + t * tok_stride;
                if (kn)
                    for (int64_t off = 0; off < tok_stride; off += 16)
                        __builtin_prefetch(kn + t * tok_stride + off, 0, 3);
                for (int64_t i = 0; i < hq; i++) {
                    const float *qi = qr + i * d, *kr = kt + (i / G) * d;
                    float s = 0.0f;
#pragma omp simd reduction(+:s)
                    for (int64_t j = 0; j < d; j++)
                        s += qi[j] * kr[j];
                    sc[i][t] = s * scale;
                }
            }
            for (int64_t i = 0; i < hq; i++) {
                float mx = m[i];
                for (int64_t t = 0; t < n; t++)
                    mx = sc[i][t] > mx ? sc[i][t] : mx;
                const float corr = m[i] == -INFINITY ? 0.0f : exp_nonpos(m[i] - mx);
                float sum = 0.0f;
                float *si = sc[i];
#pragma omp simd reduction(+:sum)
                for (int64_t t = 0; t < n; t++) {
                    const float p = exp_nonpos(si[t] - mx);
                    si[t] = p;
                    sum += p;
                }
                sum += l[i] * corr;
                if (corr != 1.0f) {
                    float *a = acc[i];
#pragma omp simd
                    for (int64_t j = 0; j < d; j++)
                        a[j] *= corr;
                }
                m[i] = mx;
                l[i] = sum;
            }
            for (int64_t t = 0; t < n; t++) {
                const float *vt = vb + t * tok_stride;
                if (vn)
                    for (int64_t off = 0; off < tok_stride; off += 16)
                        __builtin_prefetch(vn + t * tok_stride + off, 0, 3);
                for (int64_t i = 0; i < hq; i++) {
                    const float p = sc[i][t], *vr = vt + (i / G) * d;
                    float *a = acc[i];
#pragma omp simd
                    for (int64_t j = 0; j < d; j++)
                        a[j] += p * vr[j];
                }
            }
        }
        for (int64_t i = 0; i < hq; i++) {
            float *o = out + (row * hq + i) * d;
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
#pragma omp simd
            for (int64_t j = 0; j < d; j++)
                o[j] = acc[i][j] * inv;
        }
    }
}
