/* ---- attention for a block of queries ----
 *
 * es_attention: for each query i of one sequence (the last nq positions of its L keys) and
 * each head h (grouped-query: kv head h / (H / Hkv)), over exactly the keys it may see,
 * j < L - nq + 1 + i:
 *
 *     s_j = dot(q, k_j) * scale      dot: 8 lanes of fma over d in order, then hsum8, then
 *                                    the d % 8 last dims in order (as the linear kernel)
 *     m = max_j s_j;  e_j = exp8(s_j - m)     exp8 below: one fixed sequence of IEEE
 *                                    operations per element, the same on every path
 *     sum = 8 lanes of e_j over j in order (lane j % 8), then hsum8, then the n % 8 last
 *     out[c] = (fma over j in order of e_j * v_j[c]) / sum      for each dim c on its own
 *
 * so each query's arithmetic is that of a one-token step at its position, whatever the
 * other queries, their number or the thread split (threads take whole kv heads). Queries
 * are taken in blocks of QUERY_BLOCK with the heads of their kv group, and each key every
 * query of the block sees (the cache's, and in a chain the new keys up to the block's first
 * query) is scored for the whole block while it is in L1, eight keys at a time with
 * their eight hsum8 side by side in one vector (only the order of independent dot products
 * changes, never one dot's arithmetic), and each value row of the shared prefix is read
 * once for the whole block in the weighted sum (WSUM_TILE below: R rows' accumulators of a
 * few dims side by side; each dim of each row is still its own fma chain over j in order).
 * The AVX2 path and the portable path give the same
 * bits, and so does the AVX-512 path, which differs from AVX2 only in the weighted sum's
 * width: 16 dims a vector (each dim is its own chain).
 *
 * Token trees (tree_rows != NULL): the nq queries are the nodes of a tree of drafts, and
 * query i sees the P = L - nq keys before them, then the nodes tree_rows[tree_offsets[i] ..
 * tree_offsets[i + 1]) (its root-to-node path, ascending, itself last), in that order. The
 * loops above run over that list of keys as they run over a chain's, so a node's arithmetic
 * is that of a one-token step after its path (each output dim is its own fma chain over j:
 * gathering the rows changes nothing in it). */

#include "kernels.h"


/* exp(x) for x <= 0 (Cephes' expf polynomial): x clamped to >= -87; n = rint(x * log2e);
 * r = fma(n, -C2, fma(n, -C1, x)); p = Horner in fma over p0..p5; y = fma(p, r * r, r) + 1;
 * result = y * 2^n (exact). Each step one IEEE operation, round to nearest even. */
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
static const float exp_p[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_portable(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -EXP_C2, fmaf(n, -EXP_C1, x));
    float y = exp_p[0];
    for (int i = 1; i < 6; i++) y = fmaf(y, r, exp_p[i]);
    y = fmaf(y, r * r, r) + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, 4);
    return y * scale;
}

__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_C2),
                               _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_C1), x));
    __m256 y = _mm256_set1_ps(exp_p[0]);
    for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(exp_p[i]));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                      _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

/* x[c] = silu(g[c]) * u[c] for c < n: t = exp(-|g|) (the exp above), then
 * (g's sign bit set ? g * t : g) / (1 + t), then * u; each step one IEEE operation, the
 * same bits on every path. */
static inline float silu_mul_portable(float g, float u) {
    float t = exp_portable(-fabsf(g));
    return ((signbit(g) ? g * t : g) / (1.0f + t)) * u;
}

__attribute__((target("avx2,fma"))) static void silu_mul_avx2(const float *g, const float *u,
                                                          float *x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 gv = _mm256_loadu_ps(g + c), t = exp8(_mm256_or_ps(gv, sign));
        __m256 num = _mm256_blendv_ps(gv, _mm256_mul_ps(gv, t), gv);
        _mm256_storeu_ps(x + c, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, t)),
                                              _mm256_loadu_ps(u + c)));
    }
    for (; c < n; c++) x[c] = silu_mul_portable(g[c], u[c]);
}

void silu_mul(const float *g, const float *u, float *x, int64_t n, int isa) {
    if (isa >= 1) silu_mul_avx2(g, u, x, n);
    else for (int64_t c = 0; c < n; c++) x[c] = silu_mul_portable(g[c], u[c]);
}

/* e[j] = exp(e[j] - m) in place for j < n; returns their sum in the order of the header */
__attribute__((target("avx2,fma"))) static float exp_sum_avx2(float *e, int64_t n, float m) {
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), mv));
        _mm256_storeu_ps(e + j, v);
        acc = _mm256_add_ps(acc, v);
    }
    float sum = hsum8(acc);
    for (; j < n; j++) sum += (e[j] = exp_portable(e[j] - m));
    return sum;
}

