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

__attribute__((target("avx512f"))) static inline float hsum16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}

#define AVX512_TILE(R, C) TILE(avx512, "avx512f", __m512, 16, _mm512_setzero_ps,           \
                               _mm512_loadu_ps, _mm512_fmadd_ps, hsum16, R, C)

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
    if (rows <= 0 || N <= 0) return;
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

/* ---- attention for a block of queries ----
 *
 * es_attention: for each query i of one sequence (the last nq positions of its L keys) and
 * each head h (grouped-query: kv head h / (H / Hkv)), over exactly the keys it may see,
 * j < L - nq + 1 + i:
 *
 *     s_j = dot(q, k_j) * scale      dot: 8 lanes of fma over d in order, then hsum8, then
 *                                    the d % 8 last dims in order (as the linear kernel)
 *     m = max_j s_j;  e_j = expf(s_j - m);  sum = e_0 + e_1 + ... in order of j
 *     out[c] = (fma over j in order of e_j * v_j[c]) / sum      for each dim c on its own
 *
 * so each query's arithmetic is that of a one-token step at its position, whatever the
 * other queries, their number or the thread split (threads take whole heads). The AVX2 path
 * and the portable path give the same bits; there is no AVX-512 path.
 *
 * Token trees (tree_rows != NULL): the nq queries are the nodes of a tree of drafts, and
 * query i sees the P = L - nq keys before them, then the nodes tree_rows[tree_offsets[i] ..
 * tree_offsets[i + 1]) (its root-to-node path, ascending, itself last), in that order. The
 * loops above run over that list of keys as they run over a chain's, so a node's arithmetic
 * is that of a one-token step after its path (each output dim is its own fma chain over j:
 * gathering the rows changes nothing in it). */

__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const float *b,
                                                          int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    float s = hsum8(acc);
    for (; c < d; c++) s = fmaf(a[c], b[c], s);
    return s;
}

/* out[0..d) = sum_j e[j] * v[key_row(j) * ldv + c], fma in order of j, each dim on its own:
 * rows 0 .. P-1 in place, then a tree path's rows (a chain: P = n, no extra rows) */
static inline int64_t key_row(int64_t j, int64_t P, const int64_t *extra) {
    return j < P ? j : P + extra[j - P];
}

__attribute__((target("avx2,fma"))) static void weighted_sum_rows_avx2(
    const float *e, int64_t n, const float *v, int64_t ldv, int64_t d, float *out, int64_t P,
    const int64_t *extra) {
    /* 32 dims at a time in four accumulators, then 8, then one: each dim one fma chain */
    int64_t c = 0;
    for (; c + 32 <= d; c += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; j++) {
            __m256 w = _mm256_broadcast_ss(e + j);
            const float *row = v + key_row(j, P, extra) * ldv + c;
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 24), a3);
        }
        _mm256_storeu_ps(out + c, a0);
        _mm256_storeu_ps(out + c + 8, a1);
        _mm256_storeu_ps(out + c + 16, a2);
        _mm256_storeu_ps(out + c + 24, a3);
    }
    for (; c + 8 <= d; c += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++)
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(e + j),
                                _mm256_loadu_ps(v + key_row(j, P, extra) * ldv + c), a);
        _mm256_storeu_ps(out + c, a);
    }
    for (; c < d; c++) {
        float a = 0.0f;
        for (int64_t j = 0; j < n; j++) a = fmaf(e[j], v[key_row(j, P, extra) * ldv + c], a);
        out[c] = a;
    }
}

static void weighted_sum_rows_portable(const float *e, int64_t n, const float *v, int64_t ldv,
                                       int64_t d, float *out, int64_t P, const int64_t *extra) {
    for (int64_t c = 0; c < d; c++) {
        float a = 0.0f;
        for (int64_t j = 0; j < n; j++) a = fmaf(e[j], v[key_row(j, P, extra) * ldv + c], a);
        out[c] = a;
    }
}

/* q: element (i, h, c) at q[i*sq + h*sh + c]; k, v: (kvh, j, c) at [kvh*skh + j*skj + c];
 * out: (i, h, c) at out[i*so + h*soh + c]; scratch: threads * L floats. */
void es_attention(const float *q, int64_t nq, int64_t H, int64_t d, int64_t sq, int64_t sh,
                  const float *k, const float *v, int64_t Hkv, int64_t L, int64_t skh,
                  int64_t skj, int64_t svh, int64_t svj, float scale, float *out, int64_t so,
                  int64_t soh, float *scratch, int threads, int isa,
                  const int64_t *tree_rows, const int64_t *tree_offsets) {
    int64_t group = H / Hkv;
    if (threads < 1) threads = 1;
    if (threads > H) threads = (int)H;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        float *e = scratch + (int64_t)omp_get_thread_num() * L;
        const float *kh = k + (h / group) * skh, *vh = v + (h / group) * svh;
        for (int64_t i = 0; i < nq; i++) {
            const float *qi = q + i * sq + h * sh;
            int64_t P = L - nq, visible = L - nq + 1 + i;
            const int64_t *extra = NULL;  /* a tree node's path (see the header) */
            if (tree_rows) {
                extra = tree_rows + tree_offsets[i];
                visible = P + tree_offsets[i + 1] - tree_offsets[i];
            }
            float m = -INFINITY;
            for (int64_t j = 0; j < visible; j++) {
                const float *kj = kh + (extra ? key_row(j, P, extra) : j) * skj;
                float s = (isa >= 1 ? dot_avx2(qi, kj, d) : dot_portable(qi, kj, d)) * scale;
                e[j] = s;
                if (s > m) m = s;
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < visible; j++) {
                e[j] = expf(e[j] - m);
                sum += e[j];
            }
            float *o = out + i * so + h * soh;
            int64_t in_place = extra ? P : visible;  /* rows read where they are */
            if (isa >= 1) weighted_sum_rows_avx2(e, visible, vh, svj, d, o, in_place, extra);
            else weighted_sum_rows_portable(e, visible, vh, svj, d, o, in_place, extra);
            for (int64_t c = 0; c < d; c++) o[c] = o[c] / sum;
        }
    }
}
