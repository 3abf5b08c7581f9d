/* exactspec's batch-invariant decode kernels (see exactspec/backends/native/__init__.py and
 * docs/design.md, "Batch-invariant kernels that read the weights once" and "The native
 * backend"): the float32 product (es_linear), the same product over GGUF weight blocks
 * (es_linear_typed), attention (es_attention) and a whole Llama-family forward pass over
 * GGUF weights (es_forward), each section's header giving its arithmetic.
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
#include <stdlib.h>

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

/* ---- weights in their GGUF block formats ----
 *
 * A weight matrix w [N, K] is kept as the GGUF file stores it (memory-mapped, never copied):
 * row j is K / B blocks of B weights each, types by ggml's numbers:
 *
 *     F32  (0)   B = 1   the float itself
 *     F16  (1)   B = 1   IEEE half -> float: exact
 *     BF16 (30)  B = 1   bfloat16 -> float (the 16 bits shifted up): exact
 *     Q8_0 (8)   B = 32  half d, int8 q[32]:              w = (float)q * d            exact
 *     Q4_0 (2)   B = 32  half d, 16 bytes of nibbles:     w = (float)(q - 8) * d      exact
 *     Q4_1 (3)   B = 32  half d, half m, 16 bytes:        w = (float)q * d + m        one rounding
 *
 * (Q4 weight i < 16 is byte i's low nibble, weight i + 16 its high nibble.) A product of a
 * small integer and a half's 11-bit significand fits float32's 24 bits, so every type but
 * Q4_1 dequantises exactly, and Q4_1 rounds once (the addition of m, round to nearest even):
 * the same floats as ggml's reference dequantisation and gguf-py's. Dequantising is thus
 * the same on every instruction-set path.
 *
 * The product: for C output columns at a time (a tile), the C weight rows are dequantised
 * once into a float panel [C, K] that stays in L1, and the float32 tile runs over every
 * row of x against the panel (each weight block is read from memory and dequantised once
 * per product, for all rows). An F32 matrix is its own panel. So each output element is
 * the float32 arithmetic of the header above over the dequantised weights, whatever the
 * rows, their number or the thread split.
 */

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f,
             mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) bits = sign | 0x7f800000 | (mantissa << 13); /* inf, nan */
    else if (exponent) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (!mantissa) bits = sign;                                    /* zero */
    else { /* subnormal half: a normal float */
        int shift = 0;
        while (!(mantissa & 0x400)) { mantissa <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    __builtin_memcpy(&v, p, 2);
    return v;
}

/* One column's super-block of the file decoded: u[32 S] unsigned integers, sc (Q6_K: 16
 * int8 per 16 weights; Q4_K, Q5_K: 8 6-bit per 32), mn (8 6-bit), the halves d and m (m,
 * or dmin). The bit layouts are ggml's (ggml-common.h). */
typedef struct { uint8_t u[256]; int8_t sc[16]; uint8_t mn[8]; uint16_t d, m; } q8_block;

static void k_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) *sc = q[j] & 63, *mn = q[j + 4] & 63;
    else *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4), *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
}

static void decode_block(int type, const uint8_t *p, q8_block *c) {
    switch (type) {
    case T_Q8_0:
        c->d = read_u16(p);
        for (int k = 0; k < 32; k++) c->u[k] = (uint8_t)((int8_t)p[2 + k] + 128);
        break;
    case T_Q4_0: case T_Q4_1: {
        const uint8_t *qs = p + (type == T_Q4_1 ? 4 : 2);
        c->d = read_u16(p), c->m = type == T_Q4_1 ? read_u16(p + 2) : 0;
        for (int k = 0; k < 16; k++) c->u[k] = qs[k] & 15, c->u[k + 16] = qs[k] >> 4;
        break;
    }
    case T_Q5_0: case T_Q5_1: {
        const int at = type == T_Q5_1 ? 4 : 2;
        uint32_t qh;
        __builtin_memcpy(&qh, p + at, 4);
        c->d = read_u16(p), c->m = type == T_Q5_1 ? read_u16(p + 2) : 0;
        for (int k = 0; k < 16; k++) {
            c->u[k] = (p[at + 4 + k] & 15) | ((qh >> k) & 1) << 4;
            c->u[k + 16] = (p[at + 4 + k] >> 4) | ((qh >> (k + 16)) & 1) << 4;
        }
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        const uint8_t *qh = p + 16, *qs = p + (type == T_Q5_K ? 48 : 16);
        c->d = read_u16(p), c->m = read_u16(p + 2);
        for (int s = 0; s < 8; s++) {
            uint8_t sc;
            k_scale_min(p + 4, s, &sc, &c->mn[s]);
            c->sc[s] = (int8_t)sc;
        }
        for (int chunk = 0; chunk < 4; chunk++)
            for (int l = 0; l < 32; l++) {
                uint8_t lo = qs[32 * chunk + l] & 15, hi = qs[32 * chunk + l] >> 4;
                if (type == T_Q5_K) {
                    lo |= ((qh[l] >> (2 * chunk)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * chunk + 1)) & 1) << 4;
                }
                c->u[64 * chunk + l] = lo, c->u[64 * chunk + 32 + l] = hi;
            }
        break;
    }
    case T_Q6_K: {
        const uint8_t *ql = p, *qh = p + 128;
        for (int s = 0; s < 16; s++) c->sc[s] = (int8_t)p[192 + s];
        c->d = read_u16(p + 208), c->m = 0;
        for (int n = 0; n < 2; n++)
            for (int l = 0; l < 32; l++) {
                const uint8_t a = ql[64 * n + l], b = ql[64 * n + 32 + l], h = qh[32 * n + l];
                c->u[128 * n + l] = (a & 15) | (h & 3) << 4;
                c->u[128 * n + 32 + l] = (b & 15) | ((h >> 2) & 3) << 4;
                c->u[128 * n + 64 + l] = (a >> 4) | ((h >> 4) & 3) << 4;
                c->u[128 * n + 96 + l] = (b >> 4) | ((h >> 6) & 3) << 4;
            }
        break;
    }
    }
}

