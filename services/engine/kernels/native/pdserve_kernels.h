/* Every function pdserve's native kernels export, and the structs decoder.c takes,
 * declared once. Each .c includes this header, so the compiler checks every definition
 * against its declaration here; the Python side reads its ctypes argument and result
 * types from it (header.py). Keep to the forms header.py reads: one declaration per
 * statement, one field per line, the types it maps (int, int64_t, float, pointers).
 *
 * Strides and sizes are in elements. `bf16`: 1 for bfloat16 data, 0 for float32.
 * The kernels return 0, or a nonzero code for arguments they do not take.
 */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H

#include <stdint.h>

/* ---- attention.c ---- */
int pdserve_paged_decode_attention(const void *q, const void *k, const void *v, void *out, const int64_t *table,
                                   int64_t table_stride, const int32_t *lens, int batch, int q_heads, int kv_heads,
                                   int dim, int block_size, int64_t block_stride, int64_t token_stride, float scale,
                                   int bf16, int threads);
int pdserve_prefill_supported(void);
int pdserve_prefill_attention(const void *q, int64_t q_tok, int64_t q_head, const void *k, int64_t k_tok,
                              int64_t k_head, const void *v, int64_t v_tok, int64_t v_head, void *out, int lq,
                              int lk, int offset, int q_heads, int kv_heads, int dim, float scale, int threads);

/* ---- layers.c ---- */
int pdserve_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t out_stride, int rows,
                     int dim, float eps, int bf16, int threads);
int pdserve_silu_mul(const void *gu, int64_t gu_stride, void *out, int64_t out_stride, int rows, int inter,
                     int bf16, int threads);
int pdserve_rotary(void *x, int64_t token_stride, int64_t head_stride, const void *cos, const void *sin,
                   int64_t cs_stride, int tokens, int heads, int dim, int bf16, int threads);
int pdserve_quantize_rows(const void *x, int64_t x_stride, uint8_t *out, int64_t out_stride, float *scales,
                          int rows, int dim, int bf16, int threads);
int pdserve_rms_norm_quantize(const void *x, int64_t x_stride, const void *w, uint8_t *out, int64_t out_stride,
                              float *scales, int rows, int dim, float eps, int bf16, int threads);
int pdserve_dequant_rows(const float *y, int64_t y_stride, const float *scales, const void *bias,
                         const void *residual, int64_t res_stride, void *out, int64_t out_stride, int rows, int n,
                         int bf16, int threads);
int pdserve_silu_mul_quantize(const float *y, int64_t y_stride, const float *scales, uint8_t *out,
                              int64_t out_stride, float *out_scales, int rows, int inter, int threads);

/* ---- matmul.c: `*_supported` says whether this build's CPU runs the kind natively;
 * where it does not, the kernel refuses every call (code 2). ---- */
int pdserve_matmul_supported(void);
int pdserve_linear_bf16(const uint16_t *x, int64_t ldx, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                        const float *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy, int gated,
                        int threads);
/* The same on AMX tiles: `pdserve_amx_supported` says whether this build has them and
 * the OS lets the process use them (asking once). */
int pdserve_amx_supported(void);
int pdserve_linear_amx_bf16(const uint16_t *x, int64_t ldx, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                            const float *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy,
                            int gated, int threads);
int pdserve_int8_supported(void);
int pdserve_linear_u8s8(const uint8_t *x, int64_t ldx, int64_t rows, const int8_t *w, int64_t n, int64_t k,
                        const int32_t *comp, const float *scale, float *y, int64_t ldy, int threads);
int pdserve_f32_supported(void);
int pdserve_linear_f32(const float *x, int64_t ldx, int64_t rows, const float *w, int64_t n, int64_t k,
                       const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int gated,
                       int threads);

/* ---- decoder.c ---- */

/* The kernels decoder.c calls, from their own libraries: the caller hands their entry
 * points in, so each keeps its one build. */
typedef struct {
    __typeof__(pdserve_linear_bf16) *linear;
    __typeof__(pdserve_rms_norm) *norm;
    __typeof__(pdserve_rotary) *rotary;
    __typeof__(pdserve_paged_decode_attention) *attend;
} pdserve_kernels;

typedef struct {
    const uint16_t *norm_in;            /* [hidden] */
    const uint16_t *norm_post;
    const uint16_t *qkv;                /* packed (matmul.c) */
    const uint16_t *o;
    const uint16_t *gate_up;
    const uint16_t *down;
    const float *qkv_bias;              /* packed order, or NULL */
    const float *o_bias;
    const float *gate_up_bias;
    const float *down_bias;
    float eps_in;
    float eps_post;
} pdserve_layer;

typedef struct {
    int64_t layers;
    int64_t hidden;
    int64_t q_heads;
    int64_t kv_heads;
    int64_t dim;
    int64_t inter;
    /* The pool, [layers, 2, blocks, block_size, kv_heads, dim]: */
    int64_t layer_stride;
    int64_t half_stride;
    int64_t block_stride;
    int64_t token_stride;
    int64_t block_size;
    float scale;
    const pdserve_layer *layer;
} pdserve_model;

/* Scratch elements `pdserve_decode_layers` needs for `rows` rows. */
int64_t pdserve_decode_scratch(const pdserve_model *m, int64_t rows);
/* Returns 0, or the failing step (1-7). */
int pdserve_decode_layers(const pdserve_kernels *k, const pdserve_model *m, uint16_t *kv, uint16_t *hidden,
                          uint16_t *scratch, int rows, const uint16_t *cos, const uint16_t *sin,
                          const int64_t *slots, const int64_t *table, int64_t table_stride, const int32_t *lens,
                          int threads);

#endif
