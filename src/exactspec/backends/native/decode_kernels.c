/* exactspec's batch-invariant decode kernels (see exactspec/backends/native/__init__.py and
 * docs/design.md, "Batch-invariant kernels that read the weights once").
 *
 * es_linear: y[r, j] = sum_k x[r, k] * w[j, k], the weight as nn.Linear stores it, w [N, K].
 *
 * The invariant: on one instruction-set path, every output element is computed by the same
 * arithmetic whatever the number of rows, the other rows or the thread split. With L lanes
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
#include <math.h>
#include <stdint.h>
#include <immintrin.h>
#include <omp.h>

#define MIN(a, b) ((a) < (b) ? (a) : (b))

typedef void (*tile_fn)(const float *x, int64_t ldx, int64_t K, const float *w,
                        float *y, int64_t ldy);

/* ---- portable: 8 emulated lanes, fmaf; the same bits as the AVX2 path ---- */

static float dot_portable(const float *x, const float *w, int64_t K) {
    float lane[8] = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        for (int l = 0; l < 8; l++) lane[l] = fmaf(x[k + l], w[k + l], lane[l]);
    for (int l = 0; l < 4; l++) lane[l] += lane[l + 4];
    for (int l = 0; l < 2; l++) lane[l] += lane[l + 2];
    float acc = lane[0] + lane[1];
    for (; k < K; k++) acc = fmaf(x[k], w[k], acc);
    return acc;
}

static void rows_portable(const float *x, int64_t ldx, int64_t rows, int64_t K,
                          const float *w, int64_t ldw, float *y, int64_t ldy,
                          int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++)
        for (int64_t r = 0; r < rows; r++)
            y[r * ldy + j] = dot_portable(x + r * ldx, w + j * ldw, K);
}

/* ---- AVX2 + FMA: 8 lanes ---- */

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l, l+4 */
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                       /* l, l+2 */
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));                                   /* 0 + 1 */
    return _mm_cvtss_f32(q);
}

#define AVX2_TILE(R, C)                                                                   \
    __attribute__((target("avx2,fma"))) static void avx2_##R##x##C(                      \
        const float *x, int64_t ldx, int64_t K, const float *w, float *y, int64_t ldy) {   \
        __m256 acc[R][C];                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                  \
        int64_t k = 0;                                                                    \
        for (; k + 8 <= K; k += 8) {                                                      \
            __m256 wv[C];                                                                 \
            for (int c = 0; c < C; c++) {                                               \
                wv[c] = _mm256_loadu_ps(w + c * K + k);                                  \
                _mm_prefetch((const char *)(w + (C + c) * K + k), _MM_HINT_T0); /* next tile */ \
            }                                                                             \
            for (int r = 0; r < R; r++) {                                                 \
                __m256 xv = _mm256_loadu_ps(x + r * ldx + k);                             \
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]); \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) {                                                 \
                float s = hsum8(acc[r][c]);                                               \
                for (int64_t t = k; t < K; t++) s = fmaf(x[r * ldx + t], w[c * K + t], s); \
                y[r * ldy + c] = s;                                                       \
            }                                                                             \
    }

AVX2_TILE(1, 4) AVX2_TILE(2, 4) AVX2_TILE(3, 4) AVX2_TILE(4, 4)
AVX2_TILE(1, 1) AVX2_TILE(2, 1) AVX2_TILE(3, 1) AVX2_TILE(4, 1)

static const tile_fn avx2_wide[5] = {0, avx2_1x4, avx2_2x4, avx2_3x4, avx2_4x4};
static const tile_fn avx2_narrow[5] = {0, avx2_1x1, avx2_2x1, avx2_3x1, avx2_4x1};

/* ---- AVX-512F: 16 lanes ---- */

__attribute__((target("avx512f"))) static inline float hsum16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}

