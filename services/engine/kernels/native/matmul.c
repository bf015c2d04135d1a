/* pdserve's own matmuls: bfloat16 (AVX512-BF16, or AMX tiles below), y = x W^T (+ bias),
 * with its epilogue applied as each output tile is written,
 *
 *   plain      y = x W^T + bias (+ residual)             (projections, o + residual, down + residual)
 *   gated      y = silu(x G^T + bg) * (x U^T + bu)        (gate|up and SiLU-and-multiply in one pass)
 *
 * uint8 x int8 (AVX512-VNNI) for `--quantization int8`: y = (x - 128) W^T * scale per
 * column, float32, the input stored + 128 as the layer kernels quantize it; and float32
 * (AVX2 + FMA, at the end of this file) with the same epilogues, for CPUs without native
 * bfloat16, where float32 is what the engine runs.
 *
 * Why not oneDNN's: at the row counts decode runs (1 to 32 sequences) its bfloat16 matmul
 * streamed SmolLM2's weights at 9-15 GB/s of a core's ~28, and a step of one sequence is
 * nothing but that stream (its int8 one did no better with half the bytes). Here each
 * tile of weights is read once for up to 4 rows (8 when there are more), from a layout
 * made for the instruction: ~23 GB/s at 1 row, and oneDNN's own ~220 GFLOP/s (bf16) from
 * 64 rows up (bench/matmul.py, one core).
 *
 * Weights are packed once ("VNNI" order): groups of 16 output columns, each group's K
 * values in 4-byte steps (bf16 pairs, int8 quads), [N/16][K/2][16][2] or
 * [N/16][K/4][16][4], so one 64-byte load holds one step of 16 columns and vdpbf16ps
 * (vpdpbusd) multiplies it with one broadcast step of x. For the gated form, gate and up
 * groups alternate (gate 0..15, up 0..15, gate 16..31, ...). N is padded to a multiple of
 * 16 with zero rows; the stores are masked to the real N. Sums (float32; int32, exact,
 * for int8) run in the same k order for every row whatever the batch (no split-K): a
 * row's result does not depend on which other rows share the call. bf16 output rounds to
 * nearest even, once.
 *
 * Work is split over `threads` OpenMP threads (torch's own team: see attention.c) in units
 * of 64 output columns by up to 64 rows, dealt dynamically (run() below).
 *
 * float32 (AVX2 + FMA) packs groups of 8 columns, [N/8][K][8], and runs tiles of up to 6
 * rows by 2 groups (BLIS's 6x16 shape: 12 ymm sums), or 2 rows by 4 groups where there
 * are only 1 or 2 rows. Each tile's weights are read once from memory (prefetched ahead
 * on the first pass) and stay in cache while every strip of rows in the unit passes over
 * them. On an AVX2-only EPYC (Zen 3), one core: ~12 GB/s of weights at 1 row against
 * torch's ~7, 1.1-2.3x torch's speed at 4-32 rows, level (~60-70 GFLOP/s) from 64 up.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"
#include "pdserve_kernels.h"

/* One kind's panel: rows [m0, m0 + mt) by column groups [g0, g1). [n0, n1): the groups of
 * the panel this thread takes next, which it prefetches meanwhile (n0 == n1: none known,
 * each tile prefetches its own weights ahead as it goes). */
typedef void (*panel_fn)(const void *call, int64_t m0, int64_t mt, int64_t g0, int64_t g1, int64_t n0, int64_t n1);

/* A unit of work is a panel (`per_panel` groups, 64 columns) over a block of up to
 * BLOCK_ROWS rows, in tiles of `mstep` rows: the panel's weights are read from memory
 * once and stay in L2 for the block's rows. Units are dealt to threads as they come free
 * (dynamic), not in fixed shares: a thread whose core is shared (a prefill worker
 * borrowing a decode worker's core) does what it can and the others do the rest,
 * instead of the whole team waiting for its share. One thread over one block of rows
 * takes the panels in order, so it knows the next one (decode's row counts). */
