/* Paged causal prefill attention for the CPU: each prefill chunk's queries attend, causally, to their sequence's
 * K/V read in place from the paged cache (the chunk's own K/V already written there), with an online softmax.
 *
 * PyTorch's CPU flash attention spends most of a short prompt's time outside its GEMMs (about 45 GFLOP/s on a
 * 256-token causal prompt of 8 heads here, against 250 for the linears), and a chunk with a cached prefix first
 * needs its K/V gathered into a contiguous copy. This kernel works on tiles of about 32 query rows (the query
 * positions of a tile times the G query heads of one KV head), transposed once per tile so the rows sit in vector
 * lanes: each key's scores for all rows are VW-lane FMAs with the key's elements broadcast, and the probabilities
 * meet each value row with two rows' accumulators held in registers.
 *
 * Layouts (float32, contiguous): q [T, Hq, D]; kv [2, num_blocks, block_size, Hkv, D]; block_tables int32
 * [S, max_blocks]; out [T, Hq, D]. Item i: query rows starts[i] .. starts[i] + qlens[i] - 1 are the last qlens[i]
 * positions of the seq_lens[i] tokens of the sequence whose block-table row is seqs[i]. D and block_size are
 * multiples of 16 (D <= 128, block_size <= 64); the caller checks with tandem_paged_prefill_limits. Positions are
 * compared as floats in the vector lanes: exact below 2^24 tokens. Nothing is allocated: the tiles of one chunk are
 * spread over `nthreads` OpenMP threads, chunk after chunk.
 *
 * Written with GCC/Clang vector extensions of VW floats (simd.h): 16 with AVX-512, 8 with AVX2 (or NEON pairs).
 * The register blocking follows VW (KEYS keys' scores at a time, PV_COLS vectors of two rows' outputs per pass over
 * a block's values) so the accumulators fit the target's 32 or 16 vector registers; each lane's arithmetic, and so
 * the result, is the same at either width.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define TILE_ROWS 32    /* query rows (positions x heads of one KV head) per tile */
#define PMAX_D 128      /* head dim */
#define PMAX_BS 64      /* tokens per block */
#define PMAX_G 32       /* query heads per KV head */

#if VW == 16
#define KEYS 4          /* keys scored at a time: KEYS * RV accumulators (8 of 32 zmm) */
#define PV_COLS 8       /* output vectors per row per pass over a block's values: 2 * PV_COLS of 32 zmm */
#else
#define KEYS 2          /* 2 * RV = 8 of 16 ymm */
#define PV_COLS 4       /* 8 of 16 ymm */
#endif

int tandem_paged_prefill_limits(void) { return PMAX_G * 1000000 + PMAX_D * 1000 + PMAX_BS; }

/* One tile: `tq` consecutive query positions (from chunk index t0) of KV head h, all G query heads of each: R rows,
 * held as the lanes of RV vectors. Scores are kept transposed (key by key, the rows in lanes), so the causal mask,
 * the running max and the running sum are lane-wise vector operations, and each key's K row is read in place (its
 * elements broadcast). D and BS are compile-time constants at every call site (always_inline), so the loops over
 * them unroll and the accumulators stay in registers. */
