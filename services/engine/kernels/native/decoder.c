/* A decode step's decoder layers in one call, bfloat16, for a Llama-family model whose
 * layers all run in pdserve's native kernels (fusion.LeanDecoderLayer with the native
 * matmul, norms and rotary, and the native paged decode attention).
 *
 * Per layer, in the order LeanDecoderLayer.forward calls the same kernels (so the bits
 * are the same):
 *
 *   x = rms_norm(h)                      q|k|v = x Wqkv^T       rotate q and k in place
 *   K/V of each row into its slot        a = attention(q, pool)  h' = a Wo^T + h
 *   x = rms_norm(h')                     g = silu(x Wg^T) * (x Wu^T)   h = g Wd^T + h'
 *
 * Why: at decode's few rows each of these is microseconds of work, and calling them one
 * by one from Python (argument checks, views, a new tensor per output, ctypes) cost
 * ~180 us a layer, 5.4 ms of a 39 ms step of 16 sequences in SmolLM2-135M's 30 layers.
 *
 * The kernels live in their own libraries (matmul.c, layers.c, attention.c); the caller
 * hands their entry points in (`Kernels`), so each keeps its one build. The embedding,
 * rotary angles, final norm and vocabulary projection stay with the caller.
 */
#include <stdint.h>
#include <string.h>

typedef int (*linear_fn)(const uint16_t *x, int64_t ldx, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                         const float *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy, int gated,
                         int threads);
typedef int (*norm_fn)(const void *x, int64_t x_stride, const void *w, void *out, int64_t out_stride, int rows,
                       int dim, float eps, int bf16, int threads);
typedef int (*rotary_fn)(void *x, int64_t token_stride, int64_t head_stride, const void *cos, const void *sin,
                         int64_t cs_stride, int tokens, int heads, int dim, int bf16, int threads);
typedef int (*attend_fn)(const void *q, const void *k, const void *v, void *out, const int64_t *table,
                         int64_t table_stride, const int32_t *lens, int batch, int q_heads, int kv_heads, int dim,
                         int block_size, int64_t block_stride, int64_t token_stride, float scale, int bf16,
                         int threads);

typedef struct {
    linear_fn linear;           /* pdserve_linear_bf16 */
    norm_fn norm;               /* pdserve_rms_norm */
    rotary_fn rotary;           /* pdserve_rotary */
    attend_fn attend;           /* pdserve_paged_decode_attention */
} Kernels;

typedef struct {
    const uint16_t *norm_in, *norm_post;                    /* [hidden] */
    const uint16_t *qkv, *o, *gate_up, *down;               /* packed (matmul.c) */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;    /* packed order, or NULL */
    float eps_in, eps_post;
} Layer;

typedef struct {
    int64_t layers, hidden, q_heads, kv_heads, dim, inter;
    /* The pool, [layers, 2, blocks, block_size, kv_heads, dim], in elements: */
    int64_t layer_stride, half_stride, block_stride, token_stride, block_size;
    float scale;
    const Layer *layer;
} Model;

/* Scratch elements `pdserve_decode_layers` needs for `rows` rows. */
int64_t pdserve_decode_scratch(const Model *m, int64_t rows) {
    const int64_t qw = m->q_heads * m->dim, kw = m->kv_heads * m->dim;
    return rows * (m->hidden + (qw + 2 * kw) + 2 * qw + m->inter + m->hidden);
}

/* hidden [rows, hidden] in and out (each layer's input, then the last one's output);
 * cos/sin [rows, dim]; slots [rows] (each row's new K/V); table [rows, table_stride] and
 * lens [rows] as the attention kernel takes them. Returns 0, or the failing step (1-7):
 * the kernels check their arguments and refuse what they cannot run. */
int pdserve_decode_layers(const Kernels *k, const Model *m, uint16_t *kv, uint16_t *hidden, uint16_t *scratch,
                          int rows, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                          const int64_t *table, int64_t table_stride, const int32_t *lens, int threads) {
    const int64_t h = m->hidden, qw = m->q_heads * m->dim, kw = m->kv_heads * m->dim, width = qw + 2 * kw;
    uint16_t *x = scratch, *qkv = x + rows * h, *q = qkv + rows * width, *att = q + rows * qw;
    uint16_t *g = att + rows * qw, *mid = g + rows * m->inter;      /* mid: h after attention */
    for (int64_t l = 0; l < m->layers; l++) {
        const Layer *L = m->layer + l;
        uint16_t *kc = kv + l * m->layer_stride, *vc = kc + m->half_stride;
        if (k->norm(hidden, h, L->norm_in, x, h, rows, (int)h, L->eps_in, 1, threads))
            return 1;
        if (k->linear(x, h, rows, L->qkv, width, h, L->qkv_bias, NULL, 0, qkv, width, 0, threads))
            return 2;
        if (k->rotary(qkv, width, m->dim, cos, sin, m->dim, rows, (int)m->q_heads, (int)m->dim, 1, threads) ||
            k->rotary(qkv + qw, width, m->dim, cos, sin, m->dim, rows, (int)m->kv_heads, (int)m->dim, 1, threads))
            return 3;
        for (int r = 0; r < rows; r++) {
            const uint16_t *row = qkv + r * width;
            memcpy(kc + slots[r] * kw, row + qw, (size_t)kw * sizeof *row);
            memcpy(vc + slots[r] * kw, row + qw + kw, (size_t)kw * sizeof *row);
            memcpy(q + r * qw, row, (size_t)qw * sizeof *row);
        }
        if (k->attend(q, kc, vc, att, table, table_stride, lens, rows, (int)m->q_heads, (int)m->kv_heads,
                      (int)m->dim, (int)m->block_size, m->block_stride, m->token_stride, m->scale, 1, threads))
            return 4;
        if (k->linear(att, qw, rows, L->o, h, qw, L->o_bias, hidden, h, mid, h, 0, threads))
            return 5;
        if (k->norm(mid, h, L->norm_post, x, h, rows, (int)h, L->eps_post, 1, threads))
            return 1;
        if (k->linear(x, h, rows, L->gate_up, 2 * m->inter, h, L->gate_up_bias, NULL, 0, g, m->inter, 1, threads))
            return 6;
        if (k->linear(g, m->inter, rows, L->down, h, m->inter, L->down_bias, mid, h, hidden, h, 0, threads))
            return 7;
    }
    return 0;
}