#define BLOCK_ROWS 64
#define AHEAD_MIN_ROWS 3
static __attribute__((unused)) void deal(const void *call, panel_fn panel, int64_t groups, int64_t per_panel, int64_t rows, int64_t mstep,
                 int threads) {
    const int64_t panels = (groups + per_panel - 1) / per_panel;
    const int64_t blocks = rows > BLOCK_ROWS ? (rows + BLOCK_ROWS - 1) / BLOCK_ROWS : 1;
    const int in_order = threads <= 1 && blocks == 1 && rows >= AHEAD_MIN_ROWS;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (threads > 1 && panels * blocks > 1)
    for (int64_t u = 0; u < panels * blocks; u++) {
        const int64_t p = u / blocks, r0 = (u % blocks) * BLOCK_ROWS;
        const int64_t r1 = r0 + BLOCK_ROWS < rows && blocks > 1 ? r0 + BLOCK_ROWS : rows;
        const int64_t g0 = p * per_panel, g1 = g0 + per_panel < groups ? g0 + per_panel : groups;
        const int64_t n1 = in_order && p + 1 < panels ? (g1 + per_panel < groups ? g1 + per_panel : groups) : g1;
        const int64_t step = in_order ? BLOCK_ROWS : mstep;     /* the whole block at once: see ahead() */
        for (int64_t m0 = r0; m0 < r1; m0 += step)
            panel(call, m0, r1 - m0 < step ? r1 - m0 : step, g0, g1, g1, n1);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    (defined(__AVX512BF16__) || defined(__AVX512VNNI__))
#include <immintrin.h>

#define GROUP 16            /* output columns per zmm of 32-bit sums */
#define PANEL 4             /* groups per panel: the unit of work split over threads */
/* Tiles of PF_ROWS rows or more prefetch their weights PREFETCH k steps (4 KB) ahead into
 * L2. With 8 to 32 rows a tile computes long enough per cache line that the hardware
 * prefetcher fell behind: its first pass over a panel ran at ~12 GB/s. One core, SmolLM2's
 * 30 layers (bench/matmul.py): 8 rows 16.8 -> 13.3 ms, 16 rows 23.2 -> 20.6 ms, 32 rows
 * 43 -> 36 ms; 1 row and 64 up unchanged; ahead 32 steps or into L1, less gain. */
#define PREFETCH 64
#define PF_ROWS 4
#define STEP 4              /* bytes of x (and of each column's weights) per instruction: 2 bf16 or 4 int8 */

enum kind { BF16, U8S8 };

/* The call, in bytes where the element type differs: each k step takes 4 bytes of a row
 * of x (a bf16 pair, or 4 uint8) and 64 bytes of a group's weights. */
struct call {
    const uint8_t *x;       /* [rows, k] bf16 or uint8, row stride ldx bytes */
    int64_t ldx;
    const uint8_t *w;       /* packed: [groups][steps][16][4 bytes] */
    int64_t steps, n;       /* n: real output columns (of the product, before gating) */
    const float *bias;      /* bf16: [groups * 16] float32, packed order, or NULL */
    const uint16_t *res;    /* bf16: [rows, n] residual, row stride ldr, or NULL */
    int64_t ldr;
    void *y;                /* bf16: [rows, n or n/2] bf16; u8s8: [rows, n] float32; row stride ldy elements */
    int64_t ldy;
    int gated;
    const int32_t *comp;    /* u8s8: 128 * each column's weight sum (x is stored + 128) */
    const float *scale;     /* u8s8: each column's weight scale */
};

static inline __mmask16 cols_mask(int64_t first, int64_t n) {
    int64_t left = n - first;
    return left >= GROUP ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

#ifdef __AVX512BF16__
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

#ifdef __AVX512BF16__
/* One row's finished float32 sums (bias included) for groups [g, g + nt), written as the
 * call says: plain (+ residual), or gated, (gate, up) group pairs. */
static inline __attribute__((always_inline)) void emit_bf16(const struct call *c, int64_t row, int64_t g,
                                                            const int nt, const __m512 *sums) {
    uint16_t *y = (uint16_t *)c->y + row * c->ldy;
    if (c->gated) {
        for (int j = 0; j + 1 < nt; j += 2) {
            const int64_t col = (g + j) / 2 * GROUP;
            float gate[GROUP], out[GROUP];
            _mm512_storeu_ps(gate, sums[j]);
            for (int i = 0; i < GROUP; i++)
                out[i] = gate[i] / (1.0f + fast_expf(-gate[i]));
            store_bf16(y + col, _mm512_mul_ps(_mm512_loadu_ps(out), sums[j + 1]), cols_mask(col, c->n / 2));
        }
        return;
    }
    for (int j = 0; j < nt; j++) {
        const int64_t col = (g + j) * GROUP;
        const __mmask16 mask = cols_mask(col, c->n);
        __m512 v = sums[j];
        if (c->res)
            v = _mm512_add_ps(v, load_bf16(c->res + row * c->ldr + col, mask));
        store_bf16(y + col, v, mask);
    }
}
#endif

/* The next panel's packed weights, contiguous [at, end): the tiles of this one prefetch
 * `rate` lines of it per k step, so the memory stream runs under all of their arithmetic. */
struct ahead {
    const uint8_t *at, *end;
    int rate;
};

/* rows [m0, m0 + MT) by groups [g, g + NT): MT x NT sums in registers over all k (float32
 * for bf16, int32 in the same registers for u8s8). AHEAD: prefetch from `next`, else
 * (from PF_ROWS rows) the tile's own weights PREFETCH steps ahead. */

static inline __attribute__((always_inline)) void tile(const struct call *c, const enum kind KIND, const int MT,
                                                       const int NT, int64_t m0, int64_t g, const int AHEAD,
                                                       struct ahead *next) {
    __m512 acc[8][4];
    const int64_t gsize = c->steps * GROUP * STEP;      /* packed bytes per group */
    const uint8_t *w = c->w + g * gsize;
    for (int j = 0; j < NT; j++) {
        __m512 b = KIND == BF16 && c->bias ? _mm512_loadu_ps(c->bias + (g + j) * GROUP) : _mm512_setzero_ps();
        for (int m = 0; m < MT; m++)
            acc[m][j] = b;
    }
    const uint8_t *x = c->x + m0 * c->ldx;
    /* Two k steps per iteration: from 16 rows up, 5-7 % faster than one. */
#pragma GCC unroll 2
    for (int64_t s = 0; s < c->steps; s++) {
        __m512i wv[4];
        for (int j = 0; j < NT; j++)
            wv[j] = _mm512_loadu_si512((const void *)(w + j * gsize + s * GROUP * STEP));
        if (AHEAD) {
            for (int r = 0; r < next->rate && next->at < next->end; r++, next->at += 64)
                _mm_prefetch((const char *)next->at, _MM_HINT_T1);
        } else if (MT >= PF_ROWS) {
            for (int j = 0; j < NT; j++)
                _mm_prefetch((const char *)(w + j * gsize + (s + PREFETCH) * GROUP * STEP), _MM_HINT_T1);
        }
        for (int m = 0; m < MT; m++) {
            int32_t four;
            memcpy(&four, x + m * c->ldx + s * STEP, sizeof four);
            const __m512i xb = _mm512_set1_epi32(four);
            for (int j = 0; j < NT; j++) {
#ifdef __AVX512BF16__
                if (KIND == BF16)
                    acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xb, (__m512bh)wv[j]);
#endif
#ifdef __AVX512VNNI__
                if (KIND == U8S8)
                    acc[m][j] = _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc[m][j]), xb, wv[j]));
#endif
            }
        }
    }