static float exp_sum_portable(float *e, int64_t n, float m) {
    float lane[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lane[l] += (e[j + l] = exp_portable(e[j + l] - m));
    for (int l = 0; l < 4; l++) lane[l] += lane[l + 4];
    for (int l = 0; l < 2; l++) lane[l] += lane[l + 2];
    float sum = lane[0] + lane[1];
    for (; j < n; j++) sum += (e[j] = exp_portable(e[j] - m));
    return sum;
}


/* Eight keys' scores against one query, s[i] = dot(a, b + i * ldb) * scale, each dot with
 * dot_avx2's arithmetic: the eight hsum8 run side by side in one vector, each adding the
 * same pairs in the same order (a + b and b + a are the same bits). */
__attribute__((target("avx2,fma"), always_inline)) static inline void dot8_avx2(
    const float *a, const float *b, int64_t ldb, int64_t d, float scale, float *s) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
        __m256 x = _mm256_loadu_ps(a + c);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + c), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + ldb + c), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 2 * ldb + c), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 3 * ldb + c), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 4 * ldb + c), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 5 * ldb + c), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 6 * ldb + c), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 7 * ldb + c), a7);
    }
    /* lanes l + l+4: key i in the low half, key i + 4 in the high half */
#define LO_HI(X, Y) _mm256_add_ps(_mm256_permute2f128_ps(X, Y, 0x20), \
                                  _mm256_permute2f128_ps(X, Y, 0x31))
    __m256 p0 = LO_HI(a0, a4), p1 = LO_HI(a1, a5), p2 = LO_HI(a2, a6), p3 = LO_HI(a3, a7);
#undef LO_HI
    __m256 t01 = _mm256_add_ps(_mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(1, 0, 1, 0)), /* l, l+2 */
                               _mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 t23 = _mm256_add_ps(_mm256_shuffle_ps(p2, p3, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(p2, p3, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)), /* 0 + 1 */
                             _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
    if (c == d) {
        _mm256_storeu_ps(s, _mm256_mul_ps(r, _mm256_set1_ps(scale)));
        return;
    }
    _mm256_storeu_ps(s, r);
    for (int i = 0; i < 8; i++) {
        float x = s[i];
        for (int64_t t = c; t < d; t++) x = fmaf(a[t], b[i * ldb + t], x);
        s[i] = x * scale;
    }
}

static inline void dot8_portable(const float *a, const float *b, int64_t ldb, int64_t d,
                                 float scale, float *s) {
    for (int i = 0; i < 8; i++) s[i] = dot_portable(a, b + i * ldb, d) * scale;
}

/* out[0..d) = sum_j e[j] * v[key_row(j) * ldv + c], fma in order of j, each dim on its own:
 * rows 0 .. P-1 in place, then a tree path's rows (a chain: P = n, no extra rows) */
static inline int64_t key_row(int64_t j, int64_t P, const int64_t *extra) {
    return j < P ? j : P + extra[j - P];
}

/* 4 L dims at a time in four accumulators of L lanes (a vector type and its intrinsics),
 * from dim c on, advancing c: each dim one fma chain over j in order. */
#define WEIGHTED_SUM_4(VEC, L, ZERO, SET1, LOAD, FMADD, STORE)                              \
    for (; c + 4 * L <= d; c += 4 * L) {                                                    \
        VEC a0 = ZERO(), a1 = a0, a2 = a0, a3 = a0;                                         \
        for (int64_t j = 0; j < n; j++) {                                                   \
            VEC w = SET1(e[j]);                                                             \
            const float *row = v + key_row(j, P, extra) * ldv + c;                          \
            a0 = FMADD(w, LOAD(row), a0);                                                   \
            a1 = FMADD(w, LOAD(row + L), a1);                                               \
            a2 = FMADD(w, LOAD(row + 2 * L), a2);                                           \
            a3 = FMADD(w, LOAD(row + 3 * L), a3);                                           \
        }                                                                                   \
        STORE(out + c, a0);                                                                 \
        STORE(out + c + L, a1);                                                             \
        STORE(out + c + 2 * L, a2);                                                         \
        STORE(out + c + 3 * L, a3);                                                         \
    }

