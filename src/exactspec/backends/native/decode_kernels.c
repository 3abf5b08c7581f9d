/* exactspec's batch-invariant decode kernels (see exactspec/backends/native/__init__.py and
 * docs/design.md, "Batch-invariant kernels that read the weights once").
 *
 * es_linear: y[r, j] = sum_k x[r, k] * wt[k, j] for a weight stored transposed, wt [K, N]
 * (row k holds input feature k of every output column, contiguous over the columns).
 *
 * The invariant: every output element is computed by the same arithmetic, whatever the
 * number of rows, the other rows, the thread split or the instruction set:
 *
 *     acc = 0.0f;  for k = 0 .. K-1:  acc = fma(x[r, k], wt[k, j], acc)
 *
 * one fused multiply-add per k, in order of k (an FMA rounds once, so a vector lane, a
 * scalar fmaf and an AVX-512 lane give the same bits). Vector code vectorises over output
 * columns j, never over k, so no horizontal sum exists whose order could change. Tiling
 * (rows x columns held in registers, so that each weight vector loaded serves several rows)
 * only chooses which elements are computed together, never how one is computed. Threads
 * split the output columns only.
 */
#include <math.h>
#include <stdint.h>
#include <immintrin.h>
#include <omp.h>

#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* ---- portable: fmaf, one element at a time (used for column tails on every path) ---- */

static void cols_scalar(const float *x, int64_t ldx, int64_t rows, int64_t K,
                        const float *wt, int64_t N, float *y, int64_t ldy,
                        int64_t j0, int64_t j1) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = j0; j < j1; j++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(x[r * ldx + k], wt[k * N + j], acc);
            y[r * ldy + j] = acc;
        }
}

/* ---- AVX2 + FMA: 8 columns a vector; tiles of R rows x C vectors ---- */

#define AVX2_TILE(R, C)                                                                   \
    __attribute__((target("avx2,fma"))) static void avx2_tile_##R##x##C(                 \
        const float *x, int64_t ldx, int64_t K, const float *wt, int64_t N, float *y,     \
        int64_t ldy, int64_t j) {                                                         \
        __m256 acc[R][C];                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                  \
        for (int64_t k = 0; k < K; k++) {                                                 \
            __m256 w[C];                                                                  \
            for (int c = 0; c < C; c++) w[c] = _mm256_loadu_ps(wt + k * N + j + 8 * c);   \
            for (int r = 0; r < R; r++) {                                                 \
                __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);                         \
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xr, w[c], acc[r][c]); \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) _mm256_storeu_ps(y + r * ldy + j + 8 * c, acc[r][c]); \
    }

AVX2_TILE(4, 3)
AVX2_TILE(3, 3)
AVX2_TILE(2, 3)
AVX2_TILE(1, 3)
AVX2_TILE(4, 1)
AVX2_TILE(3, 1)
AVX2_TILE(2, 1)
AVX2_TILE(1, 1)

typedef void (*tile_fn)(const float *, int64_t, int64_t, const float *, int64_t, float *,
                        int64_t, int64_t);

__attribute__((target("avx2,fma"))) static void cols_avx2(
    const float *x, int64_t ldx, int64_t rows, int64_t K, const float *wt, int64_t N,
    float *y, int64_t ldy, int64_t j0, int64_t j1) {
    static const tile_fn wide[5] = {0, avx2_tile_1x3, avx2_tile_2x3, avx2_tile_3x3,
                                    avx2_tile_4x3};
    static const tile_fn narrow[5] = {0, avx2_tile_1x1, avx2_tile_2x1, avx2_tile_3x1,
                                      avx2_tile_4x1};
    int64_t j = j0;
    for (; j + 24 <= j1; j += 24)
        for (int64_t r = 0; r < rows; r += 4) {
            int n = (int)MIN(4, rows - r);
            wide[n](x + r * ldx, ldx, K, wt, N, y + r * ldy, ldy, j);
        }
    for (; j + 8 <= j1; j += 8)
        for (int64_t r = 0; r < rows; r += 4) {
            int n = (int)MIN(4, rows - r);
            narrow[n](x + r * ldx, ldx, K, wt, N, y + r * ldy, ldy, j);
        }
    cols_scalar(x, ldx, rows, K, wt, N, y, ldy, j, j1);
}

