/* Paged decode attention for the CPU: each decode query attends to its sequence's K/V read in place from the
 * paged cache, in one pass with an online softmax (no gather into a contiguous copy, no second read).
 *
 * Layouts (float32, contiguous): q [T, Hq, D]; kv [2, num_blocks, block_size, Hkv, D]; block_tables int32
 * [S, max_blocks]; out [T, Hq, D]. Work item i attends query row rows[i] to the first seq_lens[i] tokens of the
 * sequence whose block-table row is seqs[i]. Items are spread over `nthreads` OpenMP threads.
 *
 * Written with GCC/Clang vector extensions of VW floats (simd.h). Block by block, each query head's scores are
 * VW-lane dot products with the head's query held in registers (one lane sum per key), the online softmax runs
 * over a block's scores a vector at a time, and each head's output accumulates in registers over the block's values.
 * The head dim is a compile-time constant at the usual call sites (64, 128), so those loops unroll; other head dims
 * take the same code with the lanes past the last whole 16-float chunk done one by one. Lane sums go over
 * 16-float chunks (simd.h), so the AVX2 and AVX-512 builds give the same bits. A block's K and V rows stay in
 * L1/L2 while its heads are computed; the block PF_DIST ahead is prefetched meanwhile, a few lines per key.
 *
 * Built at run time by tandem/engine/attention/native.py with the machine's compiler (-O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define MAX_H 64      /* query heads */
#define MAX_D 256     /* head dim */
#define MAX_BS 64     /* tokens per block (a multiple of 16, so a block's scores are whole vectors) */
#define PF_DIST 2     /* blocks ahead whose K and V are prefetched */

/* Floats per vector these kernels were compiled with (simd.h): 16 with AVX-512, else 8. */
int tandem_simd_width(void) { return VW; }

int tandem_paged_decode_limits(void) { return MAX_H * 1000000 + MAX_D * 1000 + MAX_BS; }

/* A block's K then V rows requested into the cache a few lines at a time, between the keys of the block before it:
 * a whole block's lines requested at once stall on the core's outstanding-miss slots. */
typedef struct { const float *k, *v; int64_t len, cur, step; } prefetcher;

static inline void prefetch_some(prefetcher *pf)
{
    for (const int64_t end = pf->cur + pf->step; pf->cur < end && pf->cur < 2 * pf->len; pf->cur += 16)
        __builtin_prefetch(pf->cur < pf->len ? pf->k + pf->cur : pf->v + (pf->cur - pf->len), 0, 3);
}

/* Tokens of block bi of a sequence of L tokens: block_size, or fewer in its last block. */
static inline int64_t block_tokens(int64_t bi, int64_t block_size, int64_t L)
{
    return (bi + 1) * block_size <= L ? block_size : L - bi * block_size;
}