#define AVX512_TILE(R, C)                                                                 \
    __attribute__((target("avx512f"))) static void avx512_##R##x##C(                     \
        const float *x, int64_t ldx, int64_t K, const float *w, float *y, int64_t ldy) {   \
        __m512 acc[R][C];                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                  \
        int64_t k = 0;                                                                    \
        for (; k + 16 <= K; k += 16) {                                                    \
            __m512 wv[C];                                                                 \
            for (int c = 0; c < C; c++) {                                               \
                wv[c] = _mm512_loadu_ps(w + c * K + k);                                  \
                _mm_prefetch((const char *)(w + (C + c) * K + k), _MM_HINT_T0); /* next tile */ \
            }                                                                             \
            for (int r = 0; r < R; r++) {                                                 \
                __m512 xv = _mm512_loadu_ps(x + r * ldx + k);                             \
                for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]); \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) {                                                 \
                float s = hsum16(acc[r][c]);                                              \
                for (int64_t t = k; t < K; t++) s = fmaf(x[r * ldx + t], w[c * K + t], s); \
                y[r * ldy + c] = s;                                                       \
            }                                                                             \
    }

AVX512_TILE(1, 6) AVX512_TILE(2, 6) AVX512_TILE(3, 6) AVX512_TILE(4, 6)
AVX512_TILE(1, 1) AVX512_TILE(2, 1) AVX512_TILE(3, 1) AVX512_TILE(4, 1)

static const tile_fn avx512_wide[5] = {0, avx512_1x6, avx512_2x6, avx512_3x6, avx512_4x6};
static const tile_fn avx512_narrow[5] = {0, avx512_1x1, avx512_2x1, avx512_3x1, avx512_4x1};

/* Columns j0..j1 of every row: tiles of C columns (then single columns), each tile over
 * every row in blocks of up to 4 while its weight rows stay in L1. */
static void rows_tiled(const tile_fn *wide, const tile_fn *narrow, int C,
                       const float *x, int64_t ldx, int64_t rows, int64_t K, const float *w,
                       float *y, int64_t ldy, int64_t j0, int64_t j1) {
    int64_t j = j0;
    for (; j + C <= j1; j += C)
        for (int64_t r = 0; r < rows; r += 4)
            wide[MIN(4, rows - r)](x + r * ldx, ldx, K, w + j * K, y + r * ldy + j, ldy);
    for (; j < j1; j++)
        for (int64_t r = 0; r < rows; r += 4)
            narrow[MIN(4, rows - r)](x + r * ldx, ldx, K, w + j * K, y + r * ldy + j, ldy);
}

/* The best instruction set this CPU runs: 2 AVX-512F, 1 AVX2 + FMA, 0 portable. */
int es_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

static void columns(int isa, const float *x, int64_t ldx, int64_t rows, int64_t K,
                    const float *w, float *y, int64_t ldy, int64_t j0, int64_t j1) {
    if (isa == 2)
        rows_tiled(avx512_wide, avx512_narrow, 6, x, ldx, rows, K, w, y, ldy, j0, j1);
    else if (isa == 1)
        rows_tiled(avx2_wide, avx2_narrow, 4, x, ldx, rows, K, w, y, ldy, j0, j1);
    else
        rows_portable(x, ldx, rows, K, w, K, y, ldy, j0, j1);
}

/* y [rows, N] (row stride ldy) = x [rows, K] (row stride ldx) @ w [N, K]^T (w contiguous),
 * on `threads` threads that split the output columns in blocks of 48, with instruction set
 * `isa` (as es_best_isa returns; a lower one may be forced). */
void es_linear(const float *x, int64_t ldx, int64_t rows, int64_t K, const float *w,
               int64_t N, float *y, int64_t ldy, int threads, int isa) {
    int64_t blocks = (N + 47) / 48;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = (int)blocks;
    if (threads == 1) {
        columns(isa, x, ldx, rows, K, w, y, ldy, 0, N);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t j0 = blocks * t / n * 48, j1 = MIN(blocks * (t + 1) / n * 48, N);
        if (j0 < j1) columns(isa, x, ldx, rows, K, w, y, ldy, j0, j1);
    }
}