/* Bytes of one row of K weights of `type`, or 0 for a type or K these kernels do not take. */
int64_t es_row_bytes(int type, int64_t K) {
    switch (type) {
    case T_F32: return 4 * K;
    case T_F16: case T_BF16: return 2 * K;
    case T_Q8_0: return K % 32 ? 0 : K / 32 * 34;
    case T_Q4_0: return K % 32 ? 0 : K / 32 * 18;
    case T_Q4_1: return K % 32 ? 0 : K / 32 * 20;
    case T_Q5_0: return K % 32 ? 0 : K / 32 * 22;
    case T_Q5_1: return K % 32 ? 0 : K / 32 * 24;
    case T_Q4_K: return K % 256 ? 0 : K / 256 * 144;
    case T_Q5_K: return K % 256 ? 0 : K / 256 * 176;
    case T_Q6_K: return K % 256 ? 0 : K / 256 * 210;
    default: return 0;
    }
}

/* out[0..K) = row `row` of w [N, K] of `type`, dequantised (see above); portable C */
static void dequantize_row_portable(int type, const uint8_t *w, int64_t row, int64_t K,
                                    float *out) {
    const uint8_t *p = w + row * es_row_bytes(type, K);
    switch (type) {
    case T_F32: __builtin_memcpy(out, p, 4 * K); break;
    case T_F16: for (int64_t i = 0; i < K; i++) out[i] = half_to_float(read_u16(p + 2 * i)); break;
    case T_BF16:
        for (int64_t i = 0; i < K; i++) {
            uint32_t bits = (uint32_t)read_u16(p + 2 * i) << 16;
            __builtin_memcpy(out + i, &bits, 4);
        }
        break;
    case T_Q8_0:
        for (int64_t b = 0; b < K / 32; b++, p += 34, out += 32) {
            float d = half_to_float(read_u16(p));
            const int8_t *q = (const int8_t *)(p + 2);
            for (int i = 0; i < 32; i++) out[i] = (float)q[i] * d;
        }
        break;
    case T_Q4_0:
        for (int64_t b = 0; b < K / 32; b++, p += 18, out += 32) {
            float d = half_to_float(read_u16(p));
            const uint8_t *q = p + 2;
            for (int i = 0; i < 16; i++) {
                out[i] = (float)((q[i] & 15) - 8) * d;
                out[i + 16] = (float)((q[i] >> 4) - 8) * d;
            }
        }
        break;
    case T_Q4_1:
        for (int64_t b = 0; b < K / 32; b++, p += 20, out += 32) {
            float d = half_to_float(read_u16(p)), m = half_to_float(read_u16(p + 2));
            const uint8_t *q = p + 4;
            for (int i = 0; i < 16; i++) {
                out[i] = (float)(q[i] & 15) * d + m;
                out[i + 16] = (float)(q[i] >> 4) * d + m;
            }
        }
        break;
    case T_Q5_0: case T_Q5_1: case T_Q4_K: case T_Q5_K: case T_Q6_K: {
        const int sub = type == T_Q5_0 || type == T_Q5_1 ? 1 : 8;
        const int64_t bytes = es_row_bytes(type, 32 * sub);
        q8_block c;
        for (int64_t B = 0; B < K / (32 * sub); B++, p += bytes, out += 32 * sub) {
            decode_block(type, p, &c);
            const float d = half_to_float(c.d), m = half_to_float(c.m);
            for (int k = 0; k < 32 * sub; k++)
                out[k] = type == T_Q5_0 ? (float)(c.u[k] - 16) * d
                       : type == T_Q5_1 ? (float)c.u[k] * d + m
                       : type == T_Q6_K ? (d * (float)c.sc[k / 16]) * (float)(c.u[k] - 32)
                       : (d * (float)c.sc[k / 32]) * (float)c.u[k] - m * (float)c.mn[k / 32];
        }
        break;
    }
    }
}

/* One block of 32 weights dequantised into two AVX-512 vectors (the floats above: for
 * Q4_1 an FMA q * d + m rounds once, like the exact multiply then the add), for
 * dequantize_row_avx512 and the fused tiles below. */