/* One query row (all hq heads) against the first L tokens of the sequence whose block table is `table`. */
static inline __attribute__((always_inline)) void decode_row(
    const int D, const float *qr, const float *K, const float *V, const int32_t *table, int64_t L,
    int64_t block_size, int64_t hq, int64_t G, int64_t tok_stride, int64_t blk_stride, float scale, float *out)
{
    const int NV = D / 16 * VPC, TAIL = D % 16;      /* vectors of whole 16-float chunks per head row; the rest */
    vf acc[MAX_H][MAX_D / VW];
    float acct[MAX_H][16];                           /* the tail lanes' accumulators (D not a multiple of 16) */
    float m[MAX_H], l[MAX_H], sc[MAX_BS] __attribute__((aligned(64)));    /* a block's scores, then weights */
    for (int64_t i = 0; i < hq; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        for (int c = 0; c < NV; c++)
            acc[i][c] = splat(0.0f);
        for (int j = 0; j < TAIL; j++)
            acct[i][j] = 0.0f;
    }
    float iota[VW] __attribute__((aligned(64)));
    for (int j = 0; j < VW; j++)
        iota[j] = (float)j;
    const vf lane = ld(iota), ninf = splat(-INFINITY), zero = splat(0.0f);
    const int64_t nblk = (L + block_size - 1) / block_size;
    for (int64_t bi = 0; bi < nblk; bi++) {
        const int64_t n = block_tokens(bi, block_size, L);
        const float *kb = K + table[bi] * blk_stride, *vb = V + table[bi] * blk_stride;
        prefetcher pf = { 0 };
        if (bi + PF_DIST < nblk) {                    /* its lines spread evenly over this block's hq * n keys */
            pf = (prefetcher){ K + table[bi + PF_DIST] * blk_stride, V + table[bi + PF_DIST] * blk_stride,
                               block_tokens(bi + PF_DIST, block_size, L) * tok_stride, 0, 0 };
            pf.step = ((2 * pf.len + hq * n - 1) / (hq * n) + 15) / 16 * 16;
        }
        const int64_t nv = (n + 15) / 16 * VPC;       /* score vectors of this block: whole 16-float chunks */
        for (int64_t i = 0; i < hq; i++) {
            const float *qi = qr + i * D, *kr = kb + (i / G) * D, *vr = vb + (i / G) * D;
            vf qv[MAX_D / VW];
            for (int c = 0; c < NV; c++)
                qv[c] = ld(qi + c * VW);
            for (int64_t t = 0; t < n; t++) {         /* scores: one lane sum per key */
                const float *kt = kr + t * tok_stride;
                prefetch_some(&pf);
                float s = 0.0f;
                if (NV) {
                    vf a[VPC];
                    for (int c = 0; c < VPC; c++)
                        a[c] = qv[c] * ld(kt + c * VW);
                    for (int c = VPC; c < NV; c++)
                        a[c % VPC] += qv[c] * ld(kt + c * VW);
                    s = hsum16(a);
                }
                for (int j = 0; j < TAIL; j++)
                    s += qi[NV * VW + j] * kt[NV * VW + j];
                sc[t] = s * scale;
            }
            vf mx = ninf;                             /* online softmax over the block, a vector at a time */
            for (int64_t v = 0; v < nv; v++) {
                const vf x = vsel(lane + splat((float)(v * VW)) < splat((float)n), ld(sc + v * VW), ninf);
                st(sc + v * VW, x);
                mx = vsel(x > mx, x, mx);
            }
            float bm = m[i];
            for (int j = 0; j < VW; j++)
                bm = mx[j] > bm ? mx[j] : bm;
            const float corr = m[i] == -INFINITY ? 0.0f : vexp_nonpos(splat(m[i] - bm))[0];
            vf sum[VPC];
            for (int c = 0; c < VPC; c++)
                sum[c] = zero;
            for (int64_t v = 0; v < nv; v++) {
                const vf x = ld(sc + v * VW);
                const vf p = vsel(x == ninf, zero, vexp_nonpos(x - splat(bm)));
                st(sc + v * VW, p);
                sum[v % VPC] += p;
            }
            l[i] = l[i] * corr + hsum16(sum);
            m[i] = bm;
            vf a[MAX_D / VW];                         /* P V: this head's output in registers over the block */
            for (int c = 0; c < NV; c++)
                a[c] = acc[i][c] * corr;
            for (int64_t t = 0; t < n; t++) {
                const float *vt = vr + t * tok_stride;
                const vf p = splat(sc[t]);
                for (int c = 0; c < NV; c++)
                    a[c] += p * ld(vt + c * VW);
            }
            for (int c = 0; c < NV; c++)
                acc[i][c] = a[c];
            for (int j = 0; j < TAIL; j++) {
                float at = acct[i][j] * corr;
                for (int64_t t = 0; t < n; t++)
                    at += sc[t] * vr[t * tok_stride + NV * VW + j];
                acct[i][j] = at;
            }
        }
    }
    for (int64_t i = 0; i < hq; i++) {
        float *o = out + i * D;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        for (int c = 0; c < NV; c++)
            st(o + c * VW, acc[i][c] * inv);
        for (int j = 0; j < TAIL; j++)
            o[NV * VW + j] = acct[i][j] * inv;
    }
}

void tandem_paged_decode(const float *q, const float *kv, const int32_t *block_tables, int64_t max_blocks,
                         const int64_t *rows, const int64_t *seqs, const int64_t *seq_lens, int64_t n_items,
                         int64_t num_blocks, int64_t block_size, int64_t hq, int64_t hkv, int64_t d,
                         float scale, float *out, int nthreads)
{
    const int64_t G = hq / hkv;
    const int64_t tok_stride = hkv * d;                     /* floats between consecutive tokens of one block */
    const int64_t blk_stride = block_size * tok_stride;     /* floats between blocks */
    const float *K = kv, *V = kv + num_blocks * blk_stride;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t item = 0; item < n_items; item++) {
        const int64_t row = rows[item];
        const int32_t *table = block_tables + seqs[item] * max_blocks;
#define ROW(DD) decode_row(DD, q + row * hq * d, K, V, table, seq_lens[item], block_size, hq, G, tok_stride, \
                           blk_stride, scale, out + row * hq * d)
        if (d == 64)
            ROW(64);
        else if (d == 128)
            ROW(128);
        else
            ROW((int)d);
#undef ROW
    }
}