__attribute__((target("avx2,fma"))) static inline void weighted_sum_rows_avx2(
    const float *e, int64_t n, const float *v, int64_t ldv, int64_t d, float *out, int64_t P,
    const int64_t *extra) {
    /* 32 dims at a time in four accumulators, then 8, then one: each dim one fma chain */
    int64_t c = 0;
    WEIGHTED_SUM_4(__m256, 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_loadu_ps,
                   _mm256_fmadd_ps, _mm256_storeu_ps)
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

/* The same chains 64 dims at a time (each dim is its own chain, so the width changes no
 * bit), the rest as AVX2 does them. */
__attribute__((target("avx512f,avx2,fma"))) static inline void weighted_sum_rows_avx512(
    const float *e, int64_t n, const float *v, int64_t ldv, int64_t d, float *out, int64_t P,
    const int64_t *extra) {
    int64_t c = 0;
    WEIGHTED_SUM_4(__m512, 16, _mm512_setzero_ps, _mm512_set1_ps, _mm512_loadu_ps,
                   _mm512_fmadd_ps, _mm512_storeu_ps)
    weighted_sum_rows_avx2(e, n, v + c, ldv, d - c, out + c, P, extra);
}

static void weighted_sum_rows_portable(const float *e, int64_t n, const float *v, int64_t ldv,
                                       int64_t d, float *out, int64_t P, const int64_t *extra) {
    for (int64_t c = 0; c < d; c++) {
        float a = 0.0f;
        for (int64_t j = 0; j < n; j++) a = fmaf(e[j], v[key_row(j, P, extra) * ldv + c], a);
        out[c] = a;
    }
}

/* The weighted sums of R rows of one block at once (rows r of e at e + r * lde, each seeing
 * visible[r] keys: the P shared ones, then its own, extra[r] a tree path or NULL), NV
 * vectors of dims at a time: each shared value row is loaded once for the R rows. Per row
 * and dim the arithmetic is weighted_sum_rows_*'s: one fma chain over j in order from 0. */
#define WSUM_TILE(ISA, TARGET, VEC, LANES, NV, ZERO, SET1, LOAD, FMADD, STORE, R)            \
    TARGET static void wsum_##ISA##_##R(const float *e, int64_t lde, const int64_t *visible, \
                                       const int64_t *const *extra, const float *v,         \
                                       int64_t ldv, int64_t c, int64_t P, float *const *out) { \
        VEC acc[R][NV];                                                                     \
        for (int r = 0; r < R; r++)                                                         \
            for (int i = 0; i < NV; i++) acc[r][i] = ZERO();                                \
        for (int64_t j = 0; j < P; j++) {                                                   \
            VEC row[NV];                                                                    \
            for (int i = 0; i < NV; i++) row[i] = LOAD(v + j * ldv + c + i * LANES);        \
            for (int r = 0; r < R; r++) {                                                   \
                VEC w = SET1(e[r * lde + j]);                                               \
                for (int i = 0; i < NV; i++) acc[r][i] = FMADD(w, row[i], acc[r][i]);       \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < R; r++) {                                                       \
            for (int64_t j = P; j < visible[r]; j++) {                                      \
                const float *row = v + (extra[r] ? key_row(j, P, extra[r]) : j) * ldv + c;  \
                VEC w = SET1(e[r * lde + j]);                                               \
                for (int i = 0; i < NV; i++)                                                \
                    acc[r][i] = FMADD(w, LOAD(row + i * LANES), acc[r][i]);                 \
            }                                                                               \
            for (int i = 0; i < NV; i++) STORE(out[r] + c + i * LANES, acc[r][i]);          \
        }                                                                                   \
    }

typedef void (*wsum_fn)(const float *e, int64_t lde, const int64_t *visible,
                        const int64_t *const *extra, const float *v, int64_t ldv, int64_t c,
                        int64_t P, float *const *out);

#define AVX2_WSUM(R) WSUM_TILE(avx2, __attribute__((target("avx2,fma"))), __m256, 8, 2,      \
                               _mm256_setzero_ps, _mm256_set1_ps, _mm256_loadu_ps,          \
                               _mm256_fmadd_ps, _mm256_storeu_ps, R)
#define AVX512_WSUM(R) WSUM_TILE(avx512, __attribute__((target("avx512f"))), __m512, 16, 2,  \
                                 _mm512_setzero_ps, _mm512_set1_ps, _mm512_loadu_ps,        \
                                 _mm512_fmadd_ps, _mm512_storeu_ps, R)
