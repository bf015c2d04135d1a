/* pdserve's native attention kernels for CPU.
 *
 * 1. Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * For every sequence the kernel walks its blocks once for K and once for V. Each
 * token's K (then V) for all KV heads is one contiguous row of the block, scored
 * against every query head that shares it (grouped-query attention); the softmax runs
 * in float32. Nothing is gathered first, so a decode step reads every cached byte once,
 * in order, instead of copying it twice before the math. The next rows are prefetched
 * while the current one is used: the blocks of a sequence are scattered over the pool,
 * which the hardware prefetcher cannot follow.
 *
 * Consecutive rows that are consecutive positions of one sequence (a verified draft's
 * tokens, a short prompt chunk's) attend as a group: each tile of 16 keys is read and
 * transposed once for all of them (bfloat16 with AVX512-BF16), where each row alone
 * read and scored its whole context. A row's scores do not depend on the group it is in.
 *
 * Layout of one layer's cache (K or V): [blocks, block_size, kv_heads, dim], float32
 * or bfloat16; the query and output are [batch, q_heads, dim] in the same dtype.
 * Rows are split over `threads` OpenMP threads: torch's own team (the library binds to
 * the libgomp torch loaded), so the kernels and torch's ops never fight over cores.
 *
 * 2. Causal prefill attention for one sequence in bfloat16 (CPUs with AVX512-BF16), the
 * flash-attention way: query tiles against key tiles with an online softmax, so the
 * score matrix never exists whole. K and V are first rearranged per head into bf16
 * pairs (VNNI order), so that both products, Q.K^T and P.V, run as vdpbf16ps over 16
 * outputs at a time with no horizontal sums; scores and the softmax are float32.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "pdserve_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#endif

#define MAX_DIM 256
#define MAX_HEADS 64
#define PREFETCH_AHEAD 16        /* tokens */
#define TILE_AHEAD 32            /* tokens: the K pass prefetches two tiles ahead */
#define HEADS_AT_ONCE 4          /* query heads a K tile is scored for at once */
#define GROUP_ROWS 16            /* most rows attending as one group */

typedef uint32_t u32_alias __attribute__((may_alias, aligned(2)));     /* a bf16 pair */

typedef struct {
    const void *q, *k, *v;
    void *out;
    const int64_t *table;
    const int32_t *lens;
    int64_t table_stride, block_stride, token_stride;
    int q_heads, kv_heads, dim, block_size, bf16;
    float scale;
    int first, last;        /* rows [first, last) */
    int group_rows;         /* most rows attending as one group */
    int64_t score_stride;   /* floats between two heads' scores: max_len rounded up to 16 */
    float *scores;          /* group_rows * q_heads * score_stride floats */
    int64_t *offsets;       /* max_len: the current sequence's token rows, element offsets */
} Job;

static inline void load_row(const void *base, int64_t offset, int n, int bf16, float *dst) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int d = 0; d < n; d++) {
            uint32_t bits = (uint32_t)src[d] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            dst[d] = f;
        }
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void *base, int64_t offset, int n, int bf16, const float *src) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int d = 0; d < n; d++) {
            uint32_t bits;
            memcpy(&bits, &src[d], sizeof bits);
            if ((bits & 0x7fffffffu) > 0x7f800000u)
                dst[d] = (uint16_t)((bits >> 16) | 0x40);             /* quiet NaN */
            else
                dst[d] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  /* round to nearest even */
        }
    } else {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
    }
}

/* Where each of a sequence's first `len` tokens lies, walking its blocks in order: the
 * passes below then look rows up instead of dividing by the block size per token. */
static inline void token_offsets(const Job *j, const int64_t *blocks, int len) {
    for (int b = 0, t = 0; t < len; b++) {
        const int64_t base = blocks[b] * j->block_stride;
        for (int i = 0; i < j->block_size && t < len; i++, t++)
            j->offsets[t] = base + (int64_t)i * j->token_stride;
    }
}

static inline int64_t token_offset(const Job *j, const int64_t *blocks, int t) {
    (void)blocks;
    return j->offsets[t];
}

/* Into L2 (prefetcht1), not L1: a sequence's blocks lie anywhere in the pool, and a
 * block's rows prefetched into L1 left too few misses in flight to cover memory latency
 * (L1 has fewer miss buffers). One core, 16 sequences x 331 tokens x 30 layers of
 * SmolLM2, blocks in random order: 14.7 -> 8.3 ms; blocks in order: 8.7 -> 8.4 ms. */