#define RV (TILE_ROWS / VW)
static inline __attribute__((always_inline)) void prefill_tile(
    const int D, const int BS, const float *q, float *out, const float *K, const float *V, const int32_t *table,
    int64_t blk_stride, int64_t tok_stride, int64_t hq, int64_t G, int64_t h, int64_t row0, int64_t pos0,
    int64_t t0, int64_t tq, float scale)
{
    const int ND = D / VW;
    const int64_t R = tq * G;
    float Qt[PMAX_D][TILE_ROWS] __attribute__((aligned(64)));       /* scaled Q^T: lane r of Qt[dd] is row r */
    float P[PMAX_BS][TILE_ROWS] __attribute__((aligned(64)));       /* a block's scores, then probabilities */
    float pos[TILE_ROWS] __attribute__((aligned(64))), cr[TILE_ROWS] __attribute__((aligned(64)));
    vf acc[TILE_ROWS][PMAX_D / VW];
    vf mv[RV], lv[RV], posv[RV];
    for (int64_t r = 0; r < TILE_ROWS; r++) {         /* row r: position t0 + r / G, query head h*G + r % G */
        if (r < R) {
            const int64_t t = t0 + r / G;
            const float *src = q + (row0 + t) * hq * D + (h * G + r % G) * D;
            for (int dd = 0; dd < D; dd++)
                Qt[dd][r] = src[dd] * scale;
            pos[r] = (float)(pos0 + t);
        } else {                                      /* padding lanes: zero queries, never stored */
            for (int dd = 0; dd < D; dd++)
                Qt[dd][r] = 0.0f;
            pos[r] = (float)(pos0 + t0 + tq - 1);
        }
        for (int j = 0; j < ND; j++)
            acc[r][j] = splat(0.0f);
    }
    for (int v = 0; v < RV; v++) {
        mv[v] = splat(-INFINITY);
        lv[v] = splat(0.0f);
        posv[v] = ld(&pos[VW * v]);
    }
    const vf ninf = splat(-INFINITY), zero = splat(0.0f);
    const int64_t last = pos0 + t0 + tq - 1;          /* the tile's last position: keys 0..last */
    const int64_t nblk = last / BS + 1;
    for (int64_t bi = 0; bi < nblk; bi++) {
        const int64_t b = table[bi], k0 = bi * BS;
        const int64_t nk = last - k0 + 1 < BS ? last - k0 + 1 : BS;
        const float *kb = K + b * blk_stride + h * D, *vb = V + b * blk_stride + h * D;
        int64_t t = 0;
        for (; t + KEYS <= nk; t += KEYS) {           /* scores of KEYS keys at a time against each Q^T row */
            const float *kp = kb + t * tok_stride;
            vf s[KEYS][RV];
            for (int u = 0; u < KEYS; u++)
                for (int v = 0; v < RV; v++)
                    s[u][v] = zero;
            for (int dd = 0; dd < D; dd++)
                for (int v = 0; v < RV; v++) {
                    const vf qv = ld(&Qt[dd][VW * v]);
                    for (int u = 0; u < KEYS; u++)
                        s[u][v] += qv * kp[u * tok_stride + dd];
                }
            for (int u = 0; u < KEYS; u++)
                for (int v = 0; v < RV; v++)
                    st(&P[t + u][VW * v], s[u][v]);
        }
        for (; t < nk; t++) {
            const float *kp = kb + t * tok_stride;
            vf s[RV];
            for (int v = 0; v < RV; v++)
                s[v] = zero;
            for (int dd = 0; dd < D; dd++)
                for (int v = 0; v < RV; v++)
                    s[v] += ld(&Qt[dd][VW * v]) * kp[dd];
            for (int v = 0; v < RV; v++)
                st(&P[t][VW * v], s[v]);
        }
        for (int v = 0; v < RV; v++) {                /* causal mask and online softmax, lane-wise */
            vf bm = ninf;
            for (t = 0; t < nk; t++) {
                vf x = ld(&P[t][VW * v]);
                x = vsel(posv[v] >= splat((float)(k0 + t)), x, ninf);
                st(&P[t][VW * v], x);
                bm = vsel(x > bm, x, bm);
            }
            const vf mx = vsel(bm > mv[v], bm, mv[v]);
            const vf base = vsel(mx == ninf, zero, mx);                  /* lanes with no key yet */
            const vf corr = vexp_nonpos(mv[v] - base);
            vf sum = zero;
            for (t = 0; t < nk; t++) {
                const vf x = ld(&P[t][VW * v]);
                const vf p = vsel(x == ninf, zero, vexp_nonpos(x - base));
                st(&P[t][VW * v], p);
                sum += p;
            }
            lv[v] = lv[v] * corr + sum;
            mv[v] = mx;
            st(&cr[VW * v], corr);
        }
        int64_t r = 0;
        for (; r + 2 <= R; r += 2)                    /* P V, two rows at a time sharing each value row, */
            for (int c = 0; c < ND; c += PV_COLS) {   /* PV_COLS output vectors of each per pass */
                const int nc = ND - c < PV_COLS ? ND - c : PV_COLS;
                vf a0[PV_COLS], a1[PV_COLS];
                const float c0 = cr[r], c1 = cr[r + 1];
                for (int j = 0; j < nc; j++) {
                    a0[j] = acc[r][c + j] * c0;
                    a1[j] = acc[r + 1][c + j] * c1;
                }
                for (t = 0; t < nk; t++) {
                    const float *vr = vb + t * tok_stride + VW * c;
                    const float p0 = P[t][r], p1 = P[t][r + 1];
                    for (int j = 0; j < nc; j++) {
                        const vf x = ld(vr + VW * j);
                        a0[j] += x * p0;
                        a1[j] += x * p1;
                    }
                }
                for (int j = 0; j < nc; j++) {
                    acc[r][c + j] = a0[j];
                    acc[r + 1][c + j] = a1[j];
                }
            }
        for (; r < R; r++) {
            for (int j = 0; j < ND; j++)
                acc[r][j] *= cr[r];
            for (t = 0; t < nk; t++)
                for (int j = 0; j < ND; j++)
                    acc[r][j] += ld(vb + t * tok_stride + VW * j) * P[t][r];
        }
    }
    float l[TILE_ROWS] __attribute__((aligned(64)));
    for (int v = 0; v < RV; v++)
        st(&l[VW * v], lv[v]);
    for (int64_t r = 0; r < R; r++) {
        const int64_t t = t0 + r / G;
        float *dst = out + (row0 + t) * hq * D + (h * G + r % G) * D;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int j = 0; j < ND; j++)
            st(dst + VW * j, acc[r][j] * inv);
    }
}

