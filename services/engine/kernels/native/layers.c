/* pdserve's native per-token layer kernels for CPU: the element-wise work around the
 * matmuls, each done in one pass over its rows instead of torch's chain of separate
 * element-wise ops (each a full read and write of the tensor, and in bfloat16 a
 * conversion to float32 and back every time).
 *
 *   rms_norm   out = x / sqrt(mean(x^2) + eps) * weight          (Llama-family RMSNorm)
 *   silu_mul   out = silu(gate) * up, from one [rows, 2 * inter] gate|up product
 *   rotary     q and k rotated in place by the cos/sin of each token's position
 *   quantize   each row to int8 with its own scale (amax / 127), stored offset by 128 as
 *              uint8: the activations of an int8 matmul (dynamic, per token)
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
#include "pdserve_kernels.h"


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
        /* the largest row: 2 x 16384 (norm), 4 x 4096 (rotary); 128 KiB, too much for a
         * thread's stack where stacks are small (musl's default, a small OMP_STACKSIZE) */
        static __thread float buf[2 * 16384];
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

/* Row r of n->x, normalized, into buf (float32; buf holds 2 x dim). */
static float *norm_into(const NormArgs *n, int r, float *buf) {
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
    return x;
}

static void norm_row(const void *a, int r, float *buf) {
    const NormArgs *n = (const NormArgs *)a;
    store(n->out, (int64_t)r * n->out_stride, n->dim, n->bf16, norm_into(n, r, buf));
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

/* ---- per-row (per-token) symmetric int8 quantization, stored as uint8 + 128 ----
 * scale = max|x| / 127 (1 for an all-zero row); q = round(x / scale) + 128, in [1, 255]
 * (halves round up).
 * oneDNN's u8 x s8 kernels take the 128 as the activations' zero point. */
typedef struct {
    const void *x;
    uint8_t *out;
    float *scales;
    int64_t x_stride, out_stride;
    int dim, bf16;
} QuantArgs;

static void quantize_buf(const float *x, int n, uint8_t *o, float *scale_out) {
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    const float inv = 1.0f / scale;
#pragma omp simd
    for (int i = 0; i < n; i++) {
        float v = fminf(fmaxf(x[i] * inv, -127.0f), 127.0f);
        o[i] = (uint8_t)(int)(v + 128.5f);           /* positive here: truncation rounds */
    }
    *scale_out = scale;
}

static void quantize_row(const void *a, int r, float *buf) {
    const QuantArgs *q = (const QuantArgs *)a;
    load(q->x, (int64_t)r * q->x_stride, q->dim, q->bf16, buf);
    quantize_buf(buf, q->dim, q->out + (int64_t)r * q->out_stride, q->scales + r);
}

int pdserve_quantize_rows(const void *x, int64_t x_stride, uint8_t *out, int64_t out_stride, float *scales,
                          int rows, int dim, int bf16, int threads) {
    if (dim < 1 || dim > 32768 || rows < 0)
        return 1;
    QuantArgs a = {x, out, scales, x_stride, out_stride, dim, bf16};
    return run_rows(quantize_row, &a, rows, threads);
}

/* RMSNorm straight into per-row int8 (the norm's output feeds only an int8 matmul). */
typedef struct {
    NormArgs norm;
    uint8_t *out;
    float *scales;
    int64_t out_stride;
} NormQuantArgs;

static void norm_quant_row(const void *a, int r, float *buf) {
    const NormQuantArgs *q = (const NormQuantArgs *)a;
    quantize_buf(norm_into(&q->norm, r, buf), q->norm.dim, q->out + (int64_t)r * q->out_stride, q->scales + r);
}

int pdserve_rms_norm_quantize(const void *x, int64_t x_stride, const void *w, uint8_t *out, int64_t out_stride,
                              float *scales, int rows, int dim, float eps, int bf16, int threads) {
    if (dim < 1 || dim > 16384 || rows < 0)
        return 1;
    NormQuantArgs a = {{x, w, NULL, x_stride, 0, dim, bf16, eps}, out, scales, out_stride};
    return run_rows(norm_quant_row, &a, rows, threads);
}

/* ---- after an int8 matmul: y (float32, [rows, n]) times each row's activation scale,
 * plus an optional bias [n] and residual [rows, n], stored in the model's dtype ---- */
typedef struct {
    const float *y;
    const float *scales;
    const void *bias, *residual;
    void *out;
    int64_t y_stride, res_stride, out_stride;
    int n, bf16;
} DequantArgs;

static void dequant_row(const void *a, int r, float *buf) {
    const DequantArgs *d = (const DequantArgs *)a;
    const float *y = d->y + (int64_t)r * d->y_stride;
    const float s = d->scales[r];
    for (int c = 0; c < d->n; c += 8192) {
        int m = d->n - c < 8192 ? d->n - c : 8192;
        float *o = buf, *t = buf + 8192;
#pragma omp simd
        for (int i = 0; i < m; i++)
            o[i] = y[c + i] * s;
        if (d->bias) {
            load(d->bias, c, m, d->bf16, t);
#pragma omp simd
            for (int i = 0; i < m; i++)
                o[i] += t[i];
        }
        if (d->residual) {
            load(d->residual, (int64_t)r * d->res_stride + c, m, d->bf16, t);
#pragma omp simd
            for (int i = 0; i < m; i++)
                o[i] += t[i];
        }
        store(d->out, (int64_t)r * d->out_stride + c, m, d->bf16, o);
    }
}

int pdserve_dequant_rows(const float *y, int64_t y_stride, const float *scales, const void *bias,
                         const void *residual, int64_t res_stride, void *out, int64_t out_stride, int rows, int n,
                         int bf16, int threads) {
    if (n < 1 || rows < 0)
        return 1;
    DequantArgs a = {y, scales, bias, residual, out, y_stride, res_stride, out_stride, n, bf16};
    return run_rows(dequant_row, &a, rows, threads);
}

/* ---- an int8 gate|up product ([rows, 2 * inter], float32) scaled back, SiLU-and-multiply,
 * and quantized per row for the down projection ---- */
typedef struct {
    const float *y;
    const float *scales;
    uint8_t *out;
    float *out_scales;
    int64_t y_stride, out_stride;
    int inter;
} SiluQuantArgs;

static void silu_quant_row(const void *a, int r, float *buf) {
    const SiluQuantArgs *q = (const SiluQuantArgs *)a;
    const float *g = q->y + (int64_t)r * q->y_stride, *u = g + q->inter;
    const float s = q->scales[r];
#pragma omp simd
    for (int i = 0; i < q->inter; i++) {
        float x = g[i] * s;
        buf[i] = x / (1.0f + fast_expf(-x)) * (u[i] * s);
    }
    quantize_buf(buf, q->inter, q->out + (int64_t)r * q->out_stride, q->out_scales + r);
}

int pdserve_silu_mul_quantize(const float *y, int64_t y_stride, const float *scales, uint8_t *out,
                              int64_t out_stride, float *out_scales, int rows, int inter, int threads) {
    if (inter < 1 || inter > 32768 || rows < 0)
        return 1;
    SiluQuantArgs a = {y, scales, out, out_scales, y_stride, out_stride, inter};
    return run_rows(silu_quant_row, &a, rows, threads);
}