#ifdef __AVX512BF16__
    if (KIND == BF16)
        for (int m = 0; m < MT; m++)
            emit_bf16(c, m0 + m, g, NT, acc[m]);
#endif
#ifdef __AVX512VNNI__
    if (KIND == U8S8) {             /* (sum - 128 * column sum) * column scale, as float32 */
        float *y = (float *)c->y;
        for (int j = 0; j < NT; j++) {
            int64_t col = (g + j) * GROUP;
            __mmask16 mask = cols_mask(col, c->n);
            const __m512i comp = _mm512_loadu_si512((const void *)(c->comp + col));
            const __m512 scale = _mm512_loadu_ps(c->scale + col);
            for (int m = 0; m < MT; m++) {
                __m512i sum = _mm512_sub_epi32(_mm512_castps_si512(acc[m][j]), comp);
                _mm512_mask_storeu_ps(y + (m0 + m) * c->ldy + col, mask,
                                      _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale));
            }
        }
    }
#endif
}

/* Tiles with compile-time shapes (so the sums stay in registers). */
#define ROWS_BY(KIND, NT)                                                           \
    switch (rows) {                                                                 \
    case 1: tile(c, KIND, 1, NT, m, g, AHEAD, next); break;                         \
    case 2: tile(c, KIND, 2, NT, m, g, AHEAD, next); break;                         \
    case 3: tile(c, KIND, 3, NT, m, g, AHEAD, next); break;                         \
    case 4: tile(c, KIND, 4, NT, m, g, AHEAD, next); break;                         \
    case 5: tile(c, KIND, 5, NT, m, g, AHEAD, next); break;                         \
    case 6: tile(c, KIND, 6, NT, m, g, AHEAD, next); break;                         \
    case 7: tile(c, KIND, 7, NT, m, g, AHEAD, next); break;                         \
    default: tile(c, KIND, 8, NT, m, g, AHEAD, next); break;                        \
    }

/* How many tiles strips() runs over `rows` rows and `groups` groups. */
static inline int64_t tiles(int64_t rows, int64_t groups) {
    const int64_t full = (rows - 1) / 8, last = rows - 8 * full;       /* strips of 8, then the rest */
    const int64_t by2 = groups / 2 + groups % 2, by4 = groups / 4 + groups % 4 / 2 + groups % 2;
    return full * by2 + (last <= 4 ? by4 : by2);
}

/* Rows [m0, m0 + mt) by groups [g0, g1), in strips of up to 8 rows. A strip of up to 4
 * rows takes 4 groups at a time (16 sums, 4 weight loads per k step), 5 to 8 rows take
 * 2. Even group counts stay even, which the gated form needs (a gate group and its up
 * group in one tile). */
static inline __attribute__((always_inline)) void strips(const struct call *c, const enum kind KIND, int64_t m0,
                                                         int64_t mt, int64_t g0, int64_t g1, const int AHEAD,
                                                         struct ahead *next) {
    for (int64_t m = m0; m < m0 + mt; m += 8) {
        const int64_t rows = m0 + mt - m < 8 ? m0 + mt - m : 8;
        for (int64_t g = g0; g < g1;) {
            int64_t left = g1 - g;
            if (rows <= 4 && left >= 4) {
                switch (rows) {
                case 1: tile(c, KIND, 1, 4, m, g, AHEAD, next); break;
                case 2: tile(c, KIND, 2, 4, m, g, AHEAD, next); break;
                case 3: tile(c, KIND, 3, 4, m, g, AHEAD, next); break;
                default: tile(c, KIND, 4, 4, m, g, AHEAD, next); break;
                }
                g += 4;
            } else if (left >= 2) {
                ROWS_BY(KIND, 2)
                g += 2;
            } else {
                ROWS_BY(KIND, 1)
                g += 1;
            }
        }
    }
}

/* A panel whose successor [n0, n1) is known (one thread, one block of AHEAD_MIN_ROWS to
 * BLOCK_ROWS rows): every tile prefetches its share of the next panel, so that panel's
 * stream from memory runs under all this one's arithmetic. Otherwise the first strip
 * fetches each tile's weights as it goes and runs at memory speed, and the strips after
 * it have the core to themselves. One core, SmolLM2's 30 layers (bench/matmul.py), the
 * same bits: 4 rows 11.4-12.3 -> 10.5 ms, 8 rows 12.7-13.2 -> 11.4-11.8, 12 rows 16.3-16.6
 * -> 14.9, 16 rows 20.2-20.4 -> 19.4-19.9, 32 rows 35.2-35.6 -> 33.9-34.2, 64 rows
 * unchanged; 1 and 2 rows, where the stream is all there is, gained nothing. */
static inline __attribute__((always_inline)) void ahead(const struct call *c, const enum kind KIND, int64_t m0,
                                                        int64_t mt, int64_t g0, int64_t g1, int64_t n0, int64_t n1) {
    const int64_t gsize = c->steps * GROUP * STEP, count = tiles(mt, g1 - g0);
    struct ahead next = {c->w + n0 * gsize, c->w + n1 * gsize, (int)((n1 - n0 + count - 1) / count)};
    strips(c, KIND, m0, mt, g0, g1, 1, &next);
}

