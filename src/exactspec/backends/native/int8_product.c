/* ---- products with int8 activations over repacked block weights (es_linear_q8) ----
 *
 * For the block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) es_forward multiplies
 * as llama.cpp's CPU backend does: each row of x is quantised per block of 32 inputs with a
 * scale of its own (so a row's bits never depend on another row), then exact integer dot
 * products per block of 32, scaled in float (docs/design.md, "The native backend: int8
 * activations"; one quantisation of x serves every type, the K types' super-blocks of 256
 * included):
 *
 *   es_quantize_rows, per row r and block b:
 *     a = max_k |x[r, k]| (exact);  dx = a / 127 (IEEE division);  inv = dx != 0 ? 1 / dx : 0
 *     xq[k] = x[r, k] * inv rounded to the nearest integer, ties to even (in [-127, 127])
 *     sx = sum_k xq[k], sxa = the sum of the first 16 (exact);  dxs = dx * (float)sx (rounded once)
 *
 *   es_linear_q8, per output j, over the blocks b of 32 in order (acc = 0 first), with u the
 *   weights' unsigned integers (decode_block below: the file's bits, no rounding), their
 *   dot products with xq exact in int32: i = sum_k u[k] xq[k], ia / ib over k < 16 / >= 16:
 *     Q4_0, Q5_0, Q8_0:  i -= o sx (o = 8, 16, 128: w = (u - o) d);  acc = fma((float)i, d * dx, acc)
 *     Q4_1, Q5_1:        acc = fma((float)i, d * dx, acc);  acc = fma(m, dxs, acc)
 *     Q4_K, Q5_K:        D = d * (float)sc, M = dmin * (float)mn (exact: an 11-bit significand
 *                        times a 6-bit integer);  acc = fma((float)i, D * dx, acc);
 *                        acc = fma(-M, dxs, acc)      (sub-block b's sc, mn; its super-block's d, dmin)
 *     Q6_K:              i = sca (ia - 32 sxa) + scb (ib - 32 (sx - sxa)) (the two 16-weight
 *                        scales; |i| <= 2 * 16 * 32 * 127 * 128 < 2^24, so (float)i is exact);
 *                        acc = fma((float)i, d * dx, acc)
 *     y[r, j] = acc                      (d * dx, D * dx: one float product, rounded once)
 *
 * The integers are exact and each output's floats are that one sequence on every path
 * (vector lanes hold output columns, never parts of one sum), so AVX-512 VNNI, AVX2 and
 * portable C give the same bits, whatever the rows, the other rows or the threads (which
 * split the columns in blocks of 48).
 *
 * es_repack reorders a matrix once, at load, per 16 output columns and super-block (S = 1
 * block of 32 weights, or S = 8 for the K types' 256), the file's bits reordered, never
 * widened: one 64-byte vector holds 4 consecutive weights of each of the 16 columns, which
 * VNNI's dpbusd multiplies by 4 inputs at once. Per sub-block s < S (k < 32 its weights,
 * j < 16 the column, byte position 4j + k % 4 of "quad" k / 4):
 *   nibbles  256 bytes: byte 64 (k % 16 / 4) + 4j + k % 4 holds u[k] & 15 in its low half for
 *            k < 16, in its high half for k >= 16 (Q8_0 instead: 512 bytes, byte
 *            64 (k / 4) + 4j + k % 4 = u[k] = q + 128)
 *   planes   P = 0 (Q5 types: bit 4) and P = 1 (Q6_K: bit 5), 64 bytes each: bit k / 4 of
 *            byte 4j + k % 4 is bit 4 + P of u[k]
 *   scales   Q4_K, Q5_K: sc, then mn, one byte per column; Q6_K: sca, then scb (int8)
 * then per super-block the 16 columns' d as halves, then (Q4_1, Q5_1, Q4_K, Q5_K) their m or
 * dmin. Columns past N (up to a multiple of 16) are zero and never stored.
 */

#include "kernels.h"