#define WSUM_ROWS 6 /* AVX2: 12 accumulators + 2 rows of 8 in 16 registers; AVX-512: of 16 in 32 */
AVX2_WSUM(1) AVX2_WSUM(2) AVX2_WSUM(3) AVX2_WSUM(4) AVX2_WSUM(5) AVX2_WSUM(6)
AVX512_WSUM(1) AVX512_WSUM(2) AVX512_WSUM(3) AVX512_WSUM(4) AVX512_WSUM(5) AVX512_WSUM(6)
static const wsum_fn wsum_avx2[WSUM_ROWS + 1] = {0, wsum_avx2_1, wsum_avx2_2, wsum_avx2_3,
                                                 wsum_avx2_4, wsum_avx2_5, wsum_avx2_6};
static const wsum_fn wsum_avx512[WSUM_ROWS + 1] = {0, wsum_avx512_1, wsum_avx512_2,
                                                   wsum_avx512_3, wsum_avx512_4,
                                                   wsum_avx512_5, wsum_avx512_6};

/* The weighted sums of a block's rows (as WSUM_TILE's arguments, `rows` of them): WSUM_ROWS
 * rows at a time over the dims the tiles cover (2 vectors of `lanes`), the rest of the dims
 * row by row with `one` (weighted_sum_rows_*: the same chains). */
static void weighted_sum_block(const wsum_fn *tiles, int64_t lanes,
                               void (*one)(const float *, int64_t, const float *, int64_t,
                                           int64_t, float *, int64_t, const int64_t *),
                               const float *e, int64_t lde, int64_t rows,
                               const int64_t *visible, const int64_t *const *extra,
                               const float *v, int64_t ldv, int64_t d, int64_t P,
                               float *const *out) {
    int64_t c = 0;
    if (tiles)
        for (; c + 2 * lanes <= d; c += 2 * lanes)
            for (int64_t r = 0; r < rows; r += WSUM_ROWS)
                tiles[MIN(WSUM_ROWS, rows - r)](e + r * lde, lde, visible + r, extra + r, v,
                                                ldv, c, P, out + r);
    if (c < d)
        for (int64_t r = 0; r < rows; r++)
            one(e + r * lde, visible[r], v + c, ldv, d - c, out[r] + c,
                extra[r] ? P : visible[r], extra[r]);
}

#define QUERY_BLOCK 8

/* Kv head g of es_attention (below): its heads' queries, QUERY_BLOCK at a time;
 * e: QUERY_BLOCK * (H / Hkv) * L floats of scratch. One body, compiled for AVX2 (where the
 * dot products inline) and for the portable path. */
#define ATTEND_KV_HEAD(NAME, TARGET, DOT, DOT8, EXP_SUM, WSUM_TILES, WSUM_LANES, WEIGHTED_SUM) \
    TARGET static void NAME(                                                                  \
        const float *q, int64_t nq, int64_t H, int64_t d, int64_t sq, int64_t sh,             \
        const float *k, const float *v, int64_t Hkv, int64_t L, int64_t skh, int64_t skj,     \
        int64_t svh, int64_t svj, float scale, float *out, int64_t so, int64_t soh, float *e, \
        const int64_t *tree_rows, const int64_t *tree_offsets, int64_t g, int64_t h0,         \
        int64_t h1) {                                                                         \
        const int64_t W = h1 - h0, P = L - nq;                                                \
        const float *kh = k + g * skh, *vh = v + g * svh;                                     \
        for (int64_t i0 = 0; i0 < nq; i0 += QUERY_BLOCK) {                                    \
            int64_t rows = MIN(QUERY_BLOCK, nq - i0) * W;                                     \
            /* row r: query i0 + r / W, head h0 + r % W; its scores at e + r * L */           \
            /* S keys every query of the block sees: the P before the new ones, and in a      \
             * chain the new ones up to the block's first query */                            \
            const int64_t S = tree_rows ? P : P + i0 + 1;                                     \
            int64_t j = 0; /* eight at a time, once for the block */                          \
            for (; j + 8 <= S; j += 8)                                                        \
                for (int64_t r = 0; r < rows; r++)                                            \
                    DOT8(q + (i0 + r / W) * sq + (h0 + r % W) * sh, kh + j * skj, skj, d,     \
                         scale, e + r * L + j);                                               \
            for (; j < S; j++) {                                                              \
                const float *kj = kh + j * skj;                                               \
                for (int64_t r = 0; r < rows; r++)                                            \
                    e[r * L + j] = DOT(q + (i0 + r / W) * sq + (h0 + r % W) * sh, kj, d) * scale; \
            }                                                                                 \
            int64_t visible[rows];                                                            \
            const int64_t *extra[rows]; /* a tree node's path (see the header), or NULL */    \
            float *o[rows], sum[rows];                                                        \
            for (int64_t r = 0; r < rows; r++) {                                              \
                int64_t i = i0 + r / W, h = h0 + r % W;                                       \
                visible[r] = P + 1 + i, extra[r] = NULL;                                      \
                if (tree_rows) {                                                              \
                    extra[r] = tree_rows + tree_offsets[i];                                   \
                    visible[r] = P + tree_offsets[i + 1] - tree_offsets[i];                   \
                }                                                                             \
                const float *qr = q + i * sq + h * sh;                                        \
                float *er = e + r * L;                                                        \
                for (int64_t j = S; j < visible[r]; j++)                                      \
                    er[j] = DOT(qr, kh + (extra[r] ? key_row(j, P, extra[r]) : j) * skj, d)   \
                            * scale;                                                          \
                float m = -INFINITY;                                                          \
                for (int64_t j = 0; j < visible[r]; j++) m = er[j] > m ? er[j] : m;           \
                sum[r] = EXP_SUM(er, visible[r], m);                                          \
                o[r] = out + i * so + h * soh;                                                \
            }                                                                                 \
            weighted_sum_block(WSUM_TILES, WSUM_LANES, WEIGHTED_SUM, e, L, rows, visible,     \
                               extra, vh, svj, d, S, o);                                      \
            for (int64_t r = 0; r < rows; r++)                                                \
                for (int64_t c = 0; c < d; c++) o[r][c] = o[r][c] / sum[r];                   \
        }                                                                                     \
    }

