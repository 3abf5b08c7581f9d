/* ---- float32 products (es_linear), and over GGUF weight blocks (es_linear_typed) ----
 *
 * es_linear: y[r, j] = sum_k x[r, k] * w[j, k], the weight as nn.Linear stores it, w [N, K].
 *
 * Every output element is computed by the same arithmetic whatever the number of rows, the
 * other rows or the thread split (kernels.h's invariant). With L lanes
 * (8 for AVX2, 16 for AVX-512; the portable path emulates 8):
 *
 *     lane[l] = 0;  for each block b of L inputs, in order:  lane[l] = fma(x[r, bL+l], w[j, bL+l], lane[l])
 *     y[r, j] = a fixed pairwise sum of the L lanes (halves added, then quarters, ...)
 *     then the K % L last inputs, in order: y = fma(x[r, k], w[j, k], y)
 *
 * Tiling (R rows x C output columns in registers, so that each weight vector loaded from
 * L1 serves R rows, and a tile of C weight rows serves every row of x while it is in L1)
 * only chooses which elements are computed together, never how one is computed; a smaller
 * tile at the edges runs the same per-element arithmetic. Threads split output columns.
 * The AVX2 path and the portable path give the same bits (both 8 lanes, fused
 * multiply-adds rounded once); AVX-512 (16 lanes) sums in another order and differs from
 * them in the last bits, so one process uses one path throughout.
 */

#include "kernels.h"

typedef void (*tile_fn)(const float *x, int64_t ldx, int64_t K, const float *w,
                        float *y, int64_t ldy);

/* ---- portable: 8 emulated lanes, fmaf; the same bits as the AVX2 path ---- */


static void rows_portable(const float *x, int64_t ldx, int64_t rows, int64_t K,
                          const float *w, int64_t ldw, float *y, int64_t ldy,
                          int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++)
        for (int64_t r = 0; r < rows; r++)
            y[r * ldy + j] = dot_portable(x + r * ldx, w + j * ldw, K);
}

/* ---- AVX2 + FMA: 8 lanes ---- */


/* One tile of R rows x C output columns for an instruction set: its name, target, vector
 * type, lanes, and the intrinsics that zero, load and fuse-multiply-add a vector and sum
 * its lanes in the fixed order. Every path and tile shape runs this same arithmetic. */
#define TILE(ISA, TARGET, VEC, LANES, ZERO, LOAD, FMADD, HSUM, R, C)                       \
    __attribute__((target(TARGET))) static void ISA##_##R##x##C(                          \
        const float *x, int64_t ldx, int64_t K, const float *w, float *y, int64_t ldy) {   \
        VEC acc[R][C];                                                                    \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) acc[r][c] = ZERO();                               \
        int64_t k = 0;                                                                    \
        for (; k + LANES <= K; k += LANES) {                                              \
            VEC wv[C];                                                                    \
            for (int c = 0; c < C; c++) {                                                 \
                wv[c] = LOAD(w + c * K + k);                                              \
                /* the next tile; may lie past the end: a prefetch never faults */        \
                _mm_prefetch((const char *)((uintptr_t)w + 4 * (uintptr_t)((C + c) * K + k)), \
                             _MM_HINT_T0);                                                \
            }                                                                             \
            for (int r = 0; r < R; r++) {                                                 \
                VEC xv = LOAD(x + r * ldx + k);                                           \
                for (int c = 0; c < C; c++) acc[r][c] = FMADD(xv, wv[c], acc[r][c]);      \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) {                                                 \
                float s = HSUM(acc[r][c]);                                                \
                for (int64_t t = k; t < K; t++) s = fmaf(x[r * ldx + t], w[c * K + t], s); \
                y[r * ldy + c] = s;                                                       \
            }                                                                             \
    }

#define AVX2_TILE(R, C) TILE(avx2, "avx2,fma", __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, \
                             _mm256_fmadd_ps, hsum8, R, C)