typedef struct {
    int sub;        /* blocks of 32 per super-block */
    int wide;       /* Q8_0: a byte per weight instead of nibbles */
    int planes;     /* high-bit planes per block: 0, 1 (5-bit u) or 2 (6-bit) */
    int scales;     /* scale bytes per column and block: 0, 1 (sc), 2 (Q6_K's two) */
    int mins;       /* min bytes per column and block: 0 or 1 */
    int halves;     /* halves per column and super-block: d, or d and m / dmin */
    int offset;     /* o: w = (u - o) d (Q4_0, Q5_0, Q8_0; Q6_K's 32 is applied per half) */
    /* byte offsets in a group's super-block, and its size */
    int64_t plane_at, scale_at, min_at, half_at, bytes;
} q8_layout;

static inline __attribute__((always_inline)) q8_layout q8_layout_of(int type) {
    q8_layout L = {0};
    switch (type) {
    case T_Q4_0: L = (q8_layout){1, 0, 0, 0, 0, 1, 8}; break;
    case T_Q4_1: L = (q8_layout){1, 0, 0, 0, 0, 2, 0}; break;
    case T_Q5_0: L = (q8_layout){1, 0, 1, 0, 0, 1, 16}; break;
    case T_Q5_1: L = (q8_layout){1, 0, 1, 0, 0, 2, 0}; break;
    case T_Q8_0: L = (q8_layout){1, 1, 0, 0, 0, 1, 128}; break;
    case T_Q4_K: L = (q8_layout){8, 0, 0, 1, 1, 2, 0}; break;
    case T_Q5_K: L = (q8_layout){8, 0, 1, 1, 1, 2, 0}; break;
    case T_Q6_K: L = (q8_layout){8, 0, 2, 2, 0, 1, 0}; break;
    default: return L; /* sub = 0: no int8 product */
    }
    L.plane_at = L.sub * (L.wide ? 512 : 256);
    L.scale_at = L.plane_at + L.sub * L.planes * 64;
    L.min_at = L.scale_at + L.sub * L.scales * 16;
    L.half_at = L.min_at + L.sub * L.mins * 16;
    L.bytes = L.half_at + 32 * L.halves;
    return L;
}

int64_t es_repacked_bytes(int type, int64_t N, int64_t K) {
    const q8_layout L = q8_layout_of(type);
    if (!L.sub || K % (32 * L.sub)) return 0;
    return (N + 15) / 16 * (K / (32 * L.sub)) * L.bytes;
}

void es_repack(const uint8_t *w, int type, int64_t N, int64_t K, uint8_t *out) {
    const q8_layout L = q8_layout_of(type);
    const int64_t nsb = K / (32 * L.sub), row_bytes = es_row_bytes(type, K);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < (N + 15) / 16; g++)
        for (int64_t B = 0; B < nsb; B++) {
            q8_block c;
            uint8_t *o = out + (g * nsb + B) * L.bytes;
            __builtin_memset(o, 0, L.bytes);
            for (int64_t j = 0; j < 16 && g * 16 + j < N; j++) {
                decode_block(type, w + (g * 16 + j) * row_bytes + B * (row_bytes / nsb), &c);
                __builtin_memcpy(o + L.half_at + 2 * j, &c.d, 2);
                if (L.halves > 1) __builtin_memcpy(o + L.half_at + 32 + 2 * j, &c.m, 2);
                for (int s = 0; s < L.sub; s++) {
                    for (int k = 0; k < 32; k++) {
                        const uint8_t u = c.u[32 * s + k];
                        const int64_t at = 4 * j + k % 4;
                        if (L.wide) o[512 * s + 64 * (k / 4) + at] = u;
                        else o[256 * s + 64 * (k % 16 / 4) + at] |= k < 16 ? u & 15 : (u & 15) << 4;
                        for (int P = 0; P < L.planes; P++)
                            o[L.plane_at + 64 * (L.planes * s + P) + at] |=
                                (uint8_t)(((u >> (4 + P)) & 1) << (k / 4));
                    }
                    if (L.scales == 2) {
                        o[L.scale_at + 32 * s + j] = (uint8_t)c.sc[2 * s];
                        o[L.scale_at + 32 * s + 16 + j] = (uint8_t)c.sc[2 * s + 1];
                    } else if (L.scales == 1) o[L.scale_at + 16 * s + j] = (uint8_t)c.sc[s];
                    if (L.mins) o[L.min_at + 16 * s + j] = c.mn[s];
                }
            }
        }
}