ATTEND_KV_HEAD(attend_kv_head_avx2, __attribute__((target("avx2,fma"))), dot_avx2, dot8_avx2,
               exp_sum_avx2, wsum_avx2, 8, weighted_sum_rows_avx2)
ATTEND_KV_HEAD(attend_kv_head_avx512, __attribute__((target("avx512f,avx2,fma"))), dot_avx2,
               dot8_avx2, exp_sum_avx2, wsum_avx512, 16, weighted_sum_rows_avx512)
ATTEND_KV_HEAD(attend_kv_head_portable, , dot_portable, dot8_portable, exp_sum_portable,
               NULL, 1, weighted_sum_rows_portable)

/* Heads h0 .. h1 - 1 (all of kv head g's group, or part of it) of es_attention. */
void attend_kv_head(const float *q, int64_t nq, int64_t H, int64_t d, int64_t sq,
                           int64_t sh, const float *k, const float *v, int64_t Hkv, int64_t L,
                           int64_t skh, int64_t skj, int64_t svh, int64_t svj, float scale,
                           float *out, int64_t so, int64_t soh, float *e, int isa,
                           const int64_t *tree_rows, const int64_t *tree_offsets, int64_t g,
                           int64_t h0, int64_t h1) {
    (isa == 2 ? attend_kv_head_avx512 : isa == 1 ? attend_kv_head_avx2 : attend_kv_head_portable)(
        q, nq, H, d, sq, sh, k, v, Hkv, L, skh, skj, svh, svj, scale, out, so, soh, e,
        tree_rows, tree_offsets, g, h0, h1);
}

/* Floats of scratch attend_kv_head needs per thread. */
int64_t attention_scratch(int64_t H, int64_t Hkv, int64_t L) {
    return QUERY_BLOCK * (H / Hkv) * L;
}

/* q: element (i, h, c) at q[i*sq + h*sh + c]; k, v: (kvh, j, c) at [kvh*skh + j*skj + c];
 * out: (i, h, c) at out[i*so + h*soh + c]; threads take whole kv heads. */
int es_attention(const float *q, int64_t nq, int64_t H, int64_t d, int64_t sq, int64_t sh,
                 const float *k, const float *v, int64_t Hkv, int64_t L, int64_t skh,
                 int64_t skj, int64_t svh, int64_t svj, float scale, float *out, int64_t so,
                 int64_t soh, int threads, int isa, const int64_t *tree_rows,
                 const int64_t *tree_offsets) {
    if (threads < 1) threads = 1;
    if (threads > Hkv) threads = (int)Hkv;
    const int64_t per_thread = attention_scratch(H, Hkv, L);
    float *scratch = malloc(sizeof(float) * threads * per_thread);
    if (!scratch) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *e = scratch + omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < Hkv; g++)
            attend_kv_head(q, nq, H, d, sq, sh, k, v, Hkv, L, skh, skj, svh, svj, scale, out,
                           so, soh, e, isa, tree_rows, tree_offsets, g, g * (H / Hkv),
                           (g + 1) * (H / Hkv));
    }
    free(scratch);
    return 0;
}
