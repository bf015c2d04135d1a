/* pdserve's native per-token layer kernels for CPU: the element-wise work around the
 * matmuls, each done in one pass over its rows instead of torch's chain of separate
 * element-wise ops (each a full read and write of the tensor, and in bfloat16 a
 * conversion to float32 and back every time).
 *
 *   rms_norm   out = x / sqrt(mean(x^2) + eps) * weight          (Llama-family RMSNorm)
 *   silu_mul   out = silu(gate) * up, from one [rows, 2 * inter] gate|up product
 *   rotary     q and k rotated in place by the cos/sin of each token's position
 *
 * All math is float32; bfloat16 tensors are widened on load and rounded to nearest even
 * on store. Rows may be strided; the last dimension is contiguous. Rows are split over
 * `threads` OpenMP threads (torch's own team: see attention.c).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"


static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40);                         /* quiet NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);    /* round to nearest even */
}

static inline void load(const void *base, int64_t off, int n, int bf16, float *dst) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)base + off;
#pragma omp simd
        for (int i = 0; i < n; i++)
            dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    }
}

static inline void store(void *base, int64_t off, int n, int bf16, const float *src) {
    if (bf16) {
        uint16_t *d = (uint16_t *)base + off;
#pragma omp simd
        for (int i = 0; i < n; i++)
            d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)base + off, src, (size_t)n * sizeof(float));
    }
}

/* Rows [0, rows) through `row`, split over up to `threads` threads (one if the rows are few). */
static int run_rows(void (*row)(const void *, int, float *), const void *args, int rows, int threads) {
    if (threads > rows / 8)
        threads = rows / 8;
    if (threads < 1)
        threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float buf[2 * 16384];       /* the largest row: 2 x 16384 (norm), 4 x 4096 (rotary) */
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            row(args, r, buf);
    }
    return 0;
}

/* ---- RMSNorm ---- */
typedef struct {
    const void *x, *w;
    void *out;
    int64_t x_stride, out_stride;
    int dim, bf16;
    float eps;
} NormArgs;

static void norm_row(const void *a, int r, float *buf) {
    const NormArgs *n = (const NormArgs *)a;
    float *x = buf, *w = buf + n->dim;
    load(n->x, (int64_t)r * n->x_stride, n->dim, n->bf16, x);
    load(n->w, 0, n->dim, n->bf16, w);
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n->dim; i++)
        ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n->dim + n->eps);
#pragma omp simd
    for (int i = 0; i < n->dim; i++)
        x[i] = x[i] * inv * w[i];
    store(n->out, (int64_t)r * n->out_stride, n->dim, n->bf16, x);
}

int pdserve_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t out_stride, int rows,
                     int dim, float eps, int bf16, int threads) {
    if (dim < 1 || dim > 16384 || rows < 0)
        return 1;
    NormArgs a = {x, w, out, x_stride, out_stride, dim, bf16, eps};
    return run_rows(norm_row, &a, rows, threads);
}

/* ---- SiLU and multiply ---- */
typedef struct {
    const void *gu;
    void *out;
    int64_t gu_stride, out_stride;
    int inter, bf16;
} SiluArgs;

static void silu_row(const void *a, int r, float *buf) {
    const SiluArgs *s = (const SiluArgs *)a;
    for (int c = 0; c < s->inter; c += 8192) {
        int n = s->inter - c < 8192 ? s->inter - c : 8192;
        float *g = buf, *u = buf + 8192;
        load(s->gu, (int64_t)r * s->gu_stride + c, n, s->bf16, g);
        load(s->gu, (int64_t)r * s->gu_stride + s->inter + c, n, s->bf16, u);
#pragma omp simd
        for (int i = 0; i < n; i++)
            g[i] = g[i] / (1.0f + fast_expf(-g[i])) * u[i];
        store(s->out, (int64_t)r * s->out_stride + c, n, s->bf16, g);
    }
}

int pdserve_silu_mul(const void *gu, int64_t gu_stride, void *out, int64_t out_stride, int rows, int inter,
                     int bf16, int threads) {
    if (inter < 1 || rows < 0)
        return 1;
    SiluArgs a = {gu, out, gu_stride, out_stride, inter, bf16};
    return run_rows(silu_row, &a, rows, threads);
}

/* ---- rotary embedding, "rotate half" layout, in place ----
 * x' = x * cos + [-x2, x1] * sin per head, as Hugging Face's Llama-family models apply it. */
typedef struct {
    void *x;                                    /* rows are tokens: [tokens, heads, dim] */
    const void *cos, *sin;                      /* [tokens, dim] */
    int64_t token_stride, head_stride, cs_stride;
    int heads, dim, bf16;
} RotaryArgs;

static void rotary_row(const void *a, int r, float *buf) {
    const RotaryArgs *o = (const RotaryArgs *)a;
    const int half = o->dim / 2;
    float *c = buf, *s = buf + o->dim, *x = buf + 2 * o->dim, *y = buf + 3 * o->dim;
    load(o->cos, (int64_t)r * o->cs_stride, o->dim, o->bf16, c);
    load(o->sin, (int64_t)r * o->cs_stride, o->dim, o->bf16, s);
    for (int h = 0; h < o->heads; h++) {
        const int64_t off = (int64_t)r * o->token_stride + (int64_t)h * o->head_stride;
        load(o->x, off, o->dim, o->bf16, x);
#pragma omp simd
        for (int i = 0; i < half; i++) {
            y[i] = x[i] * c[i] - x[i + half] * s[i];
            y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        store(o->x, off, o->dim, o->bf16, y);
    }
}

int pdserve_rotary(void *x, int64_t token_stride, int64_t head_stride, const void *cos, const void *sin,
                   int64_t cs_stride, int tokens, int heads, int dim, int bf16, int threads) {
    if (dim < 2 || dim > 4096 || dim % 2 || tokens < 0 || heads < 1)
        return 1;
    RotaryArgs a = {x, cos, sin, token_stride, head_stride, cs_stride, heads, dim, bf16};
    return run_rows(rotary_row, &a, tokens, threads);
}