/* Row r's block b: xq[r * K + 32 b ..], and per block dx, sx, sxa, dxs at [r * (K / 32) + b]. */

/* Room for n rows of K inputs (a multiple of 32), or all null if an allocation failed. */
es_q8_rows q8_rows_alloc(int64_t n, int64_t K) {
    const int64_t blocks = n * (K / 32 + 1);
    es_q8_rows q = {malloc(n * K + 1), malloc(sizeof(float) * blocks),
                    malloc(sizeof(int32_t) * blocks), malloc(sizeof(float) * blocks),
                    malloc(sizeof(int32_t) * blocks)};
    if (!q.xq || !q.dx || !q.sx || !q.dxs || !q.sxa) {
        free(q.xq); free(q.dx); free(q.sx); free(q.dxs); free(q.sxa);
        return (es_q8_rows){0};
    }
    return q;
}

void q8_rows_free(es_q8_rows q) {
    free(q.xq); free(q.dx); free(q.sx); free(q.dxs); free(q.sxa);
}

static void quantize_row_portable(const float *x, int64_t K, int8_t *xq, float *dx,
                                  int32_t *sx, float *dxs, int32_t *sxa) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float a = 0.0f;
        for (int k = 0; k < 32; k++) a = fmaxf(a, fabsf(xb[k]));
        float d = a / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0, half = 0;
        for (int k = 0; k < 32; k++) {
            int v = (int)nearbyintf(xb[k] * inv);
            xq[32 * b + k] = (int8_t)v;
            s += v;
            if (k == 15) half = s;
        }
        dx[b] = d, sx[b] = s, dxs[b] = d * (float)s, sxa[b] = half;
    }
}

/* The same numbers with AVX-512 (max, division, product and the conversion's rounding to
 * nearest even are the same IEEE operations). */
__attribute__((target("avx512f,avx512bw,avx512dq")))
static void quantize_row_avx512(const float *x, int64_t K, int8_t *xq, float *dx,
                                int32_t *sx, float *dxs, int32_t *sxa) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / 32; b++) {
        __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
        float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo),
                                                     _mm512_andnot_ps(sign, hi)));
        float d = a / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        __m512 vinv = _mm512_set1_ps(inv);
        __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv)),
                qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
        _mm_storeu_si128((__m128i *)(xq + 32 * b), _mm512_cvtepi32_epi8(ql));
        _mm_storeu_si128((__m128i *)(xq + 32 * b + 16), _mm512_cvtepi32_epi8(qh));
        int32_t half = _mm512_reduce_add_epi32(ql);
        int32_t s = half + _mm512_reduce_add_epi32(qh);
        dx[b] = d, sx[b] = s, dxs[b] = d * (float)s, sxa[b] = half;
    }
}

static int has_vnni = -1, has_avx512_quantize = -1;

static void cpu_features(void) {
    if (has_vnni < 0) {
        __builtin_cpu_init();
        has_vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")
                   && __builtin_cpu_supports("f16c");
        has_avx512_quantize = __builtin_cpu_supports("avx512bw")
                              && __builtin_cpu_supports("avx512dq");
    }
}

/* Quantise rows r0..r1 of x (row stride ldx, K inputs) into q (see the header); AVX-512
 * where isa is 2 and the CPU has it, else portable C (the same numbers). */
void es_quantize_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, int64_t K,
                      es_q8_rows q, int isa) {
    cpu_features();
    const int64_t nb = K / 32;
    for (int64_t r = r0; r < r1; r++)
        (isa == 2 && has_avx512_quantize ? quantize_row_avx512 : quantize_row_portable)(
            x + r * ldx, K, q.xq + r * K, q.dx + r * nb, q.sx + r * nb, q.dxs + r * nb,
            q.sxa + r * nb);
}

/* The float steps of one block for one output lane (the header's; the vector paths do the
 * same per lane): ia, ib the exact integer sums over its first and last 16 weights, at the
 * row's block index. */