AVX2_TILE(1, 4) AVX2_TILE(2, 4) AVX2_TILE(3, 4) AVX2_TILE(4, 4)
AVX2_TILE(1, 1) AVX2_TILE(2, 1) AVX2_TILE(3, 1) AVX2_TILE(4, 1)

static const tile_fn avx2_wide[5] = {0, avx2_1x4, avx2_2x4, avx2_3x4, avx2_4x4};
static const tile_fn avx2_narrow[5] = {0, avx2_1x1, avx2_2x1, avx2_3x1, avx2_4x1};

/* ---- AVX-512F: 16 lanes ---- */


#define AVX512_TILE(R, C) TILE(avx512, "avx512f", __m512, 16, _mm512_setzero_ps,           \
                               _mm512_loadu_ps, _mm512_fmadd_ps, hsum16, R, C)

AVX512_TILE(1, 6) AVX512_TILE(2, 6) AVX512_TILE(3, 6) AVX512_TILE(4, 6)
AVX512_TILE(1, 1) AVX512_TILE(2, 1) AVX512_TILE(3, 1) AVX512_TILE(4, 1)

static const tile_fn avx512_wide[5] = {0, avx512_1x6, avx512_2x6, avx512_3x6, avx512_4x6};
static const tile_fn avx512_narrow[5] = {0, avx512_1x1, avx512_2x1, avx512_3x1, avx512_4x1};
/* ---- the same product over GGUF weight blocks (es_linear_typed; blocks.c dequantises) ----
 *
 * For C output columns at a time (a tile), the C weight rows are dequantised
 * once into a float panel [C, K] that stays in L1, and the float32 tile runs over every
 * row of x against the panel (each weight block is read from memory and dequantised once
 * per product, for all rows). An F32 matrix is its own panel. So each output element is
 * the float32 arithmetic of the header above over the dequantised weights, whatever the
 * rows, their number or the thread split.
 */
/* Fused AVX-512 tiles for the block types and F16/BF16 (K a multiple of 32): R <= 8 rows x
 * C columns, each block of 32 weights dequantised in registers (dq_*, the same floats as dequantize_row) and used at
 * once for every row, with
 * the 16-lane order of the float32 tile (lanes over k in steps of 16, then hsum16): the
 * same bits as the panel path, without writing the panel. */
typedef void (*qtile_fn)(const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                         int64_t row_bytes, float *y, int64_t ldy);