/* One function per kind and prefetch mode, each with its tiles inlined. Kept apart, the
 * plain tiles compile as before (inlined in one function, 64 rows ran 5 % slower). */
#define PANELS(NAME, KIND)                                                                          \
    static __attribute__((noinline)) void ahead_##NAME(const void *c, int64_t m0, int64_t mt, int64_t g0, \
                                                       int64_t g1, int64_t n0, int64_t n1) {          \
        ahead(c, KIND, m0, mt, g0, g1, n0, n1);                                                     \
    }                                                                                               \
    static __attribute__((noinline)) void panel_##NAME(const void *c, int64_t m0, int64_t mt, int64_t g0, \
                                                       int64_t g1, int64_t n0, int64_t n1) {          \
        if (n1 > n0)                                                                                \
            ahead_##NAME(c, m0, mt, g0, g1, n0, n1);                                                \
        else                                                                                        \
            strips(c, KIND, m0, mt, g0, g1, 0, NULL);                                               \
    }
PANELS(bf16, BF16)
PANELS(u8s8, U8S8)

static void run(const struct call *c, const enum kind KIND, int64_t rows, int threads) {
    deal(c, KIND == BF16 ? panel_bf16 : panel_u8s8, (c->n + GROUP - 1) / GROUP, PANEL, rows, rows <= 4 ? 4 : 8,
         threads);
}
#endif

/* ---- bfloat16 on AMX tiles (CPUs with AMX-BF16: Intel Xeon from Sapphire Rapids) ----
 *
 * The same call, epilogues and packed weights as vdpbf16ps's above: a group's 16 k steps
 * of packed weights, [16][16][2] bf16 (1 KB, contiguous), are one B tile as tdpbf16ps
 * takes it, and 16 rows of x by 32 k values (64 bytes a row, row stride ldx) one A tile.
 * Eight tiles of 16 rows by 64 bytes: sums C0-C3 (16 x 16 float32 each), A4 and A5, B6
 * and B7. Up to 16 rows take 4 groups at a time (C0-C3 = A4 x four B loads, 64 output
 * columns), more rows strips of 32 by 2 groups (C0 C1 / C2 C3 = A4 / A5 x B6 B7). Sums
 * start at the bias and run over k tile after tile, in order, whatever the rows (no
 * split-K: batch-invariant); within a tile in the instruction's own order, so not bit for
 * bit vdpbf16ps's. A last strip of fewer than 16 rows is read from a zero-padded copy
 * made once a call. k not a whole number of tiles (32 values) goes to vdpbf16ps's path.
 *
 * Tile state is per thread and oneDNN's kernels configure it too, on the same threads:
 * each panel loads the configuration and releases the tiles when done. Linux hands AMX
 * to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, pdserve_amx_supported).
 *
 * PDSERVE_AMX_EMULATE builds the tile instructions in C instead (below), so the tiling
 * is tested on CPUs without AMX; real tiles are tested only where the CPU has them. */