static inline float q8_step(const q8_layout *L, int type, int32_t ia, int32_t ib,
                            es_q8_rows q, int64_t at, float d, float m, int32_t sca,
                            int32_t scb, int32_t mn, float acc) {
    if (type == T_Q6_K) {
        int32_t i = sca * (ia - 32 * q.sxa[at]) + scb * (ib - 32 * (q.sx[at] - q.sxa[at]));
        return fmaf((float)i, d * q.dx[at], acc);
    }
    int32_t i = ia + ib - L->offset * q.sx[at];
    if (L->scales) { /* Q4_K, Q5_K */
        acc = fmaf((float)i, (d * (float)sca) * q.dx[at], acc);
        return fmaf(-(m * (float)mn), q.dxs[at], acc);
    }
    acc = fmaf((float)i, d * q.dx[at], acc);
    return L->halves > 1 ? fmaf(m, q.dxs[at], acc) : acc;
}

static void q8_group_portable(int type, es_q8_rows q, int64_t rows, int64_t K,
                              const uint8_t *wg, int64_t columns, float *y, int64_t ldy) {
    const q8_layout L = q8_layout_of(type);
    const int64_t nb = K / 32, nsb = nb / L.sub;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < columns; j++) {
            float acc = 0.0f;
            for (int64_t B = 0; B < nsb; B++) {
                const uint8_t *o = wg + B * L.bytes;
                const float d = half_to_float(read_u16(o + L.half_at + 2 * j)),
                            m = L.halves > 1 ? half_to_float(read_u16(o + L.half_at + 32 + 2 * j)) : 0.0f;
                for (int s = 0; s < L.sub; s++) {
                    const int64_t b = B * L.sub + s;
                    const int8_t *xb = q.xq + r * K + 32 * b;
                    int32_t sum[2] = {0, 0};
                    for (int k = 0; k < 32; k++) {
                        const int64_t at = 4 * j + k % 4;
                        int u = L.wide ? o[512 * s + 64 * (k / 4) + at]
                                : k < 16 ? o[256 * s + 64 * (k / 4) + at] & 15
                                         : o[256 * s + 64 * ((k - 16) / 4) + at] >> 4;
                        for (int P = 0; P < L.planes; P++)
                            u |= ((o[L.plane_at + 64 * (L.planes * s + P) + at] >> (k / 4)) & 1) << (4 + P);
                        sum[k / 16] += u * xb[k];
                    }
                    int32_t sca = 0, scb = 0, mn = 0;
                    if (L.scales == 2)
                        sca = (int8_t)o[L.scale_at + 32 * s + j], scb = (int8_t)o[L.scale_at + 32 * s + 16 + j];
                    else if (L.scales == 1) sca = o[L.scale_at + 16 * s + j];
                    if (L.mins) mn = o[L.min_at + 16 * s + j];
                    acc = q8_step(&L, type, sum[0], sum[1], q, r * nb + b, d, m, sca, scb, mn, acc);
                }
            }
            y[r * ldy + j] = acc;
        }
}

/* Blocks ahead that a tile prefetches its weights (into L1). The hardware prefetcher alone
 * kept a tile of R > 1 rows waiting on memory: the 49,152-column LM head of the embedded
 * model took 1.1 / 1.7 / 1.05 ms for 2 / 3 / 4 rows against 0.66 for one and 5 (gcc 12's
 * code for some R left fewer loads in flight), so a forward over 3 tokens cost 1.65 plain
 * steps; with 16 blocks (8.7 KB) ahead every R from 1 to 6 takes 0.5 to 0.65 ms and c(3) is
 * 1.07 (Zen 4, 2 threads; results/native-prefetch-2026-12-04). Prefetching changes no
 * arithmetic. */
#define Q8_PREFETCH 16
#define Q8_TILE_ROWS 16 /* the most rows one tile takes */

/* The vector paths' tile: 16 columns (AVX-512: one vector; AVX2: two halves of 8) of R <=
 * Q8_TILE_ROWS rows, each block's weights unpacked into registers once for all R rows, the
 * accumulators in acc[R]. Written once for both widths; TYPE is a constant in each
 * instantiation (so that the layout's branches fold away). */