#define QTILE(TYPE, BYTES, R, C)                                                          \
    __attribute__((target("avx512f,avx512bw,f16c"))) static void TYPE##_##R##x##C(        \
        const float *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t row_bytes,      \
        float *y, int64_t ldy) {                                                          \
        __m512 acc[R][C];                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                  \
        for (int64_t b = 0; b < K / 32; b++) {                                            \
            __m512 lo[C], hi[C];                                                          \
            for (int c = 0; c < C; c++) dq_##TYPE(w + c * row_bytes + b * BYTES, lo + c, hi + c); \
            for (int r = 0; r < R; r++) {                                                 \
                __m512 xl = _mm512_loadu_ps(x + r * ldx + 32 * b);                        \
                __m512 xh = _mm512_loadu_ps(x + r * ldx + 32 * b + 16);                   \
                for (int c = 0; c < C; c++) {                                             \
                    acc[r][c] = _mm512_fmadd_ps(xl, lo[c], acc[r][c]);                    \
                    acc[r][c] = _mm512_fmadd_ps(xh, hi[c], acc[r][c]);                    \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) y[r * ldy + c] = hsum16(acc[r][c]);               \
    }

/* Tile shapes by rows: C = 4 columns up to 4 rows, 2 up to 8 (the accumulators, two
 * dequantised vectors per column and two of x stay in the 32 registers); each shape also
 * in one column for the edges. Beyond 8 rows the panel is faster (measured). */
#define QTILES(TYPE, BYTES)                                                               \
    QTILE(TYPE, BYTES, 1, 4) QTILE(TYPE, BYTES, 2, 4) QTILE(TYPE, BYTES, 3, 4)            \
    QTILE(TYPE, BYTES, 4, 4) QTILE(TYPE, BYTES, 5, 2) QTILE(TYPE, BYTES, 6, 2)            \
    QTILE(TYPE, BYTES, 7, 2) QTILE(TYPE, BYTES, 8, 2)                                     \
    QTILE(TYPE, BYTES, 1, 1) QTILE(TYPE, BYTES, 2, 1) QTILE(TYPE, BYTES, 3, 1)            \
    QTILE(TYPE, BYTES, 4, 1) QTILE(TYPE, BYTES, 5, 1) QTILE(TYPE, BYTES, 6, 1)            \
    QTILE(TYPE, BYTES, 7, 1) QTILE(TYPE, BYTES, 8, 1)                                     \
    static const qtile_fn TYPE##_wide[9] = {                                              \
        0, TYPE##_1x4, TYPE##_2x4, TYPE##_3x4, TYPE##_4x4, TYPE##_5x2, TYPE##_6x2,        \
        TYPE##_7x2, TYPE##_8x2};                                                          \
    static const qtile_fn TYPE##_narrow[9] = {                                            \
        0, TYPE##_1x1, TYPE##_2x1, TYPE##_3x1, TYPE##_4x1, TYPE##_5x1, TYPE##_6x1,        \
        TYPE##_7x1, TYPE##_8x1};

QTILES(q4_1, 20) QTILES(q4_0, 18) QTILES(q8_0, 34) QTILES(f16, 64) QTILES(bf16, 64)

int es_fused_rows = 8; /* rows up to which the fused tiles run, beyond it the panel (tests
                           compare both paths) */

/* Columns j0..j1 of at most es_fused_rows rows through the fused tiles of a block type,
 * or 0 where there are none (other types, paths or more rows). */
static int rows_fused(int isa, const float *x, int64_t ldx, int64_t rows, int64_t K,
                      const uint8_t *w, int type, float *y, int64_t ldy, int64_t j0, int64_t j1) {
    const qtile_fn *wide, *narrow;
    if (isa != 2 || rows > es_fused_rows || rows > 8) return 0;
    if (type == T_Q4_1) wide = q4_1_wide, narrow = q4_1_narrow;
    else if (type == T_Q4_0) wide = q4_0_wide, narrow = q4_0_narrow;
    else if (type == T_Q8_0) wide = q8_0_wide, narrow = q8_0_narrow;
    else if (type == T_F16 && K % 32 == 0) wide = f16_wide, narrow = f16_narrow;
    else if (type == T_BF16 && K % 32 == 0) wide = bf16_wide, narrow = bf16_narrow;
    else return 0;
    int64_t row_bytes = es_row_bytes(type, K), j = j0, C = rows <= 4 ? 4 : 2;
    for (; j + C <= j1; j += C)
        wide[rows](x, ldx, K, w + j * row_bytes, row_bytes, y + j, ldy);
    for (; j < j1; j++)
        narrow[rows](x, ldx, K, w + j * row_bytes, row_bytes, y + j, ldy);
    return 1;
}

/* Columns j0..j1 of every row: tiles of C columns (then single columns), each tile over
 * every row in blocks of up to 4 while its weight rows (or their dequantised panel,
 * `panel`: C * K floats) stay in L1. */
static void rows_tiled(const tile_fn *wide, const tile_fn *narrow, int C,
                       const float *x, int64_t ldx, int64_t rows, int64_t K, const void *w,
                       int type, float *y, int64_t ldy, int64_t j0, int64_t j1, float *panel) {
    int64_t j = j0;
    for (; j + C <= j1; j += C) {
        const float *tile = (const float *)w + j * K;
        if (type != T_F32) {
            for (int c = 0; c < C; c++) dequantize_row(type, w, j + c, K, panel + c * K);
            tile = panel;
        }
        for (int64_t r = 0; r < rows; r += 4)
            wide[MIN(4, rows - r)](x + r * ldx, ldx, K, tile, y + r * ldy + j, ldy);
    }
    for (; j < j1; j++) {
        const float *tile = (const float *)w + j * K;
        if (type != T_F32) {
            dequantize_row(type, w, j, K, panel);
            tile = panel;
        }
        for (int64_t r = 0; r < rows; r += 4)
            narrow[MIN(4, rows - r)](x + r * ldx, ldx, K, tile, y + r * ldy + j, ldy);
    }
}

static void rows_portable_typed(const float *x, int64_t ldx, int64_t rows, int64_t K,
                                const void *w, int type, float *y, int64_t ldy, int64_t j0,
                                int64_t j1, float *panel) {
    for (int64_t j = j0; j < j1; j++) {
        const float *row = (const float *)w + j * K;
        if (type != T_F32) {
            dequantize_row(type, w, j, K, panel);
            row = panel;
        }
        rows_portable(x, ldx, rows, K, row, K, y + j, ldy, 0, 1);
    }
}

/* The best instruction set this CPU runs: 2 AVX-512 (F, BW and F16C, which the fused tiles
 * use; a CPU with AVX-512F alone takes the AVX2 path), 1 AVX2 + FMA + F16C, 0 portable. */
int es_best_isa(void) {
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
               && __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
    if (avx2) return 1;
    return 0;
}

void columns(int isa, const float *x, int64_t ldx, int64_t rows, int64_t K,
                    const void *w, int type, float *y, int64_t ldy, int64_t j0, int64_t j1,
                    float *panel) {
    if (rows_fused(isa, x, ldx, rows, K, w, type, y, ldy, j0, j1)) return;
    if (isa == 2)
        rows_tiled(avx512_wide, avx512_narrow, 6, x, ldx, rows, K, w, type, y, ldy, j0, j1, panel);
    else if (isa == 1)
        rows_tiled(avx2_wide, avx2_narrow, 4, x, ldx, rows, K, w, type, y, ldy, j0, j1, panel);
    else
        rows_portable_typed(x, ldx, rows, K, w, type, y, ldy, j0, j1, panel);
}

/* Thread t of n's share of N output columns: whole blocks of 48. */
void column_share(int64_t N, int t, int n, int64_t *j0, int64_t *j1) {
    int64_t blocks = (N + 47) / 48;
    *j0 = MIN(blocks * t / n * 48, N);
    *j1 = MIN(blocks * (t + 1) / n * 48, N);
}

/* y [rows, N] (row stride ldy) = x [rows, K] (row stride ldx) @ w [N, K]^T (w contiguous,
 * of `type`, see above), on `threads` threads that split the output columns in blocks of 48,
 * with instruction set `isa` (as es_best_isa returns; a lower one may be forced). */
int es_linear_typed(const float *x, int64_t ldx, int64_t rows, int64_t K, const void *w,
                    int type, int64_t N, float *y, int64_t ldy, int threads, int isa) {
    int64_t blocks = (N + 47) / 48;
    if (rows <= 0 || N <= 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = (int)blocks;
    float *panels = type == T_F32 ? NULL : malloc(sizeof(float) * threads * PANEL_COLUMNS * K);
    if (type != T_F32 && !panels) return -1;
#pragma omp parallel num_threads(threads)
    {
        int64_t j0, j1;
        const int t = omp_get_thread_num();
        float *panel = panels ? panels + t * PANEL_COLUMNS * K : NULL;
        column_share(N, t, omp_get_num_threads(), &j0, &j1);
        if (j0 < j1) columns(isa, x, ldx, rows, K, w, type, y, ldy, j0, j1, panel);
    }
    free(panels);
    return 0;
}

/* es_linear_typed over a float32 weight (no scratch: it cannot fail) */
void es_linear(const float *x, int64_t ldx, int64_t rows, int64_t K, const float *w,
               int64_t N, float *y, int64_t ldy, int threads, int isa) {
    es_linear_typed(x, ldx, rows, K, w, T_F32, N, y, ldy, threads, isa);
}