#if defined(GROUP) && defined(__AVX512BF16__) && \
    ((defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(PDSERVE_AMX_EMULATE))
#define TILE_ROWS 16
#define TILE_STEPS 16       /* k steps (bf16 pairs) per tile: 64 bytes of a row of x */
#define TILE_BYTES 64

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
_Static_assert(sizeof(struct tile_config) == 64, "ldtilecfg takes 64 bytes");

#ifdef PDSERVE_AMX_EMULATE
#include <stdlib.h>
/* The tile instructions as Intel's SDM defines them: tdpbf16ps sums a row's even products
 * and its odd products apart, each from zero over the instruction's k pairs in turn, then
 * adds the two and that to the float32 sum; every add rounds to nearest even, denormal
 * inputs and results are flushed to zero. (The intrinsics guide's shorter pseudo-code,
 * adding every product to the sum in turn, is not the SDM's.) What the hardware faults on
 * aborts: a tile used unconfigured or released, a configuration it refuses, shapes that
 * disagree, one register named twice. */
static __thread struct tile_config emu_cfg;
static __thread int emu_live;
static __thread uint8_t emu[8][TILE_ROWS][TILE_BYTES];

static void emu_need(int ok) {
    if (!ok)
        abort();
}

static float emu_flush(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (!(u & 0x7f800000u))
        u &= 0x80000000u;
    memcpy(&f, &u, sizeof u);
    return f;
}

static float emu_bf16(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return emu_flush(f);
}

static void emu_config(const struct tile_config *cfg) {
    emu_need(cfg->palette == 1 && cfg->start_row == 0);
    for (int i = 0; i < 14; i++)
        emu_need(cfg->reserved[i] == 0);
    for (int t = 0; t < 16; t++)
        emu_need(t < 8 ? cfg->rows[t] <= TILE_ROWS && cfg->colsb[t] <= TILE_BYTES && !cfg->colsb[t] == !cfg->rows[t]
                       : !cfg->rows[t] && !cfg->colsb[t]);
    emu_cfg = *cfg;
    emu_live = 1;
    memset(emu, 0, sizeof emu);
}

static void emu_release(void) { emu_live = 0; }

static void emu_shape(int t) {
    emu_need(emu_live && t >= 0 && t < 8 && emu_cfg.rows[t] && emu_cfg.rows[t] <= TILE_ROWS &&
             emu_cfg.colsb[t] && emu_cfg.colsb[t] <= TILE_BYTES);
}

static void emu_zero(int t) {
    emu_shape(t);
    memset(emu[t], 0, sizeof emu[t]);
}

static void emu_load(int t, const void *p, int64_t stride) {
    emu_shape(t);
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy(emu[t][r], (const uint8_t *)p + r * stride, emu_cfg.colsb[t]);
}

static void emu_store(int t, void *p, int64_t stride) {
    emu_shape(t);
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy((uint8_t *)p + r * stride, emu[t][r], emu_cfg.colsb[t]);
}

/* One rounded add, out of line: the library is built with -ffast-math, and no compiler
 * may then reorder adds across the call. */
static __attribute__((noinline)) float emu_add(float a, float b) { return emu_flush(a + b); }

static void emu_dpbf16ps(int c, int a, int b) {
    emu_shape(c), emu_shape(a), emu_shape(b);
    emu_need(emu_cfg.rows[c] == emu_cfg.rows[a] && emu_cfg.colsb[c] == emu_cfg.colsb[b] &&
             emu_cfg.colsb[a] / 4 == emu_cfg.rows[b] && c != a && c != b && a != b);
    for (int m = 0; m < emu_cfg.rows[c]; m++) {
        float sum[TILE_ROWS], even[TILE_ROWS] = {0}, odd[TILE_ROWS] = {0};
        uint16_t x[2 * TILE_ROWS], w[2 * TILE_ROWS];
        memcpy(sum, emu[c][m], sizeof sum);
        memcpy(x, emu[a][m], sizeof x);
        for (int k = 0; k < emu_cfg.colsb[a] / 4; k++) {
            memcpy(w, emu[b][k], sizeof w);
            for (int n = 0; n < emu_cfg.colsb[c] / 4; n++) {
                even[n] = emu_add(even[n], emu_bf16(x[2 * k]) * emu_bf16(w[2 * n]));       /* products exact */
                odd[n] = emu_add(odd[n], emu_bf16(x[2 * k + 1]) * emu_bf16(w[2 * n + 1]));
            }
        }
        for (int n = 0; n < emu_cfg.colsb[c] / 4; n++)
            sum[n] = emu_add(emu_flush(sum[n]), emu_add(even[n], odd[n]));
        memcpy(emu[c][m], sum, sizeof sum);
    }
}

#define tile_config(cfg) emu_config(cfg)
#define tile_release() emu_release()
#define tile_zero(t) emu_zero(t)
#define tile_load(t, p, stride) emu_load(t, p, stride)
#define tile_store(t, p, stride) emu_store(t, p, stride)
#define tile_dp(c, a, b) emu_dpbf16ps(c, a, b)

int pdserve_amx_supported(void) { return 1; }
#else
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#define tile_config(cfg) _tile_loadconfig(cfg)
#define tile_release() _tile_release()
#define tile_zero(t) _tile_zero(t)
#define tile_load(t, p, stride) _tile_loadd(t, p, stride)
#define tile_store(t, p, stride) _tile_stored(t, p, stride)
#define tile_dp(c, a, b) _tile_dpbf16ps(c, a, b)

/* Whether this process may use the tiles: Linux 5.16 and later hand them to a process
 * that asks, once (for all its threads). */
int pdserve_amx_supported(void) {
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}
#endif

static const struct tile_config TILES = {
    .palette = 1,
    .colsb = {TILE_BYTES, TILE_BYTES, TILE_BYTES, TILE_BYTES, TILE_BYTES, TILE_BYTES, TILE_BYTES, TILE_BYTES},
    .rows = {TILE_ROWS, TILE_ROWS, TILE_ROWS, TILE_ROWS, TILE_ROWS, TILE_ROWS, TILE_ROWS, TILE_ROWS},
};

struct amx_call {
    struct call c;
    const uint8_t *tail;    /* rows [tail_from, rows) of x, zero-padded to 16, row stride steps * 4 bytes */
    int64_t tail_from;      /* -1: every strip is whole */
};

/* The A tile's source for rows [m, m + 16) and its row stride in bytes. */
static inline const uint8_t *a_source(const struct amx_call *a, int64_t m, int64_t *stride) {
    if (m == a->tail_from) {
        *stride = a->c.steps * STEP;
        return a->tail;
    }
    *stride = a->c.ldx;
    return a->c.x + m * a->c.ldx;
}

/* Sums tile `t` (0-3) starts at group g's bias in every row (one row read 16 times: a
 * row stride of 0), or zero. The bias is read where the caller keeps it: GCC's tile
 * loads take their address as a register, not as memory, so a copy made here just
 * before one would be dropped as a dead store. */
static inline void sums_start(const struct call *c, int t, int64_t g) {
    const float *bias = c->bias ? c->bias + g * GROUP : NULL;
    switch (t) {
    case 0: if (bias) tile_load(0, bias, 0); else tile_zero(0); break;
    case 1: if (bias) tile_load(1, bias, 0); else tile_zero(1); break;
    case 2: if (bias) tile_load(2, bias, 0); else tile_zero(2); break;
    default: if (bias) tile_load(3, bias, 0); else tile_zero(3); break;
    }
}

static inline void sums_store(int t, float out[TILE_ROWS][GROUP]) {
    switch (t) {
    case 0: tile_store(0, out, TILE_BYTES); break;
    case 1: tile_store(1, out, TILE_BYTES); break;
    case 2: tile_store(2, out, TILE_BYTES); break;
    default: tile_store(3, out, TILE_BYTES); break;
    }
}

/* Rows [m, m + rows) (rows <= 16) by groups [g, g + nt) (nt <= 4): one A tile, the
 * groups' B tiles loaded in turn into B6 and B7. */
static void amx_rows16(const struct amx_call *a, int64_t m, int64_t rows, int64_t g, int nt) {
    const struct call *c = &a->c;
    const int64_t gsize = c->steps * GROUP * STEP;
    const uint8_t *w = c->w + g * gsize;
    int64_t lda;
    const uint8_t *x = a_source(a, m, &lda);
    for (int j = 0; j < nt; j++)
        sums_start(c, j, g + j);
    for (int64_t s = 0; s < c->steps; s += TILE_STEPS) {
        const int64_t at = s * GROUP * STEP;
        tile_load(4, x + s * STEP, lda);
        tile_load(6, w + at, TILE_BYTES);
        tile_dp(0, 4, 6);
        if (nt > 1) {
            tile_load(7, w + gsize + at, TILE_BYTES);
            tile_dp(1, 4, 7);
        }
        if (nt > 2) {
            tile_load(6, w + 2 * gsize + at, TILE_BYTES);
            tile_dp(2, 4, 6);
        }
        if (nt > 3) {
            tile_load(7, w + 3 * gsize + at, TILE_BYTES);
            tile_dp(3, 4, 7);
        }
    }
    float out[4][TILE_ROWS][GROUP];
    for (int j = 0; j < nt; j++)
        sums_store(j, out[j]);
    for (int64_t r = 0; r < rows; r++) {
        __m512 sums[4];
        for (int j = 0; j < nt; j++)
            sums[j] = _mm512_loadu_ps(out[j][r]);
        emit_bf16(c, m + r, g, nt, sums);
    }
}

/* Rows [m, m + rows) (16 < rows <= 32) by groups [g, g + nt) (nt <= 2): A4 and A5 (rows
 * 0-15 and 16-31) by B6 and B7, into C0 C1 and C2 C3. */
static void amx_rows32(const struct amx_call *a, int64_t m, int64_t rows, int64_t g, int nt) {
    const struct call *c = &a->c;
    const int64_t gsize = c->steps * GROUP * STEP;
    const uint8_t *w = c->w + g * gsize;
    int64_t lda0, lda1;
    const uint8_t *x0 = a_source(a, m, &lda0), *x1 = a_source(a, m + TILE_ROWS, &lda1);
    for (int j = 0; j < nt; j++) {
        sums_start(c, j, g + j);
        sums_start(c, 2 + j, g + j);
    }
    for (int64_t s = 0; s < c->steps; s += TILE_STEPS) {
        const int64_t at = s * GROUP * STEP;
        tile_load(4, x0 + s * STEP, lda0);
        tile_load(5, x1 + s * STEP, lda1);
        tile_load(6, w + at, TILE_BYTES);
        tile_dp(0, 4, 6);
        tile_dp(2, 5, 6);
        if (nt > 1) {
            tile_load(7, w + gsize + at, TILE_BYTES);
            tile_dp(1, 4, 7);
            tile_dp(3, 5, 7);
        }
    }
    float out[4][TILE_ROWS][GROUP];
    for (int j = 0; j < nt && j < 2; j++) {
        sums_store(j, out[j]);
        sums_store(2 + j, out[2 + j]);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int half = r < TILE_ROWS ? 0 : 2;
        __m512 sums[2];
        for (int j = 0; j < nt; j++)
            sums[j] = _mm512_loadu_ps(out[half + j][r % TILE_ROWS]);
        emit_bf16(c, m + r, g, nt, sums);
    }
}

/* deal()'s panel: rows [m0, m0 + mt) (m0 a multiple of 32) by groups [g0, g1), in
 * strips of up to 32 rows. Group counts stay even, which the gated form needs. */
static void panel_amx(const void *call, int64_t m0, int64_t mt, int64_t g0, int64_t g1, int64_t n0, int64_t n1) {
    const struct amx_call *a = call;
    (void)n0; (void)n1;
    tile_config(&TILES);
    for (int64_t m = m0; m < m0 + mt; m += 2 * TILE_ROWS) {
        const int64_t rows = m0 + mt - m < 2 * TILE_ROWS ? m0 + mt - m : 2 * TILE_ROWS;
        const int per = rows <= TILE_ROWS ? 4 : 2;
        for (int64_t g = g0; g < g1; g += per) {
            const int nt = g1 - g < per ? (int)(g1 - g) : per;
            if (rows <= TILE_ROWS)
                amx_rows16(a, m, rows, g, nt);
            else
                amx_rows32(a, m, rows, g, nt);
        }
    }
    tile_release();
}

int pdserve_linear_amx_bf16(const uint16_t *x, int64_t ldx, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                            const float *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy, int gated,
                            int threads) {
    if (rows < 0 || n <= 0 || k <= 0 || k % 2 || (gated && (n % (2 * GROUP) || res)))
        return 1;
    if (!pdserve_amx_supported())
        return 2;
    struct amx_call a = {{(const uint8_t *)x, ldx * 2, (const uint8_t *)w, k / 2, n, bias, res, ldr, y, ldy, gated,
                          NULL, NULL},
                         NULL, -1};
    if (a.c.steps % TILE_STEPS) {           /* k not whole tiles */
        run(&a.c, BF16, rows, threads);
        return 0;
    }
    if (rows == 0)
        return 0;
    uint8_t *tail = NULL;
    if (rows % TILE_ROWS) {
        const int64_t bytes = a.c.steps * STEP;
        a.tail_from = rows - rows % TILE_ROWS;
        tail = calloc(TILE_ROWS, (size_t)bytes);
        if (tail == NULL)
            return 3;
        for (int64_t r = a.tail_from; r < rows; r++)
            memcpy(tail + (r - a.tail_from) * bytes, a.c.x + r * a.c.ldx, (size_t)bytes);
        a.tail = tail;
    }
    deal(&a, panel_amx, (n + GROUP - 1) / GROUP, PANEL, rows, 2 * TILE_ROWS, threads);
    free(tail);
    return 0;
}
#else
int pdserve_amx_supported(void) { return 0; }

/* No tiles in this build: vdpbf16ps's path, where there is one. */
int pdserve_linear_amx_bf16(const uint16_t *x, int64_t ldx, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                            const float *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy, int gated,
                            int threads) {
    return pdserve_linear_bf16(x, ldx, rows, w, n, k, bias, res, ldr, y, ldy, gated, threads);
}
#endif

#if defined(GROUP) && defined(__AVX512BF16__)
int pdserve_matmul_supported(void) { return 1; }

int pdserve_linear_bf16(const uint16_t *x, int64_t ldx, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                        const float *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy, int gated,
                        int threads) {
    if (rows < 0 || n <= 0 || k <= 0 || k % 2 || (gated && (n % (2 * GROUP) || res)))
        return 1;
    struct call c = {(const uint8_t *)x, ldx * 2, (const uint8_t *)w, k / 2, n, bias, res, ldr, y, ldy, gated,
                     NULL, NULL};
    run(&c, BF16, rows, threads);
    return 0;
}
#else
int pdserve_matmul_supported(void) { return 0; }

int pdserve_linear_bf16(const uint16_t *x, int64_t ldx, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                        const float *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy, int gated,
                        int threads) {
    (void)x; (void)ldx; (void)rows; (void)w; (void)n; (void)k; (void)bias; (void)res; (void)ldr; (void)y;
    (void)ldy; (void)gated; (void)threads;
    return 2;
}
#endif

#if defined(GROUP) && defined(__AVX512VNNI__)
int pdserve_int8_supported(void) { return 1; }

/* y = ((x_u8 - 128) . w_s8) * scale per column, as float32: `Int8Linear.products`. */
int pdserve_linear_u8s8(const uint8_t *x, int64_t ldx, int64_t rows, const int8_t *w, int64_t n, int64_t k,
                        const int32_t *comp, const float *scale, float *y, int64_t ldy, int threads) {
    if (rows < 0 || n <= 0 || k <= 0 || k % 4)
        return 1;
    struct call c = {x, ldx, (const uint8_t *)w, k / 4, n, NULL, NULL, 0, y, ldy, 0, comp, scale};
    run(&c, U8S8, rows, threads);
    return 0;
}
#else
int pdserve_int8_supported(void) { return 0; }

int pdserve_linear_u8s8(const uint8_t *x, int64_t ldx, int64_t rows, const int8_t *w, int64_t n, int64_t k,
                        const int32_t *comp, const float *scale, float *y, int64_t ldy, int threads) {
    (void)x; (void)ldx; (void)rows; (void)w; (void)n; (void)k; (void)comp; (void)scale; (void)y; (void)ldy;
    (void)threads;
    return 2;
}
#endif

/* float32, AVX2 + FMA: for CPUs without native bfloat16, where the engine runs float32.
 * torch's float32 matmul (MKL / oneDNN) streamed SmolLM2's weights at ~8 GB/s at one row
 * on an AVX2-only EPYC core and reached ~32 GFLOP/s at 16 rows (bench/matmul.py). Weights
 * are packed [N/8][K][8]: one 32-byte load holds one k step of 8 output columns, and an
 * FMA multiplies it with one broadcast x[m][k]. Tiles: up to 2 rows by 4 groups (32
 * columns), else up to 6 rows by 2 groups (12 sums in registers, 2 weight loads and 6
 * broadcasts per 12 FMAs, the usual AVX2 shape). Each sum starts at zero and runs in k
 * order whatever the tile (batch-invariant, as above); the bias and then the residual are
 * added to the finished product, as torch adds them. The gated form is as above: gate and
 * up groups alternate, and silu(g) = g / (1 + e^-g). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define GROUP32 8           /* output columns per ymm */
#define PANEL32 8           /* groups per panel: 64 columns */
#define PREFETCH32 32       /* k steps ahead that a tile's first pass prefetches its weights */

struct call32 {
    const float *x;         /* [rows, k], row stride ldx */
    int64_t ldx;
    const float *w;         /* packed: [groups][k][8] */
    int64_t k, n;           /* n: real output columns (of the product, before gating) */
    const float *bias;      /* [groups * 8], packed order (gate and up alternating), or NULL */
    const float *res;       /* [rows, n] residual, row stride ldr, or NULL */
    int64_t ldr;
    float *y;               /* [rows, n or n/2], row stride ldy */
    int64_t ldy;
    int gated;
};

/* Lanes [0, n - first) of 8, as maskload/maskstore take them (the sign bit). */
static inline __m256i cols_mask32(int64_t first, int64_t n) {
    const int64_t left = n - first;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left > GROUP32 ? GROUP32 : left)), lanes);
}