#define Q8_TILE_BODY(VEC, VECI, LANES, BYTES)                                               \
    const q8_layout L = q8_layout_of(type);                                                  \
    const int64_t nb = K / 32, nsb = nb / L.sub, sub_bytes = L.bytes / L.sub;               \
    VEC acc[Q8_TILE_ROWS];                                                                   \
    for (int r = 0; r < R; r++) acc[r] = ZERO_PS();                                          \
    for (int64_t B = 0; B < nsb; B++) {                                                      \
        const uint8_t *o = wg + B * L.bytes;                                                 \
        const VEC dv = HALVES(o + L.half_at + 2 * c0),                                       \
                  mv = L.halves > 1 ? HALVES(o + L.half_at + 32 + 2 * c0) : ZERO_PS();       \
        for (int s = 0; s < L.sub; s++) {                                                    \
            for (int64_t l = 0; l < sub_bytes; l += 64)                                      \
                _mm_prefetch((const char *)(o + s * sub_bytes + Q8_PREFETCH * sub_bytes + l), \
                             _MM_HINT_T0);                                                   \
            VECI w[8];                                                                       \
            if (L.wide)                                                                      \
                for (int p = 0; p < 8; p++) w[p] = LOAD_SI(o + 512 * s + 64 * p + BYTES * half); \
            else                                                                             \
                for (int p = 0; p < 4; p++) {                                                \
                    VECI v = LOAD_SI(o + 256 * s + 64 * p + BYTES * half);                   \
                    w[p] = AND_SI(v, SET1_8(15));                                            \
                    w[p + 4] = AND_SI(SRLI_16(v, 4), SET1_8(15));                            \
                }                                                                            \
            for (int P = 0; P < L.planes; P++) {                                             \
                const VECI h = LOAD_SI(o + L.plane_at + 64 * (L.planes * s + P) + BYTES * half); \
                const VECI bit = SET1_8(1 << (4 + P));                                       \
                for (int p = 0; p < 8; p++) /* bit p of h's bytes to bit 4 + P */           \
                    w[p] = OR_SI(w[p], AND_SI(4 + P >= p ? SLLI_16(h, 4 + P - p)             \
                                                         : SRLI_16(h, p - 4 - P), bit));     \
            }                                                                                \
            VEC D = dv, M = mv;                                                              \
            VECI sca = ZERO_SI(), scb = ZERO_SI();                                           \
            if (L.scales == 1) {                                                             \
                D = MUL_PS(dv, CVT_PS(U8_TO_32(o + L.scale_at + 16 * s + c0)));              \
                M = MUL_PS(mv, CVT_PS(U8_TO_32(o + L.min_at + 16 * s + c0)));                \
            } else if (L.scales == 2) {                                                      \
                sca = I8_TO_32(o + L.scale_at + 32 * s + c0);                                \
                scb = I8_TO_32(o + L.scale_at + 32 * s + 16 + c0);                           \
            }                                                                                \
            PREPARE_WEIGHTS                                                                  \
            for (int r = 0; r < R; r++) {                                                    \
                const int32_t *x4 = (const int32_t *)(q.xq + r * K + 32 * (B * L.sub + s));  \
                const int64_t at = r * nb + B * L.sub + s;                                   \
                VECI ia, ib;                                                                 \
                DOT_HALVES(ia, ib)                                                           \
                VECI i;                                                                      \
                if (type == T_Q6_K)                                                          \
                    i = ADD_32(MULLO_32(SUB_32(ia, SET1_32(32 * q.sxa[at])), sca),           \
                               MULLO_32(SUB_32(ib, SET1_32(32 * (q.sx[at] - q.sxa[at]))), scb)); \
                else                                                                         \
                    i = SUB_32(ADD_32(ia, ib), SET1_32(SUM_OFFSET * q.sx[at]));              \
                acc[r] = FMADD_PS(CVT_PS(i), MUL_PS(D, SET1_PS(q.dx[at])), acc[r]);          \
                if (L.scales == 1) acc[r] = FNMADD_PS(M, SET1_PS(q.dxs[at]), acc[r]);        \
                else if (L.halves > 1) acc[r] = FMADD_PS(M, SET1_PS(q.dxs[at]), acc[r]);     \
            }                                                                                \
        }                                                                                    \
    }