__attribute__((target("avx512f,avx512bw,f16c"))) static inline void dq_q4_1(
    const uint8_t *p, __m512 *lo, __m512 *hi) {
    const __m128i low4 = _mm_set1_epi8(15);
    __m512 d = _mm512_set1_ps(_cvtsh_ss(read_u16(p))), m = _mm512_set1_ps(_cvtsh_ss(read_u16(p + 2)));
    __m128i q = _mm_loadu_si128((const __m128i *)(p + 4));
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low4))), d, m);
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_and_si128(_mm_srli_epi16(q, 4), low4))), d, m);
}
__attribute__((target("avx512f,avx512bw,f16c"))) static inline void dq_q4_0(
    const uint8_t *p, __m512 *lo, __m512 *hi) {
    const __m128i low4 = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    __m512 d = _mm512_set1_ps(_cvtsh_ss(read_u16(p)));
    __m128i q = _mm_loadu_si128((const __m128i *)(p + 2));
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_sub_epi8(_mm_and_si128(q, low4), eight))), d);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low4), eight))), d);
}
__attribute__((target("avx512f,avx512bw,f16c"))) static inline void dq_q8_0(
    const uint8_t *p, __m512 *lo, __m512 *hi) {
    __m512 d = _mm512_set1_ps(_cvtsh_ss(read_u16(p)));
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)))), d);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18)))), d);
}

__attribute__((target("avx512f,avx512bw,f16c"))) static inline void dq_f16(
    const uint8_t *p, __m512 *lo, __m512 *hi) {
    *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    *hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
}
__attribute__((target("avx512f,avx512bw,f16c"))) static inline void dq_bf16(
    const uint8_t *p, __m512 *lo, __m512 *hi) {
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    *hi = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 32))), 16));
}

/* The same floats with AVX-512 (F16C for the halves: an exact conversion too). */
__attribute__((target("avx512f,avx512bw,f16c")))
static void dequantize_row_avx512(int type, const uint8_t *w, int64_t row, int64_t K,
                                  float *out) {
    const uint8_t *p = w + row * es_row_bytes(type, K);
    __m512 lo, hi;
    switch (type) {
    case T_Q8_0: case T_Q4_0: case T_Q4_1:
        for (int64_t b = 0; b < K / 32; b++, out += 32) {
            if (type == T_Q8_0) dq_q8_0(p + 34 * b, &lo, &hi);
            else if (type == T_Q4_0) dq_q4_0(p + 18 * b, &lo, &hi);
            else dq_q4_1(p + 20 * b, &lo, &hi);
            _mm512_storeu_ps(out, lo);
            _mm512_storeu_ps(out + 16, hi);
        }
        break;
    case T_F16:
        for (int64_t i = 0; i + 16 <= K; i += 16)
            _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i))));
        for (int64_t i = K / 16 * 16; i < K; i++) out[i] = _cvtsh_ss(read_u16(p + 2 * i));
        break;
    default: dequantize_row_portable(type, w, row, K, out);
    }
}

__attribute__((target("avx2,fma,f16c")))
static void dequantize_row_avx2(int type, const uint8_t *w, int64_t row, int64_t K, float *out) {
    const uint8_t *p = w + row * es_row_bytes(type, K);
    const __m128i low4 = _mm_set1_epi8(15);
    switch (type) {
    case T_Q8_0:
        for (int64_t b = 0; b < K / 32; b++, p += 34, out += 32) {
            __m256 d = _mm256_set1_ps(_cvtsh_ss(read_u16(p)));
            for (int h = 0; h < 4; h++) {
                __m128i q = _mm_loadl_epi64((const __m128i *)(p + 2 + 8 * h));
                _mm256_storeu_ps(out + 8 * h,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
            }
        }
        break;
    case T_Q4_0: case T_Q4_1: {
        const int offset = type == T_Q4_1 ? 4 : 2, size = type == T_Q4_1 ? 20 : 18;
        const __m256i eight = _mm256_set1_epi32(type == T_Q4_0 ? 8 : 0);
        for (int64_t b = 0; b < K / 32; b++, p += size, out += 32) {
            __m256 d = _mm256_set1_ps(_cvtsh_ss(read_u16(p)));
            __m256 m = _mm256_set1_ps(type == T_Q4_1 ? _cvtsh_ss(read_u16(p + 2)) : 0.0f);
            __m128i q = _mm_loadu_si128((const __m128i *)(p + offset));
            __m128i nib[2] = {_mm_and_si128(q, low4), _mm_and_si128(_mm_srli_epi16(q, 4), low4)};
            for (int h = 0; h < 4; h++) {
                __m128i part = h & 1 ? _mm_srli_si128(nib[h / 2], 8) : nib[h / 2];
                __m256 v = _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(part), eight)), d);
                if (type == T_Q4_1) v = _mm256_add_ps(v, m);
                _mm256_storeu_ps(out + 8 * h, v);
            }
        }
        break;
    }
    case T_F16:
        for (int64_t i = 0; i + 8 <= K; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
        for (int64_t i = K / 8 * 8; i < K; i++) out[i] = _cvtsh_ss(read_u16(p + 2 * i));
        break;
    default: dequantize_row_portable(type, w, row, K, out);
    }
}

/* Dequantising is exact (see above), so which path runs changes no bit; the fastest the
 * CPU runs is used whatever the product's path. */
static int dequantize_isa = -1;

