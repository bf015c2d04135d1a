/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * For every sequence the kernel walks its blocks once for K and once for V. Each
 * token's K (then V) for all KV heads is one contiguous row of the block, scored
 * against every query head that shares it (grouped-query attention); the softmax runs
 * in float32. Nothing is gathered or transposed first, so a decode step reads every
 * cached byte once, in order, instead of copying it twice before the math. The next
 * rows are prefetched while the current one is used: the blocks of a sequence are
 * scattered over the pool, which the hardware prefetcher cannot follow.
 *
 * Layout of one layer's cache (K or V): [blocks, block_size, kv_heads, dim], float32
 * or bfloat16; the query and output are [batch, q_heads, dim] in the same dtype.
 * Rows are split over `threads` POSIX threads.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#endif

#define MAX_DIM 256
#define MAX_HEADS 64
#define PREFETCH_AHEAD 4        /* tokens */

typedef struct {
    const void *q, *k, *v;
    void *out;
    const int64_t *table;
    const int32_t *lens;
    int64_t table_stride, block_stride, token_stride;
    int q_heads, kv_heads, dim, block_size, bf16;
    float scale;
    int first, last;        /* rows [first, last) */
    float *scores;          /* q_heads * max_len floats */
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

static inline int64_t token_offset(const Job *j, const int64_t *blocks, int t) {
    return blocks[t / j->block_size] * j->block_stride + (int64_t)(t % j->block_size) * j->token_stride;
}

static inline void prefetch_row(const void *base, int64_t offset, int bytes, int elem) {
    const char *p = (const char *)base + offset * elem;
    for (int i = 0; i < bytes; i += 64)
        __builtin_prefetch(p + i, 0, 0);
}

#ifdef HAVE_DPBF16
/* The K pass for bfloat16 with AVX512-BF16: the dot products run on pairs of bf16
 * straight from the cache (vdpbf16ps accumulates in float32), no conversion first.
 * Writes scaled scores; the caller takes their maximum. */
static inline __attribute__((always_inline)) void score_bf16(const Job *j, const int64_t *blocks, int len,
                                                             int64_t q_at, const int kv_heads, const int group,
                                                             const int dim) {
    const int chunks = dim / 32, q_heads = kv_heads * group;
    const uint16_t *q = (const uint16_t *)j->q + q_at, *k = (const uint16_t *)j->k;
    __m512bh qv[MAX_HEADS * MAX_DIM / 32];
    for (int i = 0; i < q_heads * chunks; i++)
        qv[i] = (__m512bh)_mm512_loadu_si512(q + 32 * i);
    for (int t = 0; t < len; t++) {
        if (t + PREFETCH_AHEAD < len)
            prefetch_row(j->k, token_offset(j, blocks, t + PREFETCH_AHEAD), kv_heads * dim * 2, 2);
        const uint16_t *row = k + token_offset(j, blocks, t);
        for (int h = 0; h < kv_heads; h++) {
            __m512bh kc[MAX_DIM / 32];
            for (int c = 0; c < chunks; c++)
                kc[c] = (__m512bh)_mm512_loadu_si512(row + h * dim + 32 * c);
            for (int g = 0; g < group; g++) {
                const int head = h * group + g;
                __m512 acc = _mm512_setzero_ps();
                for (int c = 0; c < chunks; c++)
                    acc = _mm512_dpbf16_ps(acc, qv[head * chunks + c], kc[c]);
                j->scores[(int64_t)head * len + t] = _mm512_reduce_add_ps(acc) * j->scale;
            }
        }
    }
}
#endif

/* The work of one thread. Inlined with constant `bf16`, `kv_heads`, `group` and `dim`
 * for the common shapes (run() below), so the compiler unrolls and vectorizes the inner
 * loops fully. */
static inline __attribute__((always_inline)) void attend(const Job *j, const int bf16, const int kv_heads,
                                                         const int group, const int dim) {
    const int q_heads = kv_heads * group, width = kv_heads * dim, elem = bf16 ? 2 : 4;
    const int row_bytes = width * elem;
    static __thread float qf[MAX_HEADS * MAX_DIM], acc[MAX_HEADS * MAX_DIM], row[MAX_HEADS * MAX_DIM];
    for (int b = j->first; b < j->last; b++) {
        const int len = j->lens[b];
        const int64_t *blocks = j->table + (int64_t)b * j->table_stride;
        const int64_t q_at = (int64_t)b * q_heads * dim;
        if (len <= 0) {                                 /* nothing to attend to */
            memset(acc, 0, (size_t)q_heads * dim * sizeof(float));
            store_row(j->out, q_at, q_heads * dim, bf16, acc);
            continue;
        }
        load_row(j->q, q_at, q_heads * dim, bf16, qf);
        for (int i = 0; i < q_heads * dim; i++)
            qf[i] *= j->scale;
        float best[MAX_HEADS];
        for (int g = 0; g < q_heads; g++)
            best[g] = -FLT_MAX;
        /* scores[head][t] = q_head . k_t */
#ifdef HAVE_DPBF16
        if (bf16 && dim % 32 == 0) {
            score_bf16(j, blocks, len, q_at, kv_heads, group, dim);
        } else
#endif
        for (int t = 0; t < len; t++) {
            if (t + PREFETCH_AHEAD < len)
                prefetch_row(j->k, token_offset(j, blocks, t + PREFETCH_AHEAD), row_bytes, elem);
            load_row(j->k, token_offset(j, blocks, t), width, bf16, row);
            for (int h = 0; h < kv_heads; h++)
                for (int g = 0; g < group; g++) {
                    const float *qh = qf + (h * group + g) * dim, *kh = row + h * dim;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < dim; d++)
                        s += qh[d] * kh[d];
                    j->scores[(int64_t)(h * group + g) * len + t] = s;
                    if (s > best[h * group + g])
                        best[h * group + g] = s;
                }
        }
        float total[MAX_HEADS];
        for (int g = 0; g < q_heads; g++) {
            float *s = j->scores + (int64_t)g * len, sum = 0.0f, m = best[g];
#ifdef HAVE_DPBF16
            if (bf16 && dim % 32 == 0) {
#pragma omp simd reduction(max : m)
                for (int t = 0; t < len; t++)
                    m = s[t] > m ? s[t] : m;
            }
#endif
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < len; t++) {
                s[t] = expf(s[t] - m);
                sum += s[t];
            }
            total[g] = sum;
        }
        memset(acc, 0, (size_t)q_heads * dim * sizeof(float));
        /* out_head = sum_t p[head][t] v_t / sum */
        for (int t = 0; t < len; t++) {
            if (t + PREFETCH_AHEAD < len)
                prefetch_row(j->v, token_offset(j, blocks, t + PREFETCH_AHEAD), row_bytes, elem);
            load_row(j->v, token_offset(j, blocks, t), width, bf16, row);
            for (int h = 0; h < kv_heads; h++)
                for (int g = 0; g < group; g++) {
                    const float p = j->scores[(int64_t)(h * group + g) * len + t];
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
        store_row(j->out, q_at, q_heads * dim, bf16, acc);
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

static void *run_thread(void *arg) {
    run((const Job *)arg);
    return NULL;
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
    float *scores = malloc((size_t)threads * q_heads * max_len * sizeof(float));
    if (!scores)
        return -2;
    Job jobs[64];
    pthread_t tids[64];
    for (int i = 0; i < threads; i++)
        jobs[i] = (Job){q, k, v, out, table, lens, table_stride, block_stride, token_stride, q_heads, kv_heads,
                        dim, block_size, bf16, scale, (int)((int64_t)batch * i / threads),
                        (int)((int64_t)batch * (i + 1) / threads), scores + (size_t)i * q_heads * max_len};
    int started = 1;
    for (int i = 1; i < threads; i++, started++)
        if (pthread_create(&tids[i], NULL, run_thread, &jobs[i]) != 0)
            break;
    for (int i = started; i < threads; i++)          /* threads that could not start: run here */
        run(&jobs[i]);
    run(&jobs[0]);
    for (int i = 1; i < started; i++)
        pthread_join(tids[i], NULL);
    free(scores);
    return 0;
}