void tandem_paged_prefill(const float *q, const float *kv, const int32_t *block_tables, int64_t max_blocks,
                          const int64_t *starts, const int64_t *qlens, const int64_t *seqs, const int64_t *seq_lens,
                          int64_t n_items, int64_t num_blocks, int64_t block_size, int64_t hq, int64_t hkv,
                          int64_t d, float scale, float *out, int nthreads)
{
    const int64_t G = hq / hkv, TQ = TILE_ROWS / G;
    const int64_t tok_stride = hkv * d, blk_stride = block_size * tok_stride;
    const float *K = kv, *V = kv + num_blocks * blk_stride;
    for (int64_t i = 0; i < n_items; i++) {          /* work items of a chunk: (KV head, tile), over the threads */
        const int64_t tiles = (qlens[i] + TQ - 1) / TQ;
        const int32_t *table = block_tables + seqs[i] * max_blocks;
        const int64_t pos0 = seq_lens[i] - qlens[i];
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t w = 0; w < hkv * tiles; w++) {
            const int64_t h = w / tiles, t0 = (w % tiles) * TQ;
            const int64_t tq = qlens[i] - t0 < TQ ? qlens[i] - t0 : TQ;
#define TILE(DD, BB) prefill_tile(DD, BB, q, out, K, V, table, blk_stride, tok_stride, hq, G, h, starts[i], pos0, \
                                  t0, tq, scale)
            if (d == 64 && block_size == 16)
                TILE(64, 16);
            else if (d == 64 && block_size == 32)
                TILE(64, 32);
            else if (d == 128 && block_size == 16)
                TILE(128, 16);
            else if (d == 128 && block_size == 32)
                TILE(128, 32);
            else
                prefill_tile((int)d, (int)block_size, q, out, K, V, table, blk_stride, tok_stride, hq, G, h,
                             starts[i], pos0, t0, tq, scale);
#undef TILE
        }
    }
}