/* ---- AVX-512 VNNI: dpbusd (u8 x s8, 4 products a lane, added exactly in int32) ---- */
#define ZERO_PS _mm512_setzero_ps
#define ZERO_SI _mm512_setzero_si512
#define HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOAD_SI(p) _mm512_loadu_si512((const void *)(p))
#define AND_SI _mm512_and_si512
#define OR_SI _mm512_or_si512
#define SET1_8(v) _mm512_set1_epi8((char)(v))
#define SET1_32 _mm512_set1_epi32
#define SET1_PS _mm512_set1_ps
#define SRLI_16 _mm512_srli_epi16
#define SLLI_16 _mm512_slli_epi16
#define MUL_PS _mm512_mul_ps
#define CVT_PS _mm512_cvtepi32_ps
#define U8_TO_32(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define I8_TO_32(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define ADD_32 _mm512_add_epi32
#define SUB_32 _mm512_sub_epi32
#define MULLO_32 _mm512_mullo_epi32
#define FMADD_PS _mm512_fmadd_ps
#define FNMADD_PS _mm512_fnmadd_ps
#define SUM_OFFSET L.offset
#define PREPARE_WEIGHTS
#define DOT_HALVES(ia, ib)                                                                   \
    { /* two dpbusd chains per half (quads 0-3: weights 0-15) */                             \
        __m512i a0 = _mm512_dpbusd_epi32(ZERO_SI(), w[0], SET1_32(x4[0])),                   \
                a1 = _mm512_dpbusd_epi32(ZERO_SI(), w[1], SET1_32(x4[1])),                   \
                b0 = _mm512_dpbusd_epi32(ZERO_SI(), w[4], SET1_32(x4[4])),                   \
                b1 = _mm512_dpbusd_epi32(ZERO_SI(), w[5], SET1_32(x4[5]));                   \
        a0 = _mm512_dpbusd_epi32(a0, w[2], SET1_32(x4[2]));                                  \
        a1 = _mm512_dpbusd_epi32(a1, w[3], SET1_32(x4[3]));                                  \
        b0 = _mm512_dpbusd_epi32(b0, w[6], SET1_32(x4[6]));                                  \
        b1 = _mm512_dpbusd_epi32(b1, w[7], SET1_32(x4[7]));                                  \
        ia = ADD_32(a0, a1), ib = ADD_32(b0, b1);                                            \
    }
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"), always_inline)) static inline void
q8_vnni_body(const int type, es_q8_rows q, int R, int64_t K, const uint8_t *wg,
             int64_t columns, float *y, int64_t ldy) {
    const int half = 0, c0 = 0;
    Q8_TILE_BODY(__m512, __m512i, 16, 64)
    const __mmask16 keep = columns >= 16 ? 0xffff : (__mmask16)((1u << columns) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}
#undef ZERO_PS
#undef ZERO_SI
#undef HALVES
#undef LOAD_SI
#undef AND_SI
#undef OR_SI
#undef SET1_8
#undef SET1_32
#undef SET1_PS
#undef SRLI_16
#undef SLLI_16
#undef MUL_PS
#undef CVT_PS
#undef U8_TO_32
#undef I8_TO_32
#undef ADD_32
#undef SUB_32
#undef MULLO_32
#undef FMADD_PS
#undef FNMADD_PS
#undef SUM_OFFSET
#undef PREPARE_WEIGHTS
#undef DOT_HALVES

/* ---- AVX2: 8 columns a vector (half a group), dpbusd emulated by maddubs (u8 x s8 -> pairs
 * added in int16) and madd (pairs of int16 into int32). Exact: two maddubs results added in
 * int16 stay within |2 * 2 * 63 * 127| < 2^15 for u < 64. Q8_0 multiplies |q| by x with q's
 * sign (sign_epi8), one maddubs result (2 * 128 * 127) a madd, and its sum is sum q xq:
 * no -128 sx. ---- */
#define ZERO_PS _mm256_setzero_ps
#define ZERO_SI _mm256_setzero_si256
#define HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_SI(p) _mm256_loadu_si256((const __m256i *)(p))
#define AND_SI _mm256_and_si256
#define OR_SI _mm256_or_si256
#define SET1_8(v) _mm256_set1_epi8((char)(v))
#define SET1_32 _mm256_set1_epi32
#define SET1_PS _mm256_set1_ps
#define SRLI_16 _mm256_srli_epi16
#define SLLI_16 _mm256_slli_epi16
#define MUL_PS _mm256_mul_ps
#define CVT_PS _mm256_cvtepi32_ps
#define U8_TO_32(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define I8_TO_32(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define ADD_32 _mm256_add_epi32
#define SUB_32 _mm256_sub_epi32
#define MULLO_32 _mm256_mullo_epi32
#define FMADD_PS _mm256_fmadd_ps
#define FNMADD_PS _mm256_fnmadd_ps
#define SUM_OFFSET (L.wide ? 0 : L.offset)
#define PREPARE_WEIGHTS                                                                      \
    __m256i signs[8];                                                                        \
    if (L.wide)                                                                              \
        for (int p = 0; p < 8; p++) { /* q = u - 128: its sign, and |q| as the u8 operand */ \
            signs[p] = _mm256_xor_si256(w[p], SET1_8(0x80));                                 \
            w[p] = _mm256_abs_epi8(signs[p]);                                                \
        }
#define MADDUBS(p) _mm256_maddubs_epi16(w[p], L.wide ? _mm256_sign_epi8(SET1_32(x4[p]), signs[p]) \
                                                     : SET1_32(x4[p]))