/* silu(g) * u, lane by lane (fast_expf, which the compiler vectorizes). */
static inline __m256 silu_mul32(__m256 g, __m256 u) {
    float v[GROUP32];
    _mm256_storeu_ps(v, g);
    for (int i = 0; i < GROUP32; i++)
        v[i] = v[i] / (1.0f + fast_expf(-v[i]));
    return _mm256_mul_ps(_mm256_loadu_ps(v), u);
}

/* The loops over rows (m) and groups (j) are unrolled in full, so the sums stay in
 * registers (left as loops, GCC kept a copy of every sum on the stack each k step). */
#define EACH(i, count) _Pragma("GCC unroll 8") for (int i = 0; i < (count); i++)

static inline __attribute__((always_inline)) void tile32(const struct call32 *c, const int MT, const int NT,
                                                         int64_t m0, int64_t g, const int pf) {
    __m256 acc[6][4];
    const int64_t gsize = c->k * GROUP32;
    const float *w = c->w + g * gsize;
    EACH(m, MT) EACH(j, NT) acc[m][j] = _mm256_setzero_ps();
    const float *x = c->x + m0 * c->ldx;
    for (int64_t s = 0; s < c->k; s++) {
        __m256 wv[4];
        EACH(j, NT) wv[j] = _mm256_loadu_ps(w + j * gsize + s * GROUP32);
        if (pf && !(s & 1))
            EACH(j, NT) _mm_prefetch((const char *)(w + j * gsize + (s + PREFETCH32) * GROUP32), _MM_HINT_T0);
        EACH(m, MT) {
            const __m256 xb = _mm256_broadcast_ss(x + m * c->ldx + s);
            EACH(j, NT) acc[m][j] = _mm256_fmadd_ps(xb, wv[j], acc[m][j]);
        }
    }
    if (c->bias) {
        EACH(j, NT) {
            const __m256 b = _mm256_loadu_ps(c->bias + (g + j) * GROUP32);
            EACH(m, MT) acc[m][j] = _mm256_add_ps(acc[m][j], b);
        }
    }
    if (c->gated) {                 /* (gate, up) group pairs */
        EACH(h, NT / 2) {
            const int64_t col = (g / 2 + h) * GROUP32;
            const __m256i mask = cols_mask32(col, c->n / 2);
            EACH(m, MT) _mm256_maskstore_ps(c->y + (m0 + m) * c->ldy + col, mask,
                                            silu_mul32(acc[m][2 * h], acc[m][2 * h + 1]));
        }
        return;
    }
    EACH(j, NT) {
        const int64_t col = (g + j) * GROUP32;
        const __m256i mask = cols_mask32(col, c->n);
        EACH(m, MT) {
            __m256 v = acc[m][j];
            if (c->res)
                v = _mm256_add_ps(v, _mm256_maskload_ps(c->res + (m0 + m) * c->ldr + col, mask));
            _mm256_maskstore_ps(c->y + (m0 + m) * c->ldy + col, mask, v);
        }
    }
}