static void dequantize_row(int type, const uint8_t *w, int64_t row, int64_t K, float *out) {
    if (dequantize_isa < 0) {
        __builtin_cpu_init();
        dequantize_isa = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c") ? 2
                         : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 1 : 0;
    }
    if (dequantize_isa == 2) dequantize_row_avx512(type, w, row, K, out);
    else if (dequantize_isa == 1) dequantize_row_avx2(type, w, row, K, out);
    else dequantize_row_portable(type, w, row, K, out);
}

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

#define PANEL_COLUMNS 6 /* the widest tile */

static void columns(int isa, const float *x, int64_t ldx, int64_t rows, int64_t K,
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
static void column_share(int64_t N, int t, int n, int64_t *j0, int64_t *j1) {
    int64_t blocks = (N + 47) / 48;
    *j0 = MIN(blocks * t / n * 48, N);
    *j1 = MIN(blocks * (t + 1) / n * 48, N);
}

/* y [rows, N] (row stride ldy) = x [rows, K] (row stride ldx) @ w [N, K]^T (w contiguous,
 * of `type`, see above), on `threads` threads that split the output columns in blocks of 48,
 * with instruction set `isa` (as es_best_isa returns; a lower one may be forced). */
void es_linear_typed(const float *x, int64_t ldx, int64_t rows, int64_t K, const void *w,
                     int type, int64_t N, float *y, int64_t ldy, int threads, int isa) {
    int64_t blocks = (N + 47) / 48;
    if (rows <= 0 || N <= 0) return;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = (int)blocks;
#pragma omp parallel num_threads(threads)
    {
        int64_t j0, j1;
        float *panel = type == T_F32 ? NULL : malloc(sizeof(float) * PANEL_COLUMNS * K);
        column_share(N, omp_get_thread_num(), omp_get_num_threads(), &j0, &j1);
        if (j0 < j1) columns(isa, x, ldx, rows, K, w, type, y, ldy, j0, j1, panel);
        free(panel);
    }
}

void es_linear(const float *x, int64_t ldx, int64_t rows, int64_t K, const float *w,
               int64_t N, float *y, int64_t ldy, int threads, int isa) {
    es_linear_typed(x, ldx, rows, K, w, T_F32, N, y, ldy, threads, isa);
}

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
typedef struct { int8_t *xq; float *dx; int32_t *sx; float *dxs; int32_t *sxa; } es_q8_rows;

/* Room for n rows of K inputs (a multiple of 32), or all null if an allocation failed. */
static es_q8_rows q8_rows_alloc(int64_t n, int64_t K) {
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

static void q8_rows_free(es_q8_rows q) {
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
static void columns_q8(int isa, es_q8_rows q, int64_t rows, int64_t K, const uint8_t *packed,
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

static void silu_mul(const float *g, const float *u, float *x, int64_t n, int isa) {
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

__attribute__((target("avx2,fma"))) static inline float dot_avx2(const float *a, const float *b,
                                                          int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    float s = hsum8(acc);
    for (; c < d; c++) s = fmaf(a[c], b[c], s);
    return s;
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
static void attend_kv_head(const float *q, int64_t nq, int64_t H, int64_t d, int64_t sq,
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
static int64_t attention_scratch(int64_t H, int64_t Hkv, int64_t L) {
    return QUERY_BLOCK * (H / Hkv) * L;
}

/* q: element (i, h, c) at q[i*sq + h*sh + c]; k, v: (kvh, j, c) at [kvh*skh + j*skj + c];
 * out: (i, h, c) at out[i*so + h*soh + c]; threads take whole kv heads. */
void es_attention(const float *q, int64_t nq, int64_t H, int64_t d, int64_t sq, int64_t sh,
                  const float *k, const float *v, int64_t Hkv, int64_t L, int64_t skh,
                  int64_t skj, int64_t svh, int64_t svj, float scale, float *out, int64_t so,
                  int64_t soh, int threads, int isa, const int64_t *tree_rows,
                  const int64_t *tree_offsets) {
    if (threads < 1) threads = 1;
    if (threads > Hkv) threads = (int)Hkv;
#pragma omp parallel num_threads(threads)
    {
        float *e = malloc(sizeof(float) * attention_scratch(H, Hkv, L));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < Hkv; g++)
            attend_kv_head(q, nq, H, d, sq, sh, k, v, Hkv, L, skh, skj, svh, svj, scale, out,
                           so, soh, e, isa, tree_rows, tree_offsets, g, g * (H / Hkv),
                           (g + 1) * (H / Hkv));
        free(e);
    }
}

/* ---- a Llama-family forward pass over GGUF weights ----
 *
 * es_forward runs the decoder of a Llama-family model (Llama, Mistral, Qwen2: RMSNorm,
 * grouped-query attention with RoPE, optional q/k/v biases, SwiGLU) over n new tokens of
 * one or more sequences (segments), in one OpenMP parallel region: threads split the
 * output columns of every product (es_linear's shares), the (segment, head) pairs of
 * attention, and the rows of the per-row steps. Per row and per layer:
 *
 *     x  = rms_norm(h, attn_norm)        ss = dot(h, h) (8-lane order, as the products);
 *                                        x[c] = (h[c] * (1 / sqrtf(ss / E + eps))) * w[c]
 *     q, k, v = x @ Wq^T (+ bq), ...     the typed product above
 *     RoPE on q and k at the row's position: angle = pos * scale * base^(-2i / n_rot)
 *                                        / factor[i] in double, cos and sin rounded to float;
 *                                        (a, b) -> (a c - b s, a s + b c) in float; pairs
 *                                        (2i, 2i+1) (llama.cpp's "norm" mode) or (i, i + n_rot/2)
 *                                        ("neox")
 *     k, v appended to the segment's cache at its next positions
 *     a  = attention (attend_kv_head: the query's keys, one-token-step arithmetic; trees too)
 *     h  = h + a @ Wo^T
 *     x  = rms_norm(h, ffn_norm);  g = x @ Wgate^T;  u = x @ Wup^T
 *     h  = h + (silu(g) * u) @ Wdown^T    silu(g) = (g < 0 ? g t : g) / (1 + t), t = exp(-|g|)
 *                                        (silu_mul: the exp of attention, the same bits on
 *                                        every path and machine)
 *
 * then logits = rms_norm(h, output_norm) @ Wout^T for the rows asked for. Every step of a
 * row reads only that row (and its own sequence's cache), so its bits do not depend on the
 * other rows, their number, the chunking of a prefill or the thread count.
 */

typedef struct {
    const void *data; int64_t type;
    const uint8_t *packed; /* es_repack's copy (the int8 product), or NULL (the float one) */
} es_weight;

typedef struct {
    const float *attn_norm, *ffn_norm, *bq, *bk, *bv; /* biases may be NULL */
    es_weight wq, wk, wv, wo, gate, up, down;
} es_layer;

typedef struct {
    int64_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, rope_dims, rope_neox;
    double rms_eps, rope_base, rope_scale;
    const float *rope_factors; /* [rope_dims / 2] or NULL */
    const float *output_norm;
    es_weight tok_embd, output;
    const es_layer *layers;
} es_model;

typedef struct {
    float *k_cache, *v_cache;     /* [n_layer][n_head_kv][capacity][head_dim] */
    int64_t capacity, n_past, n_tokens;
    const int64_t *tree_rows, *tree_offsets; /* NULL: a chain */
} es_segment;

static float rms_scale(const float *x, int64_t E, double eps, int isa) {
    float ss = isa >= 1 ? dot_avx2(x, x, E) : dot_portable(x, x, E);
    return 1.0f / sqrtf(ss / (float)E + (float)eps);
}

static void rms_norm(const float *x, const float *w, int64_t E, double eps, int isa, float *y) {
    float s = rms_scale(x, E, eps, isa);
    for (int64_t c = 0; c < E; c++) y[c] = (x[c] * s) * w[c];
}

static void rope_row(float *x, int64_t heads, int64_t d, int64_t n_rot, int neox,
                     const float *cs) {
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * d;
        for (int64_t i = 0; i < n_rot / 2; i++) {
            int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + n_rot / 2 : 2 * i + 1;
            float c = cs[2 * i], s = cs[2 * i + 1], a = xh[i0], b = xh[i1];
            xh[i0] = a * c - b * s;
            xh[i1] = a * s + b * c;
        }
    }
}

static void add_bias(float *y, const float *b, int64_t n) {
    if (b) for (int64_t c = 0; c < n; c++) y[c] += b[c];
}

/* tokens, positions: [n] (the rows of all segments, in order; a tree node's position is
 * n_past + its depth); logit_rows: [n_logits] rows whose logits are written to logits
 * [n_logits, n_vocab]; feature_layers: [n_features] layers whose outputs are written to
 * features [n, n_features * n_embd] (may be NULL when n_features is 0). */
void es_forward(const es_model *m, const es_segment *segs, int64_t n_segs,
                const int64_t *tokens, const int64_t *positions, int64_t n,
                const int64_t *logit_rows, int64_t n_logits, float *logits,
                const int64_t *feature_layers, int64_t n_features, float *features,
                int threads, int isa) {
    const int64_t E = m->n_embd, H = m->n_head, Hkv = m->n_head_kv, d = m->head_dim,
                  F = m->n_ff, QD = H * d, KD = Hkv * d, n_rot = m->rope_dims;
    int64_t max_L = 1, max_K = E > F ? E : F;
    for (int64_t s = 0; s < n_segs; s++)
        if (segs[s].n_past + segs[s].n_tokens > max_L) max_L = segs[s].n_past + segs[s].n_tokens;
    int64_t *seg_start = malloc(sizeof(int64_t) * (n_segs + 1));
    seg_start[0] = 0;
    for (int64_t s = 0; s < n_segs; s++) seg_start[s + 1] = seg_start[s] + segs[s].n_tokens;
    float *h = malloc(sizeof(float) * n * E), *x = malloc(sizeof(float) * n * max_K),
          *q = malloc(sizeof(float) * n * QD), *k = malloc(sizeof(float) * n * KD),
          *v = malloc(sizeof(float) * n * KD), *a = malloc(sizeof(float) * n * QD),
          *t1 = malloc(sizeof(float) * n * E), *g = malloc(sizeof(float) * n * F),
          *u = malloc(sizeof(float) * n * F), *cs = malloc(sizeof(float) * n * (n_rot + 1)),
          *xl = malloc(sizeof(float) * (n_logits ? n_logits : 1) * E);
    const int64_t max_Kq = max_K > QD ? max_K : QD; /* the widest input of a product */
    es_q8_rows q8 = q8_rows_alloc(n, max_Kq);
    const float scale = 1.0f / sqrtf((float)d);
    if (threads < 1) threads = 1;
    /* attention items per kv head: whole kv heads where they share out evenly among the
     * threads, else each head on its own (3 kv heads on 2 threads would leave one idle a
     * third of the time) */
    const int64_t kv_items = n_segs * Hkv,
                  split = kv_items % threads == 0 || kv_items >= 4 * threads ? 1 : H / Hkv;

#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t r0 = n * t / nt, r1 = n * (t + 1) / nt;
        float *panel = malloc(sizeof(float) * PANEL_COLUMNS * max_K);
        float *e = malloc(sizeof(float) * attention_scratch(H, Hkv, max_L));
#define LINEAR(X, K, W, N, Y)                                                               \
        do {                                                                              \
            int64_t j0, j1;                                                               \
            column_share(N, t, nt, &j0, &j1);                                             \
            if (j0 < j1 && (W).packed)                                                    \
                columns_q8(isa, q8, n, K, (W).packed, (int)(W).type, N, Y, N, j0, j1);    \
            else if (j0 < j1)                                                             \
                columns(isa, X, K, n, K, (W).data, (int)(W).type, Y, N, j0, j1, panel);   \
        } while (0)
#define QUANTIZE(X, K, NEEDED)  /* this thread's rows of X, for the int8 products */     \
        do {                                                                              \
            if (NEEDED) es_quantize_rows(X, K, r0, r1, K, q8, isa);                       \
        } while (0)

        for (int64_t r = r0; r < r1; r++) {
            dequantize_row((int)m->tok_embd.type, m->tok_embd.data, tokens[r], E, h + r * E);
            for (int64_t i = 0; i < n_rot / 2; i++) {
                double factor = m->rope_factors ? m->rope_factors[i] : 1.0;
                double angle = (double)positions[r] * m->rope_scale
                               * pow(m->rope_base, -2.0 * (double)i / (double)n_rot) / factor;
                cs[r * n_rot + 2 * i] = (float)cos(angle);
                cs[r * n_rot + 2 * i + 1] = (float)sin(angle);
            }
        }
        for (int64_t l = 0; l < m->n_layer; l++) {
            const es_layer *L = m->layers + l;
            for (int64_t r = r0; r < r1; r++)
                rms_norm(h + r * E, L->attn_norm, E, m->rms_eps, isa, x + r * E);
            QUANTIZE(x, E, L->wq.packed || L->wk.packed || L->wv.packed);
#pragma omp barrier
            LINEAR(x, E, L->wq, QD, q);
            LINEAR(x, E, L->wk, KD, k);
            LINEAR(x, E, L->wv, KD, v);
#pragma omp barrier
            for (int64_t s = 0; s < n_segs; s++)
                for (int64_t r = seg_start[s] > r0 ? seg_start[s] : r0;
                     r < seg_start[s + 1] && r < r1; r++) {
                    add_bias(q + r * QD, L->bq, QD);
                    add_bias(k + r * KD, L->bk, KD);
                    add_bias(v + r * KD, L->bv, KD);
                    rope_row(q + r * QD, H, d, n_rot, (int)m->rope_neox, cs + r * n_rot);
                    rope_row(k + r * KD, Hkv, d, n_rot, (int)m->rope_neox, cs + r * n_rot);
                    const es_segment *S = segs + s;
                    int64_t at = S->n_past + (r - seg_start[s]);
                    for (int64_t kh = 0; kh < Hkv; kh++) {
                        int64_t off = ((l * Hkv + kh) * S->capacity + at) * d;
                        __builtin_memcpy(S->k_cache + off, k + r * KD + kh * d, 4 * d);
                        __builtin_memcpy(S->v_cache + off, v + r * KD + kh * d, 4 * d);
                    }
                }
#pragma omp barrier
            /* items: (segment, kv head) or (segment, head); the split changes no arithmetic */
            for (int64_t item = t; item < n_segs * Hkv * split; item += nt) {
                const es_segment *S = segs + item / (Hkv * split);
                int64_t row = seg_start[item / (Hkv * split)], cap = S->capacity;
                int64_t g = item % (Hkv * split) / split, part = item % split;
                int64_t h0 = g * (H / Hkv) + part * (H / Hkv) / split,
                        h1 = g * (H / Hkv) + (part + 1) * (H / Hkv) / split;
                attend_kv_head(q + row * QD, S->n_tokens, H, d, QD, d,
                               S->k_cache + l * Hkv * cap * d, S->v_cache + l * Hkv * cap * d,
                               Hkv, S->n_past + S->n_tokens, cap * d, d, cap * d, d, scale,
                               a + row * QD, QD, d, e, isa, S->tree_rows, S->tree_offsets,
                               g, h0, h1);
            }
#pragma omp barrier
            if (L->wo.packed) {
                QUANTIZE(a, QD, 1);
#pragma omp barrier
            }
            LINEAR(a, QD, L->wo, E, t1);
#pragma omp barrier
            for (int64_t r = r0; r < r1; r++) {
                for (int64_t c = 0; c < E; c++) h[r * E + c] += t1[r * E + c];
                rms_norm(h + r * E, L->ffn_norm, E, m->rms_eps, isa, x + r * E);
            }
            QUANTIZE(x, E, L->gate.packed || L->up.packed);
#pragma omp barrier
            LINEAR(x, E, L->gate, F, g);
            LINEAR(x, E, L->up, F, u);
#pragma omp barrier
            for (int64_t r = r0; r < r1; r++) silu_mul(g + r * F, u + r * F, x + r * F, F, isa);
            QUANTIZE(x, F, L->down.packed);
#pragma omp barrier
            LINEAR(x, F, L->down, E, t1);
#pragma omp barrier
            for (int64_t r = r0; r < r1; r++) {
                for (int64_t c = 0; c < E; c++) h[r * E + c] += t1[r * E + c];
                for (int64_t f = 0; f < n_features; f++)
                    if (feature_layers[f] == l)
                        __builtin_memcpy(features + (r * n_features + f) * E, h + r * E, 4 * E);
            }
#pragma omp barrier
        }
        const int64_t i0 = n_logits * t / nt, i1 = n_logits * (t + 1) / nt;
        for (int64_t i = i0; i < i1; i++)
            rms_norm(h + logit_rows[i] * E, m->output_norm, E, m->rms_eps, isa, xl + i * E);
        if (m->output.packed) es_quantize_rows(xl, E, i0, i1, E, q8, isa);
#pragma omp barrier
        if (n_logits) {
            int64_t j0, j1;
            column_share(m->n_vocab, t, nt, &j0, &j1);
            if (j0 < j1 && m->output.packed)
                columns_q8(isa, q8, n_logits, E, m->output.packed, (int)m->output.type,
                           m->n_vocab, logits, m->n_vocab, j0, j1);
            else if (j0 < j1)
                columns(isa, xl, E, n_logits, E, m->output.data, (int)m->output.type, logits,
                        m->n_vocab, j0, j1, panel);
        }
        free(panel);
        free(e);
#undef LINEAR
#undef QUANTIZE
    }
    q8_rows_free(q8);
    free(seg_start); free(h); free(x); free(q); free(k); free(v); free(a); free(t1);
    free(g); free(u); free(cs); free(xl);
}

/* ---- a draft head's step (EAGLE-3's one decoder layer, exactspec.draft_head) ----
 *
 * es_head_step runs exactspec.draft_head.kernels.NativeHead.extend for a chain in one
 * OpenMP parallel region (no Python between the products): for n new rows at positions
 * n_past .. n_past + n - 1, row r with input token tokens[r] and input hidden[r], or, when
 * features is not NULL, hidden[r] = features[r] @ Wfc^T first (NativeHead.fc: the target's
 * fused features [n_features] projected, the int8 product; hidden is then not read):
 *
 *     x  = [rms_norm(embedding[token], input_norm), rms_norm(hidden, hidden_norm)]  [2E]
 *     q, k, v = x @ Wqkv^T                 the int8 product (es_linear_q8's arithmetic)
 *     RoPE ("neox" halves) at the row's position: angle = (float)pos * inv_freq[i] in
 *     float, cosf / sinf; k, v written to the cache row n_past + r
 *     a  = attention over the cache rows 0 .. n_past + r (attend_kv_head, causal)
 *     h  = hidden + a @ Wo^T
 *     out = h + (silu(g) * u) @ Wdown^T    with g, u = rms_norm(h, post_attention_norm) @ Wgu^T
 *
 * and, when logits is not NULL, logits [Vd] = rms_norm(out[n - 1], final_norm) @ Wlm^T
 * (the draft vocabulary's rows). rms_norm, silu and attention are es_forward's; all
 * weights are of one int8-product type (Q8_0, Q4_0 or Q4_1), repacked (es_repack). The
 * head's K/V cache: row j, kv head c at k_cache[(j * Hkv + c) * d] (HeadCache's
 * [rows, Hkv, d] buffers), capacity ≥ n_past + n. */
typedef struct {
    int64_t n_embd, n_head, n_head_kv, head_dim, n_ff, n_draft_vocab, weight_type;
    double rms_eps;
    const float *embedding;   /* [vocab, n_embd] float32 */
    const float *input_norm, *hidden_norm, *post_norm, *final_norm, *inv_freq;
    const uint8_t *qkv, *o, *gate_up, *down, *lm_head; /* es_repack'd, of weight_type */
    int64_t n_features;       /* the fused features' width, fc's K */
    const uint8_t *fc;        /* es_repack'd [n_embd, n_features], of weight_type */
} es_head;

void es_head_step(const es_head *m, float *k_cache, float *v_cache, int64_t n_past,
                  int64_t n, const float *hidden, const float *features,
                  const int64_t *tokens, float *out, float *logits, int threads, int isa) {
    const int64_t E = m->n_embd, H = m->n_head, Hkv = m->n_head_kv, d = m->head_dim,
                  F = m->n_ff, QD = H * d, KD = Hkv * d, QKV = QD + 2 * KD, L = n_past + n,
                  NF = m->n_features;
    int64_t widest = 2 * F > 2 * E ? 2 * F : 2 * E;
    if (features && NF > widest) widest = NF;
    float *projected = features ? malloc(sizeof(float) * n * E) : NULL;
    if (features) hidden = projected;
    float *x = malloc(sizeof(float) * n * widest), *qkv = malloc(sizeof(float) * n * QKV),
          *a = malloc(sizeof(float) * n * QD), *t1 = malloc(sizeof(float) * n * E),
          *gu = malloc(sizeof(float) * n * 2 * F), *xl = malloc(sizeof(float) * E);
    es_q8_rows q8 = q8_rows_alloc(n, widest);
    const float scale = 1.0f / sqrtf((float)d);
    if (threads < 1) threads = 1;
    const int64_t split = Hkv % threads == 0 || Hkv >= 4 * threads ? 1 : H / Hkv; /* es_forward's */
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t r0 = n * t / nt, r1 = n * (t + 1) / nt;
        float *e = malloc(sizeof(float) * attention_scratch(H, Hkv, L));
#define HEAD_LINEAR(ROWS, Q, K, W, N, Y)                                                    \
        do {                                                                              \
            int64_t j0, j1;                                                               \
            column_share(N, t, nt, &j0, &j1);                                             \
            if (j0 < j1) columns_q8(isa, Q, ROWS, K, W, (int)m->weight_type, N, Y, N, j0, j1); \
        } while (0)
        if (features) {
            es_quantize_rows(features, NF, r0, r1, NF, q8, isa);
#pragma omp barrier
            HEAD_LINEAR(n, q8, NF, m->fc, E, projected);
#pragma omp barrier
        }
        for (int64_t r = r0; r < r1; r++) {
            rms_norm(m->embedding + tokens[r] * E, m->input_norm, E, m->rms_eps, isa,
                     x + r * 2 * E);
            rms_norm(hidden + r * E, m->hidden_norm, E, m->rms_eps, isa, x + r * 2 * E + E);
        }
        es_quantize_rows(x, 2 * E, r0, r1, 2 * E, q8, isa);
#pragma omp barrier
        HEAD_LINEAR(n, q8, 2 * E, m->qkv, QKV, qkv);
#pragma omp barrier
        for (int64_t r = r0; r < r1; r++) {
            float *q = qkv + r * QKV, *k = q + QD, *v = k + KD;
            for (int64_t i = 0; i < d / 2; i++) {
                float angle = (float)(n_past + r) * m->inv_freq[i];
                float c = cosf(angle), s = sinf(angle);
                for (int64_t h = 0; h < H + Hkv; h++) { /* the query's heads, then the key's */
                    float *xh = h < H ? q + h * d : k + (h - H) * d;
                    float a0 = xh[i], b0 = xh[i + d / 2];
                    xh[i] = a0 * c - b0 * s;
                    xh[i + d / 2] = a0 * s + b0 * c;
                }
            }
            __builtin_memcpy(k_cache + (n_past + r) * KD, k, 4 * KD);
            __builtin_memcpy(v_cache + (n_past + r) * KD, v, 4 * KD);
        }
#pragma omp barrier
        for (int64_t item = t; item < Hkv * split; item += nt) {
            int64_t g = item / split, part = item % split;
            int64_t h0 = g * (H / Hkv) + part * (H / Hkv) / split,
                    h1 = g * (H / Hkv) + (part + 1) * (H / Hkv) / split;
            attend_kv_head(qkv, n, H, d, QKV, d, k_cache, v_cache, Hkv, L, d, KD, d, KD, scale,
                           a, QD, d, e, isa, NULL, NULL, g, h0, h1);
        }
#pragma omp barrier
        es_quantize_rows(a, QD, r0, r1, QD, q8, isa);
#pragma omp barrier
        HEAD_LINEAR(n, q8, QD, m->o, E, t1);
#pragma omp barrier
        for (int64_t r = r0; r < r1; r++) {
            for (int64_t c = 0; c < E; c++) out[r * E + c] = hidden[r * E + c] + t1[r * E + c];
            rms_norm(out + r * E, m->post_norm, E, m->rms_eps, isa, x + r * E);
        }
        es_quantize_rows(x, E, r0, r1, E, q8, isa);
#pragma omp barrier
        HEAD_LINEAR(n, q8, E, m->gate_up, 2 * F, gu);
#pragma omp barrier
        for (int64_t r = r0; r < r1; r++)
            silu_mul(gu + r * 2 * F, gu + r * 2 * F + F, x + r * F, F, isa);
        es_quantize_rows(x, F, r0, r1, F, q8, isa);
#pragma omp barrier
        HEAD_LINEAR(n, q8, F, m->down, E, t1);
#pragma omp barrier
        for (int64_t r = r0; r < r1; r++)
            for (int64_t c = 0; c < E; c++) out[r * E + c] += t1[r * E + c];
        if (logits) {
#pragma omp barrier
            if (t == 0) {
                rms_norm(out + (n - 1) * E, m->final_norm, E, m->rms_eps, isa, xl);
                es_quantize_rows(xl, E, 0, 1, E, q8, isa);
            }
#pragma omp barrier
            HEAD_LINEAR(1, q8, E, m->lm_head, m->n_draft_vocab, logits);
        }
#undef HEAD_LINEAR
        free(e);
    }
    q8_rows_free(q8);
    free(x); free(qkv); free(a); free(t1); free(gu); free(xl); free(projected);
}
