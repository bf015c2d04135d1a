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
 * hands their entry points in (`pdserve_kernels`, in pdserve_kernels.h with the other
 * structs), so each keeps its one build. The embedding, rotary angles, final norm and
 * vocabulary projection stay with the caller.
 */
#include <stdint.h>
#include <string.h>

#include "pdserve_kernels.h"

/* Scratch elements `pdserve_decode_layers` needs for `rows` rows. */
int64_t pdserve_decode_scratch(const pdserve_model *m, int64_t rows) {
    const int64_t qw = m->q_heads * m->dim, kw = m->kv_heads * m->dim;
    return rows * (m->hidden + (qw + 2 * kw) + 2 * qw + m->inter + m->hidden);
}

/* hidden [rows, hidden] in and out (each layer's input, then the last one's output);
 * cos/sin [rows, dim]; slots [rows] (each row's new K/V); table [rows, table_stride] and
 * lens [rows] as the attention kernel takes them. Returns 0, or the failing step (1-7):
 * the kernels check their arguments and refuse what they cannot run. */
int pdserve_decode_layers(const pdserve_kernels *k, const pdserve_model *m, uint16_t *kv, uint16_t *hidden,
                          uint16_t *scratch, int rows, const uint16_t *cos, const uint16_t *sin,
                          const int64_t *slots, const int64_t *table, int64_t table_stride, const int32_t *lens,
                          int threads) {
    const int64_t h = m->hidden, qw = m->q_heads * m->dim, kw = m->kv_heads * m->dim, width = qw + 2 * kw;
    uint16_t *x = scratch, *qkv = x + rows * h, *q = qkv + rows * width, *att = q + rows * qw;
    uint16_t *g = att + rows * qw, *mid = g + rows * m->inter;      /* mid: h after attention */
    for (int64_t l = 0; l < m->layers; l++) {
        const pdserve_layer *L = m->layer + l;
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