static inline void prefetch_row(const void *base, int64_t offset, int bytes, int elem) {
    const char *p = (const char *)base + offset * elem;
    for (int i = 0; i < bytes; i += 64)
        __builtin_prefetch(p + i, 0, 2);
}

#ifdef HAVE_DPBF16
/* 16 rows of 16 32-bit words transposed in place: word i of row r goes to word r of row i. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int a = 0; a < 4; a++) {
            t[i + a] = _mm512_shuffle_i32x4(r[i + a], r[i + 4 + a], 0x88);
            t[i + 4 + a] = _mm512_shuffle_i32x4(r[i + a], r[i + 4 + a], 0xdd);
        }
    for (int a = 0; a < 8; a++) {
        r[a] = _mm512_shuffle_i32x4(t[a], t[8 + a], 0x88);
        r[8 + a] = _mm512_shuffle_i32x4(t[a], t[8 + a], 0xdd);
    }
}

/* The K pass for bfloat16 with AVX512-BF16, rows [b0, b1) of one group (their first
 * `len` tokens at j->offsets; row b sees its own lens[b] of them). Per tile of 16
 * tokens and KV head, the tile is transposed into bf16 pairs, one vector per pair of
 * dims holding it for the 16 tokens, so that vdpbf16ps with a broadcast pair of the
 * query scores 16 tokens at once, with no horizontal sums; every query head of every
 * row in the group is scored from the one transposed tile. Each score sums its dims'
 * products in the same order whatever the group. Tokens past `len` in the last tile
 * score against zeros; scores past a row's own length are written and never read.
 * Writes scaled scores, row b's head h at scores + ((b - b0) * q_heads + h) * stride. */
static inline __attribute__((always_inline)) void score_rows_bf16(const Job *j, int b0, int b1, int len,
                                                                  int64_t stride, const int kv_heads,
                                                                  const int group, const int dim) {
    const int pairs = dim / 2, q_heads = kv_heads * group;
    const uint16_t *k = (const uint16_t *)j->k;
    const __m512 scale = _mm512_set1_ps(j->scale);
    for (int t = 16; t < TILE_AHEAD && t < len; t++) {      /* the tiles before the first prefetched below */
        prefetch_row(j->k, j->offsets[t], kv_heads * dim * 2, 2);
        prefetch_row(j->v, j->offsets[t], kv_heads * dim * 2, 2);
    }
    for (int t0 = 0; t0 < len; t0 += 16) {
        const int n = len - t0 < 16 ? len - t0 : 16;
        for (int h = 0; h < kv_heads; h++) {
            __m512i kt[MAX_DIM / 2];
            for (int c = 0; c < dim / 32; c++) {
                __m512i r[16];
                const int64_t at = h * dim + 32 * c;      /* one cache line of each token's row */
                if (n == 16)
                    for (int i = 0; i < 16; i++) {
                        const int ahead = t0 + TILE_AHEAD + i;  /* the same line of a later tile, V too */
                        if (ahead < len) {
                            __builtin_prefetch(k + j->offsets[ahead] + at, 0, 2);
                            __builtin_prefetch((const uint16_t *)j->v + j->offsets[ahead] + at, 0, 2);
                        }
                        r[i] = _mm512_loadu_si512(k + j->offsets[t0 + i] + at);
                    }
                else
                    for (int i = 0; i < 16; i++)
                        r[i] = i < n ? _mm512_loadu_si512(k + j->offsets[t0 + i] + at) : _mm512_setzero_si512();
                transpose16(r);
                for (int i = 0; i < 16; i++)
                    kt[16 * c + i] = r[i];
            }
            for (int b = b0; b < b1; b++) {
                if (j->lens[b] <= t0)
                    continue;
                const u32_alias *q = (const u32_alias *)((const uint16_t *)j->q + ((int64_t)b * q_heads + h * group) * dim);
                float *s = j->scores + ((int64_t)(b - b0) * q_heads + h * group) * stride + t0;
                for (int g0 = 0; g0 < group; g0 += HEADS_AT_ONCE) {     /* independent sums, to fill the pipes */
                    const int heads = group - g0 < HEADS_AT_ONCE ? group - g0 : HEADS_AT_ONCE;
                    __m512 a[HEADS_AT_ONCE][2];
                    for (int g = 0; g < heads; g++)
                        a[g][0] = a[g][1] = _mm512_setzero_ps();
                    for (int p = 0; p < pairs; p += 2)
                        for (int g = 0; g < heads; g++) {
                            const u32_alias *qg = q + (int64_t)(g0 + g) * pairs;
                            a[g][0] = _mm512_dpbf16_ps(a[g][0], (__m512bh)_mm512_set1_epi32((int)qg[p]), (__m512bh)kt[p]);
                            a[g][1] = _mm512_dpbf16_ps(a[g][1], (__m512bh)_mm512_set1_epi32((int)qg[p + 1]),
                                                       (__m512bh)kt[p + 1]);
                        }
                    for (int g = 0; g < heads; g++)
                        _mm512_storeu_ps(s + (int64_t)(g0 + g) * stride, _mm512_mul_ps(_mm512_add_ps(a[g][0], a[g][1]), scale));
                }
            }
        }
    }
}
#endif