#define ROWS_BY32(NT, MT, M)                                                    \
    switch (MT) {                                                               \
    case 1: tile32(c, 1, NT, M, g, M == m0); break;                             \
    case 2: tile32(c, 2, NT, M, g, M == m0); break;                             \
    case 3: tile32(c, 3, NT, M, g, M == m0); break;                             \
    case 4: tile32(c, 4, NT, M, g, M == m0); break;                             \
    case 5: tile32(c, 5, NT, M, g, M == m0); break;                             \
    default: tile32(c, 6, NT, M, g, M == m0); break;                            \
    }

/* Rows [m0, m0 + mt) by groups [g0, g1): each tile's weights (2 or 4 groups, all of k)
 * are taken once and stay in L1 while every strip of rows passes over them. Up to 2
 * rows take 4 groups at a time, more rows strips of 6 over 2 groups; group counts stay
 * even, which the gated form needs. */
static __attribute__((noinline)) void panel_f32(const void *call, int64_t m0, int64_t mt, int64_t g0, int64_t g1,
                                                int64_t n0, int64_t n1) {
    const struct call32 *c = call;
    (void)n0; (void)n1;
    if (mt <= 2) {
        for (int64_t g = g0; g < g1;) {
            const int64_t nt = g1 - g >= 4 ? 4 : g1 - g >= 2 ? 2 : 1;
            if (nt == 4)
                mt == 1 ? tile32(c, 1, 4, m0, g, 0) : tile32(c, 2, 4, m0, g, 0);
            else if (nt == 2)
                mt == 1 ? tile32(c, 1, 2, m0, g, 0) : tile32(c, 2, 2, m0, g, 0);
            else
                mt == 1 ? tile32(c, 1, 1, m0, g, 0) : tile32(c, 2, 1, m0, g, 0);
            g += nt;
        }
        return;
    }
    for (int64_t g = g0; g < g1;) {
        const int64_t nt = g1 - g >= 2 ? 2 : 1;
        for (int64_t m = m0; m < m0 + mt; m += 6) {
            const int64_t rows = m0 + mt - m < 6 ? m0 + mt - m : 6;
            if (nt == 2) {
                ROWS_BY32(2, rows, m)
            } else {
                ROWS_BY32(1, rows, m)
            }
        }
        g += nt;
    }
}

int pdserve_f32_supported(void) { return 1; }

int pdserve_linear_f32(const float *x, int64_t ldx, int64_t rows, const float *w, int64_t n, int64_t k,
                       const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int gated,
                       int threads) {
    if (rows < 0 || n <= 0 || k <= 0 || (gated && (n % (2 * GROUP32) || res)))
        return 1;
    struct call32 c = {x, ldx, w, k, n, bias, res, ldr, y, ldy, gated};
    deal(&c, panel_f32, (n + GROUP32 - 1) / GROUP32, PANEL32, rows, rows <= 2 ? 2 : BLOCK_ROWS, threads);
    return 0;
}
#else
int pdserve_f32_supported(void) { return 0; }

int pdserve_linear_f32(const float *x, int64_t ldx, int64_t rows, const float *w, int64_t n, int64_t k,
                       const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int gated,
                       int threads) {
    (void)x; (void)ldx; (void)rows; (void)w; (void)n; (void)k; (void)bias; (void)res; (void)ldr; (void)y;
    (void)ldy; (void)gated; (void)threads;
    return 2;
}
#endif