#define DOT_HALVES(ia, ib)                                                                   \
    {                                                                                        \
        const __m256i ones = _mm256_set1_epi16(1);                                           \
        __m256i t[4];                                                                        \
        if (L.wide)                                                                          \
            for (int p = 0; p < 4; p++)                                                      \
                t[p] = _mm256_add_epi32(_mm256_madd_epi16(MADDUBS(2 * p), ones),             \
                                        _mm256_madd_epi16(MADDUBS(2 * p + 1), ones));        \
        else                                                                                 \
            for (int p = 0; p < 4; p++)                                                      \
                t[p] = _mm256_madd_epi16(_mm256_add_epi16(MADDUBS(2 * p), MADDUBS(2 * p + 1)), ones); \
        ia = ADD_32(t[0], t[1]), ib = ADD_32(t[2], t[3]);                                    \
    }
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
q8_avx2_body(const int type, es_q8_rows q, int R, int64_t K, const uint8_t *wg,
             int64_t columns, float *y, int64_t ldy) {
    for (int half = 0; half < 2 && 8 * half < columns; half++) {
        const int c0 = 8 * half;
        Q8_TILE_BODY(__m256, __m256i, 8, 32)
        for (int r = 0; r < R; r++) {
            if (columns >= c0 + 8) _mm256_storeu_ps(y + r * ldy + c0, acc[r]);
            else {
                float lanes[8];
                _mm256_storeu_ps(lanes, acc[r]);
                for (int64_t c = c0; c < columns; c++) y[r * ldy + c] = lanes[c - c0];
            }
        }
    }
}
#undef ZERO_PS
#undef ZERO_SI
#undef HALVES
#undef LOAD_SI
#undef AND_SI
#undef OR_SI
#undef SET1_8
#undef SET1_32
#undef SET1_PS
#undef SRLI_16
#undef SLLI_16
#undef MUL_PS
#undef CVT_PS
#undef U8_TO_32
#undef I8_TO_32
#undef ADD_32
#undef SUB_32
#undef MULLO_32
#undef FMADD_PS
#undef FNMADD_PS
#undef SUM_OFFSET
#undef PREPARE_WEIGHTS
#undef MADDUBS
#undef DOT_HALVES

/* One tile function per type and path (the type a constant in each). */
typedef void (*q8_tile_fn)(es_q8_rows, int, int64_t, const uint8_t *, int64_t, float *, int64_t);
/* VNNI: R a constant too (a case per row count), so that the R accumulators stay in
 * registers (32 of them: 8 for the weights, up to 16 for the rows); AVX2's 16 registers
 * cannot hold them anyway, so R stays a variable there. */