#ifdef HAVE_DPBF16
static inline uint32_t bf16_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;      /* finite, non-negative weights */
}

/* A head's softmax weights, float32, rounded to bfloat16 in place: afterwards the row
 * holds len bf16 values from its start, then a zero (the pair partner of an odd last
 * token). Each store lands on floats already read. Rounding is to nearest even, as
 * bf16_bits, in 16-wide vector steps. */
static inline void weights_to_bf16(float *s, int len) {
    char *p = (char *)s;        /* written through memcpy and may-alias vector stores only */
    int t = 0;
    for (; t + 16 <= len; t += 16)
        _mm256_storeu_si256((__m256i *)(p + 2 * t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
    for (; t < len; t++) {
        float f;
        memcpy(&f, p + 4 * (size_t)t, sizeof f);
        const uint16_t b = (uint16_t)bf16_bits(f);
        memcpy(p + 2 * (size_t)t, &b, sizeof b);
    }
    const uint16_t zero = 0;
    memcpy(p + 2 * (size_t)len, &zero, sizeof zero);
}

/* The V pass for bfloat16 with AVX512-BF16, one KV head at a time (its accumulators
 * stay in registers; the sequence's rows come back from L2 for the next head). Two
 * tokens per step: their V rows interleaved into bf16 pairs, weighed by their two
 * softmax weights in one vdpbf16ps, the pair read as one 32-bit word from the weights
 * rounded beforehand (weights_to_bf16). The interleave works within 128-bit lanes, so
 * the accumulators hold dims in the order (0-3, 8-11, ...) and (4-7, 12-15, ...); they
 * are put back in order once at the end. The weights are rounded to bf16, as the torch
 * path rounds its probabilities before its matmul. */
static inline __attribute__((always_inline)) void weigh_bf16(const Job *j, const int64_t *blocks, int len,
                                                             float *scores, int64_t stride, const int kv_heads,
                                                             const int group, const int dim, float *out) {
    const int chunks = dim / 32;
    const uint16_t *v = (const uint16_t *)j->v;
    for (int head = 0; head < kv_heads * group; head++)
        weights_to_bf16(scores + (int64_t)head * stride, len);
    for (int h = 0; h < kv_heads; h++) {
        __m512 acc[4][MAX_DIM / 32][2];
        for (int g = 0; g < group; g++)
            for (int c = 0; c < chunks; c++)
                acc[g][c][0] = acc[g][c][1] = _mm512_setzero_ps();
        const uint16_t *pw[4];
        for (int g = 0; g < group; g++)
            pw[g] = (const uint16_t *)(scores + (int64_t)(h * group + g) * stride);
        for (int t = 0; t < len; t += 2) {
            const int two = t + 1 < len;
            const uint16_t *r0 = v + token_offset(j, blocks, t) + h * dim;
            const uint16_t *r1 = two ? v + token_offset(j, blocks, t + 1) + h * dim : r0;
            __m512bh w[4];
            for (int g = 0; g < group; g++) {
                int32_t pair;                   /* weights t and t + 1 (0 past the end) */
                memcpy(&pair, pw[g] + t, sizeof pair);
                w[g] = (__m512bh)_mm512_set1_epi32(pair);
            }
            for (int c = 0; c < chunks; c++) {
                const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
                for (int g = 0; g < group; g++) {
                    acc[g][c][0] = _mm512_dpbf16_ps(acc[g][c][0], w[g], lo);
                    acc[g][c][1] = _mm512_dpbf16_ps(acc[g][c][1], w[g], hi);
                }
            }
        }
        for (int g = 0; g < group; g++)
            for (int c = 0; c < chunks; c++) {
                float part[2][16];
                _mm512_storeu_ps(part[0], acc[g][c][0]);
                _mm512_storeu_ps(part[1], acc[g][c][1]);
                float *o = out + (int64_t)(h * group + g) * dim + 32 * c;
                for (int i = 0; i < 16; i++) {
                    o[(i / 4) * 8 + i % 4] = part[0][i];
                    o[(i / 4) * 8 + 4 + i % 4] = part[1][i];
                }
            }
    }
}
#endif

/* Token t's row of `width` elements (all KV heads) as float32, prefetching the row a few
 * tokens ahead. */
static inline void fetch_row(const Job *j, const void *base, const int64_t *blocks, int t, int len, int width,
                             int bf16, float *row) {
    if (t + PREFETCH_AHEAD < len)
        prefetch_row(base, token_offset(j, blocks, t + PREFETCH_AHEAD), width * (bf16 ? 2 : 4), bf16 ? 2 : 4);
    load_row(base, token_offset(j, blocks, t), width, bf16, row);
}

/* Whether row b + 1 is the next position of row b's sequence: one token longer, over
 * the same blocks for every token row b sees (the rows of a verified draft or of a short
 * prompt chunk). Then row b reads its tokens where row b + 1 does, and both can attend
 * as one group. */
static inline int continues(const Job *j, int b) {
    const int len = j->lens[b];
    if (len <= 0 || j->lens[b + 1] != len + 1)
        return 0;
    const int64_t blocks = (len + j->block_size - 1) / j->block_size;
    return !memcmp(j->table + (int64_t)b * j->table_stride, j->table + (int64_t)(b + 1) * j->table_stride,
                   (size_t)blocks * sizeof(int64_t));
}

/* Row b's softmax over its `len` scores (head h's at scores + h * stride), its weighted
 * sum of V (its tokens at j->offsets) and its output. */
static inline __attribute__((always_inline)) void finish_row(const Job *j, int b, const int64_t *blocks, int len,
                                                             float *scores, int64_t stride, const int bf16,
                                                             const int kv_heads, const int group, const int dim) {
    const int q_heads = kv_heads * group, width = kv_heads * dim;
    static __thread float acc[MAX_HEADS * MAX_DIM], row[MAX_HEADS * MAX_DIM];
    float total[MAX_HEADS];
    for (int g = 0; g < q_heads; g++) {
        float *s = scores + (int64_t)g * stride, sum = 0.0f, m = -FLT_MAX;
#pragma omp simd reduction(max : m)
        for (int t = 0; t < len; t++)
            m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; t++) {
            s[t] = fast_expf(s[t] - m);
            sum += s[t];
        }
        total[g] = sum;
    }
    memset(acc, 0, (size_t)q_heads * dim * sizeof(float));
    /* out_head = sum_t p[head][t] v_t / sum */
#ifdef HAVE_DPBF16
    if (bf16 && dim % 32 == 0 && group <= 4) {
        weigh_bf16(j, blocks, len, scores, stride, kv_heads, group, dim, acc);
    } else
#endif
    for (int t = 0; t < len; t++) {
        fetch_row(j, j->v, blocks, t, len, width, bf16, row);
        for (int h = 0; h < kv_heads; h++)
            for (int g = 0; g < group; g++) {
                const float p = scores[(int64_t)(h * group + g) * stride + t];
                float *ah = acc + (h * group + g) * dim;
                const float *vh = row + h * dim;
#pragma omp simd
                for (int d = 0; d < dim; d++)
                    ah[d] += p * vh[d];
            }
    }
    for (int g = 0; g < q_heads; g++) {
        const float inv = 1.0f / total[g];
        for (int d = 0; d < dim; d++)
            acc[g * dim + d] *= inv;
    }
    store_row(j->out, (int64_t)b * q_heads * dim, q_heads * dim, bf16, acc);
}

/* The work of one thread. Inlined with constant `bf16`, `kv_heads`, `group` and `dim`
 * for the common shapes (run() below), so the compiler unrolls and vectorizes the inner
 * loops fully. */
static inline __attribute__((always_inline)) void attend(const Job *j, const int bf16, const int kv_heads,
                                                         const int group, const int dim) {
    const int q_heads = kv_heads * group, width = kv_heads * dim;
    static __thread float qf[MAX_HEADS * MAX_DIM], row[MAX_HEADS * MAX_DIM];
    for (int b = j->first, end; b < j->last; b = end) {
        const int len = j->lens[b];
        end = b + 1;
        if (len <= 0) {                                 /* nothing to attend to */
            memset(qf, 0, (size_t)q_heads * dim * sizeof(float));
            store_row(j->out, (int64_t)b * q_heads * dim, q_heads * dim, bf16, qf);
            continue;
        }
        /* scores[head][t] = q_head . k_t */
#ifdef HAVE_DPBF16
        if (bf16 && dim % 32 == 0) {
            while (end < j->last && end - b < j->group_rows && continues(j, end - 1))
                end++;
            const int last_len = j->lens[end - 1];
            const int64_t *blocks = j->table + (int64_t)(end - 1) * j->table_stride;
            token_offsets(j, blocks, last_len);
            score_rows_bf16(j, b, end, last_len, j->score_stride, kv_heads, group, dim);
        } else
#endif
        {
            const int64_t *blocks = j->table + (int64_t)b * j->table_stride;
            token_offsets(j, blocks, len);
            load_row(j->q, (int64_t)b * q_heads * dim, q_heads * dim, bf16, qf);
            for (int i = 0; i < q_heads * dim; i++)
                qf[i] *= j->scale;
            for (int t = 0; t < len; t++) {
                fetch_row(j, j->k, blocks, t, len, width, bf16, row);
                for (int h = 0; h < kv_heads; h++)
                    for (int g = 0; g < group; g++) {
                        const float *qh = qf + (h * group + g) * dim, *kh = row + h * dim;
                        float s = 0.0f;
#pragma omp simd reduction(+ : s)
                        for (int d = 0; d < dim; d++)
                            s += qh[d] * kh[d];
                        j->scores[(int64_t)(h * group + g) * j->score_stride + t] = s;
                    }
            }
        }
        if (end < j->last && j->lens[end] > 0) {        /* the next sequence's first block, meanwhile */
            const int64_t next = j->table[(int64_t)end * j->table_stride] * j->block_stride;
            const int bytes = j->block_size * (int)j->token_stride * (bf16 ? 2 : 4);
            prefetch_row(j->k, next, bytes, bf16 ? 2 : 4);
            prefetch_row(j->v, next, bytes, bf16 ? 2 : 4);
        }
        const int64_t *blocks = j->table + (int64_t)(end - 1) * j->table_stride;
        for (int r = b; r < end; r++)
            finish_row(j, r, blocks, j->lens[r], j->scores + (int64_t)(r - b) * q_heads * j->score_stride,
                       j->score_stride, bf16, kv_heads, group, dim);
    }
}

static void run(const Job *j) {
    const int group = j->q_heads / j->kv_heads;
    if (j->dim == 64 && j->kv_heads == 3 && group == 3 && j->bf16)       /* SmolLM2-135M */
        attend(j, 1, 3, 3, 64);
    else if (j->dim == 64 && j->kv_heads == 3 && group == 3)
        attend(j, 0, 3, 3, 64);
    else if (j->dim == 64 && j->bf16)
        attend(j, 1, j->kv_heads, group, 64);
    else if (j->dim == 128 && j->bf16)
        attend(j, 1, j->kv_heads, group, 128);
    else
        attend(j, j->bf16, j->kv_heads, group, j->dim);
}

/* The calling thread's scratch of at least `bytes`, kept from call to call: a fresh
 * allocation this size is mapped and faulted in page by page on every call (30 a step). */
static void *scratch(size_t bytes) {
    static __thread void *buf;
    static __thread size_t size;
    if (bytes > size) {
        free(buf);
        size = bytes + bytes / 2;
        buf = malloc(size);
        if (!buf)
            size = 0;
    }
    return buf;
}

/* Returns 0, or a negative code for arguments the kernel does not take. */
int pdserve_paged_decode_attention(const void *q, const void *k, const void *v, void *out,
                                   const int64_t *table, int64_t table_stride, const int32_t *lens,
                                   int batch, int q_heads, int kv_heads, int dim, int block_size,
                                   int64_t block_stride, int64_t token_stride, float scale, int bf16,
                                   int threads) {
    if (dim < 1 || dim > MAX_DIM || kv_heads < 1 || q_heads > MAX_HEADS || q_heads % kv_heads ||
        token_stride < (int64_t)kv_heads * dim)
        return -1;
    int max_len = 1;
    for (int b = 0; b < batch; b++)
        if (lens[b] > max_len)
            max_len = lens[b];
    if (threads > batch)
        threads = batch;
    if (threads > 64)
        threads = 64;
    if (threads < 1)
        threads = 1;
    /* A group's scores are kept to ~2 MB: at long contexts fewer rows share a pass. */
    const int64_t stride = (max_len + 15) & ~(int64_t)15, per_row = (int64_t)q_heads * stride;
    int group_rows = (int)((2 << 20) / (per_row * (int64_t)sizeof(float)));
    group_rows = group_rows < 1 ? 1 : group_rows > GROUP_ROWS ? GROUP_ROWS : group_rows;
    const size_t score_bytes = (size_t)threads * group_rows * per_row * sizeof(float);
    float *scores = scratch(score_bytes + (size_t)threads * max_len * sizeof(int64_t));
    if (!scores)
        return -2;
    int64_t *offsets = (int64_t *)((char *)scores + score_bytes);
    Job jobs[64];
    for (int i = 0; i < threads; i++)
        jobs[i] = (Job){q, k, v, out, table, lens, table_stride, block_stride, token_stride, q_heads, kv_heads,
                        dim, block_size, bf16, scale, (int)((int64_t)batch * i / threads),
                        (int)((int64_t)batch * (i + 1) / threads), group_rows, stride,
                        scores + (size_t)i * group_rows * per_row, offsets + (size_t)i * max_len};
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int i = 0; i < threads; i++)
        run(&jobs[i]);
    return 0;
}