/* ---- AVX-512F: 16 columns a vector; tiles of R rows x C vectors ---- */

#define AVX512_TILE(R, C)                                                                 \
    __attribute__((target("avx512f"))) static void avx512_tile_##R##x##C(                \
        const float *x, int64_t ldx, int64_t K, const float *wt, int64_t N, float *y,     \
        int64_t ldy, int64_t j) {                                                         \
        __m512 acc[R][C];                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                  \
        for (int64_t k = 0; k < K; k++) {                                                 \
            __m512 w[C];                                                                  \
            for (int c = 0; c < C; c++) w[c] = _mm512_loadu_ps(wt + k * N + j + 16 * c);  \
            for (int r = 0; r < R; r++) {                                                 \
                __m512 xr = _mm512_set1_ps(x[r * ldx + k]);                               \
                for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xr, w[c], acc[r][c]); \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < C; c++) _mm512_storeu_ps(y + r * ldy + j + 16 * c, acc[r][c]); \
    }

AVX512_TILE(6, 3)
AVX512_TILE(5, 3)
AVX512_TILE(4, 3)
AVX512_TILE(3, 3)
AVX512_TILE(2, 3)
AVX512_TILE(1, 3)
AVX512_TILE(6, 1)
AVX512_TILE(5, 1)
AVX512_TILE(4, 1)
AVX512_TILE(3, 1)
AVX512_TILE(2, 1)
AVX512_TILE(1, 1)

__attribute__((target("avx512f"))) static void cols_avx512(
    const float *x, int64_t ldx, int64_t rows, int64_t K, const float *wt, int64_t N,
    float *y, int64_t ldy, int64_t j0, int64_t j1) {
    static const tile_fn wide[7] = {0, avx512_tile_1x3, avx512_tile_2x3, avx512_tile_3x3,
                                    avx512_tile_4x3, avx512_tile_5x3, avx512_tile_6x3};
    static const tile_fn narrow[7] = {0, avx512_tile_1x1, avx512_tile_2x1, avx512_tile_3x1,
                                      avx512_tile_4x1, avx512_tile_5x1, avx512_tile_6x1};
    int64_t j = j0;
    for (; j + 48 <= j1; j += 48)
        for (int64_t r = 0; r < rows; r += 6) {
            int n = (int)MIN(6, rows - r);
            wide[n](x + r * ldx, ldx, K, wt, N, y + r * ldy, ldy, j);
        }
    for (; j + 16 <= j1; j += 16)
        for (int64_t r = 0; r < rows; r += 6) {
            int n = (int)MIN(6, rows - r);
            narrow[n](x + r * ldx, ldx, K, wt, N, y + r * ldy, ldy, j);
        }
    cols_scalar(x, ldx, rows, K, wt, N, y, ldy, j, j1);
}

/* ---- dispatch ---- */

typedef void (*cols_fn)(const float *, int64_t, int64_t, int64_t, const float *, int64_t,
                        float *, int64_t, int64_t, int64_t);

static cols_fn pick(int isa) {
    return isa == 2 ? cols_avx512 : isa == 1 ? cols_avx2 : cols_scalar;
}

/* The best instruction set this CPU runs: 2 AVX-512F, 1 AVX2 + FMA, 0 portable. */
int es_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* y [rows, N] (row stride ldy) = x [rows, K] (row stride ldx) @ wt [K, N], on `threads`
 * threads that split the columns in blocks of 48 (a multiple of every path's vector
 * width), with instruction set `isa` (as es_best_isa; a lower one may be forced). */
void es_linear(const float *x, int64_t ldx, int64_t rows, int64_t K, const float *wt,
               int64_t N, float *y, int64_t ldy, int threads, int isa) {
    cols_fn cols = pick(isa);
    int64_t blocks = (N + 47) / 48;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = (int)blocks;
    if (threads == 1) {
        cols(x, ldx, rows, K, wt, N, y, ldy, 0, N);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t b0 = blocks * t / n, b1 = blocks * (t + 1) / n;
        int64_t j0 = b0 * 48, j1 = MIN(b1 * 48, N);
        if (j0 < j1) cols(x, ldx, rows, K, wt, N, y, ldy, j0, j1);
    }
}