#define Q8_VNNI_ROWS(R) case R: q8_vnni_body(type, q, R, K, wg, columns, y, ldy); break;
#define Q8_TILES(NAME, TYPE)                                                                 \
    __attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) static void q8_vnni_##NAME(  \
        es_q8_rows q, int R, int64_t K, const uint8_t *wg, int64_t columns, float *y,        \
        int64_t ldy) {                                                                       \
        const int type = TYPE;                                                               \
        switch (R) {                                                                         \
            Q8_VNNI_ROWS(1) Q8_VNNI_ROWS(2) Q8_VNNI_ROWS(3) Q8_VNNI_ROWS(4) Q8_VNNI_ROWS(5)  \
            Q8_VNNI_ROWS(6) Q8_VNNI_ROWS(7) Q8_VNNI_ROWS(8) Q8_VNNI_ROWS(9) Q8_VNNI_ROWS(10) \
            Q8_VNNI_ROWS(11) Q8_VNNI_ROWS(12) Q8_VNNI_ROWS(13) Q8_VNNI_ROWS(14)              \
            Q8_VNNI_ROWS(15) Q8_VNNI_ROWS(16)                                                \
        }                                                                                    \
    }                                                                                        \
    __attribute__((target("avx2,fma,f16c"))) static void q8_avx2_##NAME(                     \
        es_q8_rows q, int R, int64_t K, const uint8_t *wg, int64_t columns, float *y,        \
        int64_t ldy) { q8_avx2_body(TYPE, q, R, K, wg, columns, y, ldy); }
Q8_TILES(q4_0, T_Q4_0) Q8_TILES(q4_1, T_Q4_1) Q8_TILES(q5_0, T_Q5_0) Q8_TILES(q5_1, T_Q5_1)
Q8_TILES(q8_0, T_Q8_0) Q8_TILES(q4_k, T_Q4_K) Q8_TILES(q5_k, T_Q5_K) Q8_TILES(q6_k, T_Q6_K)

static void q8_tiles(int type, q8_tile_fn *vnni, q8_tile_fn *avx2) {
    switch (type) {
#define Q8_CASE(NAME, TYPE) case TYPE: *vnni = q8_vnni_##NAME, *avx2 = q8_avx2_##NAME; break;
    Q8_CASE(q4_0, T_Q4_0) Q8_CASE(q4_1, T_Q4_1) Q8_CASE(q5_0, T_Q5_0) Q8_CASE(q5_1, T_Q5_1)
    Q8_CASE(q8_0, T_Q8_0) Q8_CASE(q4_k, T_Q4_K) Q8_CASE(q5_k, T_Q5_K) Q8_CASE(q6_k, T_Q6_K)
#undef Q8_CASE
    default: *vnni = *avx2 = 0;
    }
}

/* Columns j0..j1 (j0 a multiple of 16) of every row. */
void columns_q8(int isa, es_q8_rows q, int64_t rows, int64_t K, const uint8_t *packed,
                       int type, int64_t N, float *y, int64_t ldy, int64_t j0, int64_t j1) {
    cpu_features();
    q8_tile_fn vnni, avx2;
    q8_tiles(type, &vnni, &avx2);
    const q8_tile_fn tile = isa == 2 && has_vnni ? vnni : isa >= 1 ? avx2 : 0;
    const int64_t group_bytes = es_repacked_bytes(type, 16, K), nb = K / 32;
    for (int64_t j = j0; j < j1; j += 16) {
        const uint8_t *wg = packed + j / 16 * group_bytes;
        const int64_t columns = MIN(16, MIN(j1, N) - j);
        for (int64_t r = 0; r < rows; r += Q8_TILE_ROWS) {
            const int R = (int)MIN(Q8_TILE_ROWS, rows - r);
            es_q8_rows qr = {q.xq + r * K, q.dx + r * nb, q.sx + r * nb, q.dxs + r * nb,
                             q.sxa + r * nb};
            if (tile) tile(qr, R, K, wg, columns, y + r * ldy + j, ldy);
            else q8_group_portable(type, qr, R, K, wg, columns, y + r * ldy + j, ldy);
        }
    }
}

/* y [rows, N] = the int8 product of x's quantised rows q and a repacked weight (see the
 * header), on `threads` threads that split the columns in blocks of 48. */
void es_linear_q8(es_q8_rows q, int64_t rows, int64_t K, const uint8_t *packed, int type,
                  int64_t N, float *y, int64_t ldy, int threads, int isa) {
    int64_t blocks = (N + 47) / 48;
    if (rows <= 0 || N <= 0) return;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = (int)blocks;
#pragma omp parallel num_threads(threads)
    {
        int64_t j0, j1;
        column_share(N, omp_get_thread_num(), omp_get_num_threads(), &j0, &j1);
        if (j0 < j1) columns_q8(isa, q, rows, K, packed, type, N, y, ldy, j0, j1);
    }
}