/* ---- 2. causal prefill attention, bfloat16 ---------------------------------------- */

int pdserve_prefill_supported(void) {
#ifdef HAVE_DPBF16
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_DPBF16
#define QT 16           /* query positions per tile */
#define KT 64           /* keys per tile */
#define MASKED (-1e30f)

typedef struct {
    const uint16_t *q;
    int64_t q_tok, q_head;
    const uint32_t *kp, *vp;    /* per KV head: K as [dim/2][keys] pairs, V as [keys/2][dim] pairs */
    int64_t keys_pad;
    uint16_t *out;              /* [queries, q_heads, dim] */
    int lq, lk, offset, q_heads, kv_heads, dim;
    float scale;
    int *next;                  /* the next unclaimed item, shared by the team */
    int status;                 /* set by the thread: 0, or -2 when out of memory */
} PrefillJob;

static inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) {
    return (uint32_t)lo | ((uint32_t)hi << 16);
}

/* One (KV head, query tile): rows are (position, query head of the group) pairs, padded
 * to a multiple of 4 with zero queries whose outputs are dropped. */
static inline __attribute__((always_inline)) void tile(const PrefillJob *j, int h, int p0, float *S, uint32_t *P,
                                                       float *O, float *m, float *l, uint32_t *qrows, const int dim) {
    const int group = j->q_heads / j->kv_heads, pairs = dim / 2, dvec = dim / 16;
    const int p1 = p0 + QT < j->lq ? p0 + QT : j->lq;
    const int rows = (p1 - p0) * group, rows4 = (rows + 3) & ~3;
    for (int r = 0; r < rows4; r++) {
        uint32_t *dst = qrows + (int64_t)r * pairs;
        if (r < rows) {
            const int p = p0 + r / group, head = h * group + r % group;
            const uint16_t *src = j->q + p * j->q_tok + head * j->q_head;
            for (int i = 0; i < pairs; i++)
                dst[i] = bf16_pair(src[2 * i], src[2 * i + 1]);
        } else {
            memset(dst, 0, (size_t)pairs * 4);
        }
        m[r] = MASKED;
        l[r] = 0.0f;
        memset(O + (int64_t)r * dim, 0, (size_t)dim * 4);
    }
    const uint32_t *kp = j->kp + (int64_t)h * pairs * j->keys_pad;
    const uint32_t *vp = j->vp + (int64_t)h * (j->keys_pad / 2) * dim;
    const int key_end = p1 - 1 + j->offset + 1 < j->lk ? p1 - 1 + j->offset + 1 : j->lk;
    for (int k0 = 0; k0 < key_end; k0 += KT) {
        const int n = key_end - k0 < KT ? key_end - k0 : KT;
        /* S = Q K^T * scale, 4 rows x 64 keys per block */
        for (int r = 0; r < rows4; r += 4) {
            __m512 acc[4][4];
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++)
                    acc[a][b] = _mm512_setzero_ps();
            for (int i = 0; i < pairs; i++) {
                const uint32_t *krow = kp + (int64_t)i * j->keys_pad + k0;
                __m512bh kv[4];
                for (int b = 0; b < 4; b++)
                    kv[b] = (__m512bh)_mm512_loadu_si512(krow + 16 * b);
                for (int a = 0; a < 4; a++) {
                    const __m512bh qa = (__m512bh)_mm512_set1_epi32((int)qrows[(int64_t)(r + a) * pairs + i]);
                    for (int b = 0; b < 4; b++)
                        acc[a][b] = _mm512_dpbf16_ps(acc[a][b], qa, kv[b]);
                }
            }
            const __m512 sc = _mm512_set1_ps(j->scale);
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++)
                    _mm512_storeu_ps(S + (r + a) * KT + 16 * b, _mm512_mul_ps(acc[a][b], sc));
        }
        /* causal mask, online softmax, P in bf16 pairs */
        for (int r = 0; r < rows4; r++) {
            float *s = S + r * KT;
            /* keys of this tile the row sees: up to its own position + offset, and n */
            int seen = r < rows ? p0 + r / group + j->offset - k0 + 1 : 0;
            seen = seen < n ? (seen > 0 ? seen : 0) : n;
            for (int c = seen; c < KT; c++)
                s[c] = MASKED;
            float mx = MASKED;
#pragma omp simd reduction(max : mx)
            for (int c = 0; c < KT; c++)
                mx = s[c] > mx ? s[c] : mx;
            const float m_new = mx > m[r] ? mx : m[r], corr = fast_expf(m[r] - m_new);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int c = 0; c < KT; c++) {
                const float e = fast_expf(s[c] - m_new);
                s[c] = c < seen ? e : 0.0f;     /* masked keys weigh exactly nothing */
                sum += s[c];
            }
            l[r] = l[r] * corr + sum;
            m[r] = m_new;
            float *o = O + (int64_t)r * dim;
            for (int d = 0; d < dim; d++)
                o[d] *= corr;
            for (int c = 0; c < KT; c += 32) {
                __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + c + 16), _mm512_loadu_ps(s + c));
                _mm512_storeu_si512(P + r * (KT / 2) + c / 2, (__m512i)pb);
            }
        }
        /* O += P V, 4 rows x dim per block */
        const uint32_t *vt = vp + (int64_t)(k0 / 2) * dim;
        for (int r = 0; r < rows4; r += 4) {
            for (int d0 = 0; d0 < dvec; d0 += 4) {
                const int nd = dvec - d0 < 4 ? dvec - d0 : 4;
                __m512 acc[4][4];
                for (int a = 0; a < 4; a++)
                    for (int b = 0; b < nd; b++)
                        acc[a][b] = _mm512_loadu_ps(O + (int64_t)(r + a) * dim + 16 * (d0 + b));
                for (int c = 0; c < (n + 1) / 2; c++) {
                    __m512bh vv[4];
                    for (int b = 0; b < nd; b++)
                        vv[b] = (__m512bh)_mm512_loadu_si512(vt + (int64_t)c * dim + 16 * (d0 + b));
                    for (int a = 0; a < 4; a++) {
                        const __m512bh pa = (__m512bh)_mm512_set1_epi32((int)P[(r + a) * (KT / 2) + c]);
                        for (int b = 0; b < nd; b++)
                            acc[a][b] = _mm512_dpbf16_ps(acc[a][b], pa, vv[b]);
                    }
                }
                for (int a = 0; a < 4; a++)
                    for (int b = 0; b < nd; b++)
                        _mm512_storeu_ps(O + (int64_t)(r + a) * dim + 16 * (d0 + b), acc[a][b]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const int p = p0 + r / group, head = h * group + r % group;
        float *o = O + (int64_t)r * dim;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < dim; d++)
            o[d] *= inv;
        store_row(j->out, ((int64_t)p * j->q_heads + head) * dim, dim, 1, o);
    }
}

static void prefill_tile(const PrefillJob *j, int h, int p0, float *S, uint32_t *P, float *O, float *m, float *l,
                         uint32_t *qrows) {
    if (j->dim == 64)                   /* constant head sizes unroll the P.V blocks fully */
        tile(j, h, p0, S, P, O, m, l, qrows, 64);
    else if (j->dim == 128)
        tile(j, h, p0, S, P, O, m, l, qrows, 128);
    else
        tile(j, h, p0, S, P, O, m, l, qrows, j->dim);
}

static void *prefill_thread(void *arg) {
    PrefillJob *j = arg;
    const int group = j->q_heads / j->kv_heads, rows4 = (QT * group + 3) & ~3;
    float *S = malloc(sizeof(float) * rows4 * KT), *O = malloc(sizeof(float) * rows4 * j->dim);
    float *m = malloc(sizeof(float) * rows4), *l = malloc(sizeof(float) * rows4);
    uint32_t *P = malloc(sizeof(uint32_t) * rows4 * KT / 2), *qrows = malloc(sizeof(uint32_t) * rows4 * j->dim / 2);
    if (S && O && m && l && P && qrows) {
        const int tiles = (j->lq + QT - 1) / QT, items = tiles * j->kv_heads;
        /* Longest tiles first (the causal triangle makes later tiles dearer), each taken by
         * whichever thread comes free: a thread on a shared core holds nobody back. */
        for (int item; (item = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED)) < items;) {
            const int tile = tiles - 1 - item / j->kv_heads;
            prefill_tile(j, item % j->kv_heads, tile * QT, S, P, O, m, l, qrows);
        }
    } else {
        j->status = -2;
    }
    free(S);
    free(O);
    free(m);
    free(l);
    free(P);
    free(qrows);
    return NULL;
}
#endif

/* q: [lq, q_heads, dim] and k, v: [lk, kv_heads, dim] in bfloat16 with the given token
 * and head strides (elements; the last dimension contiguous); out: [lq, q_heads, dim]
 * contiguous. Query i sees keys 0 .. i + offset. Returns 0, or negative when refused. */
int pdserve_prefill_attention(const void *q, int64_t q_tok, int64_t q_head, const void *k, int64_t k_tok,
                              int64_t k_head, const void *v, int64_t v_tok, int64_t v_head, void *out, int lq,
                              int lk, int offset, int q_heads, int kv_heads, int dim, float scale, int threads) {
#ifdef HAVE_DPBF16
    if (dim % 32 || dim > MAX_DIM || kv_heads < 1 || q_heads % kv_heads || q_heads / kv_heads > 16 || lq < 1 ||
        offset < 0 || lk < lq + offset)
        return -1;
    const int pairs = dim / 2;
    const int64_t keys_pad = ((int64_t)lk + KT - 1) / KT * KT;
    uint32_t *kp = calloc((size_t)kv_heads * pairs * keys_pad, 4), *vp = calloc((size_t)kv_heads * keys_pad * pairs, 4);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return -2;
    }
    const uint16_t *ks = k, *vs = v;
    for (int h = 0; h < kv_heads; h++) {
        uint32_t *kh = kp + (int64_t)h * pairs * keys_pad, *vh = vp + (int64_t)h * (keys_pad / 2) * dim;
        for (int t = 0; t < lk; t++) {
            const uint16_t *kr = ks + t * k_tok + h * k_head;
            for (int i = 0; i < pairs; i++)
                kh[(int64_t)i * keys_pad + t] = bf16_pair(kr[2 * i], kr[2 * i + 1]);
            const uint16_t *vr = vs + t * v_tok + h * v_head;
            uint16_t *vdst = (uint16_t *)(vh + (int64_t)(t / 2) * dim) + (t & 1);
            for (int d = 0; d < dim; d++)
                vdst[2 * d] = vr[d];
        }
    }
    if (threads < 1)
        threads = 1;
    if (threads > 64)
        threads = 64;
    PrefillJob jobs[64];
    int next = 0;
    for (int i = 0; i < threads; i++)
        jobs[i] = (PrefillJob){q, q_tok, q_head, kp, vp, keys_pad, out, lq, lk, offset, q_heads, kv_heads, dim,
                               scale, &next, 0};
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int i = 0; i < threads; i++)
        prefill_thread(&jobs[i]);
    int status = 0;
    for (int i = 0; i < threads; i++)
        status = jobs[i].status ? jobs[i].status : status;
    free(kp);
    free(vp);
    return status;
#else
    (void)q; (void)q_tok; (void)q_head; (void)k; (void)k_tok; (void)k_head; (void)v; (void)v_tok; (void)v_head;
    (void)out; (void)lq; (void)lk; (void)offset; (void)q_heads; (void)kv_heads; (void)dim; (void)scale; (void)threads;
    return -3;
#endif
}
