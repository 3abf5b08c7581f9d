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

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_BF16 = 30 };

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

/* Bytes of one row of K weights of `type`, or 0 for a type or K these kernels do not take. */
int64_t es_row_bytes(int type, int64_t K) {
    switch (type) {
    case T_F32: return 4 * K;
    case T_F16: case T_BF16: return 2 * K;
    case T_Q8_0: return K % 32 ? 0 : K / 32 * 34;
    case T_Q4_0: return K % 32 ? 0 : K / 32 * 18;
    case T_Q4_1: return K % 32 ? 0 : K / 32 * 20;
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
 * For Q4_0, Q4_1 and Q8_0 weights es_forward multiplies as llama.cpp's CPU backend does:
 * each row of x is quantised per block of 32 inputs with a scale of its own (so a row's
 * bits never depend on another row), then exact integer dot products per block, scaled
 * in float (docs/design.md, "The native backend: int8 activations"):
 *
 *   es_quantize_rows, per row r and block b:
 *     a = max_k |x[r, k]| (exact);  dx = a / 127 (IEEE division);  inv = dx != 0 ? 1 / dx : 0
 *     xq[k] = x[r, k] * inv rounded to the nearest integer, ties to even (in [-127, 127])
 *     sx = sum_k xq[k] (exact);  dxs = dx * (float)sx (rounded once)
 *   es_linear_q8, per output j, over the blocks b in order (acc = 0 first):
 *     Q4_0:  i = sum_k q[j, k] xq[k] - 8 sx (exact);  acc = fma((float)i, d[j, b] * dx, acc)
 *     Q4_1:  i = sum_k q[j, k] xq[k];  acc = fma((float)i, d * dx, acc);  acc = fma(m[j, b], dxs, acc)
 *     Q8_0:  i = sum_k q[j, k] xq[k];  acc = fma((float)i, d * dx, acc)
 *     y[r, j] = acc                      (d * dx: one float product, rounded once)
 *
 * The integers are exact and each output's floats are that one sequence on every path
 * (vector lanes hold output columns, never parts of one sum), so AVX-512 VNNI, AVX2 and
 * portable C give the same bits, whatever the rows, the other rows or the threads (which
 * split the columns in blocks of 48).
 *
 * es_repack reorders a matrix's blocks once, at load, per 16 output columns and block of
 * 32 weights (the file's bytes, reordered: one 64-byte vector then holds 4 consecutive
 * weights of each of the 16 columns, which VNNI's dpbusd multiplies by 4 inputs at once):
 *   Q4_0, Q4_1: 256 bytes, byte 64p + 4j + i = q[j, 4p + i] | q[j, 16 + 4p + i] << 4
 *               (p < 4), then the 16 columns' d as halves, then (Q4_1) their m
 *   Q8_0:       512 bytes, byte 64p + 4j + i = q[j, 4p + i] + 128 (p < 8), then the d
 * Columns past N (up to a multiple of 16) are zero and never stored.
 */

/* Bytes per 16 columns and block of 32, or 0 for a type without an int8 path. */
static int64_t q8_group_block_bytes(int type) {
    return type == T_Q4_0 ? 288 : type == T_Q4_1 ? 320 : type == T_Q8_0 ? 544 : 0;
}

int64_t es_repacked_bytes(int type, int64_t N, int64_t K) {
    if (K % 32 || !q8_group_block_bytes(type)) return 0;
    return (N + 15) / 16 * (K / 32) * q8_group_block_bytes(type);
}

void es_repack(const uint8_t *w, int type, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / 32, row_bytes = es_row_bytes(type, K),
                  gb = q8_group_block_bytes(type), quads = type == T_Q8_0 ? 512 : 256;
    for (int64_t g = 0; g < (N + 15) / 16; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * gb;
            __builtin_memset(o, 0, gb);
            for (int64_t j = 0; j < 16 && g * 16 + j < N; j++) {
                const uint8_t *blk = w + (g * 16 + j) * row_bytes + b * (row_bytes / nb);
                __builtin_memcpy(o + quads + 2 * j, blk, 2);                    /* d */
                if (type == T_Q4_1) __builtin_memcpy(o + quads + 32 + 2 * j, blk + 2, 2);
                if (type == T_Q8_0) {
                    for (int k = 0; k < 32; k++)
                        o[64 * (k / 4) + 4 * j + k % 4] = (uint8_t)((int8_t)blk[2 + k] + 128);
                } else {
                    const uint8_t *nib = blk + (type == T_Q4_1 ? 4 : 2);
                    for (int k = 0; k < 16; k++)  /* q[k] low nibble, q[16 + k] high */
                        o[64 * (k / 4) + 4 * j + k % 4] = nib[k];
                }
            }
        }
}

/* Row r's block b: xq[r * K + 32 b ..], and per block dx, sx, dxs at [r * (K / 32) + b]. */
typedef struct { int8_t *xq; float *dx; int32_t *sx; float *dxs; } es_q8_rows;

static void quantize_row_portable(const float *x, int64_t K, int8_t *xq, float *dx,
                                  int32_t *sx, float *dxs) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float a = 0.0f;
        for (int k = 0; k < 32; k++) a = fmaxf(a, fabsf(xb[k]));
        float d = a / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0;
        for (int k = 0; k < 32; k++) {
            int v = (int)nearbyintf(xb[k] * inv);
            xq[32 * b + k] = (int8_t)v;
            s += v;
        }
        dx[b] = d, sx[b] = s, dxs[b] = d * (float)s;
    }
}

/* The same numbers with AVX-512 (max, division, product and the conversion's rounding to
 * nearest even are the same IEEE operations). */
__attribute__((target("avx512f,avx512bw,avx512dq")))
static void quantize_row_avx512(const float *x, int64_t K, int8_t *xq, float *dx,
                                int32_t *sx, float *dxs) {
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
        int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
        dx[b] = d, sx[b] = s, dxs[b] = d * (float)s;
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
    for (int64_t r = r0; r < r1; r++)
        (isa == 2 && has_avx512_quantize ? quantize_row_avx512 : quantize_row_portable)(
            x + r * ldx, K, q.xq + r * K, q.dx + r * (K / 32), q.sx + r * (K / 32),
            q.dxs + r * (K / 32));
}

/* The float steps of one block for one output lane (portable; the vector paths do the same
 * per lane). */
static inline float q8_step(int type, int32_t i, int32_t sx, float d, float m, float dx,
                            float dxs, float acc) {
    if (type == T_Q4_0) i -= 8 * sx;
    if (type == T_Q8_0) i -= 128 * sx; /* the repacked bytes are q + 128 */
    acc = fmaf((float)i, d * dx, acc);
    if (type == T_Q4_1) acc = fmaf(m, dxs, acc);
    return acc;
}

static void q8_group_portable(int type, es_q8_rows q, int64_t rows, int64_t K,
                              const uint8_t *wg, int64_t columns, float *y, int64_t ldy) {
    const int64_t nb = K / 32, gb = q8_group_block_bytes(type);
    const int quads = type == T_Q8_0 ? 512 : 256;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < columns; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *o = wg + b * gb;
                const int8_t *xb = q.xq + r * K + 32 * b;
                int32_t i = 0;
                for (int k = 0; k < 32; k++) {
                    int w = type == T_Q8_0 ? o[64 * (k / 4) + 4 * j + k % 4]
                            : k < 16 ? o[64 * (k / 4) + 4 * j + k % 4] & 15
                                     : o[64 * ((k - 16) / 4) + 4 * j + k % 4] >> 4;
                    i += w * xb[k];
                }
                float m = type == T_Q4_1 ? half_to_float(read_u16(o + quads + 32 + 2 * j)) : 0.0f;
                int64_t at = r * nb + b;
                acc = q8_step(type, i, q.sx[at], half_to_float(read_u16(o + quads + 2 * j)), m,
                              q.dx[at], q.dxs[at], acc);
            }
            y[r * ldy + j] = acc;
        }
}

/* AVX2: 8 columns a vector (half a group), dpbusd emulated by maddubs and madd (exact:
 * |products| stay within 16 bits; Q8_0 multiplies |q| by x with q's sign). */
__attribute__((target("avx2,fma,f16c")))
static void q8_group_avx2(int type, es_q8_rows q, int64_t rows, int64_t K,
                          const uint8_t *wg, int64_t columns, float *y, int64_t ldy) {
    const int64_t nb = K / 32, gb = q8_group_block_bytes(type);
    const int quads = type == T_Q8_0 ? 512 : 256;
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1),
                  flip = _mm256_set1_epi8((char)0x80);
    for (int half = 0; half < 2 && 8 * half < columns; half++) {
        const int64_t c0 = 8 * half;
        for (int64_t r = 0; r < rows; r++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *o = wg + b * gb;
                const int32_t *x4 = (const int32_t *)(q.xq + r * K + 32 * b);
                __m256i s = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) {
                    __m256i w, xb = _mm256_set1_epi32(x4[p]), prod;
                    if (type == T_Q8_0) {
                        __m256i sw = _mm256_xor_si256(
                            _mm256_loadu_si256((const __m256i *)(o + 64 * p + 32 * half)), flip);
                        prod = _mm256_maddubs_epi16(_mm256_abs_epi8(sw), _mm256_sign_epi8(xb, sw));
                    } else {
                        __m256i v = _mm256_loadu_si256((const __m256i *)(o + 64 * (p % 4) + 32 * half));
                        w = p < 4 ? _mm256_and_si256(v, low4)
                                  : _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                        prod = _mm256_maddubs_epi16(w, xb);
                    }
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(prod, ones));
                }
                const int64_t at = r * nb + b;
                /* the Q8_0 sum above is already sum q xq (signed q): no -128 sx */
                if (type == T_Q4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * q.sx[at]));
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + quads + 16 * half)));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                      _mm256_mul_ps(d, _mm256_set1_ps(q.dx[at])), acc);
                if (type == T_Q4_1) {
                    __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + quads + 32 + 16 * half)));
                    acc = _mm256_fmadd_ps(m, _mm256_set1_ps(q.dxs[at]), acc);
                }
            }
            if (columns >= c0 + 8) _mm256_storeu_ps(y + r * ldy + c0, acc);
            else {
                float lanes[8];
                _mm256_storeu_ps(lanes, acc);
                for (int64_t c = c0; c < columns; c++) y[r * ldy + c] = lanes[c - c0];
            }
        }
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
/* AVX-512 VNNI: 16 columns a vector, R rows a tile (the group's unpacked weights serve
 * every row); two dpbusd chains per row. */
#define Q8_VNNI_TILE(R)                                                                    \
    __attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) static void q8_vnni_##R(   \
        int type, es_q8_rows q, int64_t K, const uint8_t *wg, int64_t columns, float *y,   \
        int64_t ldy) {                                                                     \
        const int64_t nb = K / 32, gb = q8_group_block_bytes(type);                        \
        const int quads = type == T_Q8_0 ? 512 : 256;                                       \
        const __m512i low4 = _mm512_set1_epi8(15);                                         \
        __m512 acc[R];                                                                     \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                          \
        for (int64_t b = 0; b < nb; b++) {                                                 \
            const uint8_t *o = wg + b * gb;                                                \
            for (int64_t l = 0; l < gb; l += 64)                                           \
                _mm_prefetch((const char *)(o + Q8_PREFETCH * gb + l), _MM_HINT_T0);      \
            __m512i w[8];                                                                  \
            if (type == T_Q8_0)                                                            \
                for (int p = 0; p < 8; p++) w[p] = _mm512_loadu_si512((const void *)(o + 64 * p)); \
            else                                                                           \
                for (int p = 0; p < 4; p++) {                                              \
                    __m512i v = _mm512_loadu_si512((const void *)(o + 64 * p));            \
                    w[p] = _mm512_and_si512(v, low4);                                      \
                    w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);            \
                }                                                                          \
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + quads)));  \
            __m512 m = type == T_Q4_1                                                      \
                ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + quads + 32)))   \
                : _mm512_setzero_ps();                                                     \
            for (int r = 0; r < R; r++) {                                                  \
                const int32_t *x4 = (const int32_t *)(q.xq + r * K + 32 * b);              \
                const int64_t at = r * nb + b;                                             \
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();          \
                for (int p = 0; p < 8; p += 2) {                                           \
                    s0 = _mm512_dpbusd_epi32(s0, w[p], _mm512_set1_epi32(x4[p]));          \
                    s1 = _mm512_dpbusd_epi32(s1, w[p + 1], _mm512_set1_epi32(x4[p + 1]));  \
                }                                                                          \
                __m512i s = _mm512_add_epi32(s0, s1);                                      \
                if (type != T_Q4_1)                                                        \
                    s = _mm512_sub_epi32(s, _mm512_set1_epi32((type == T_Q8_0 ? 128 : 8) * q.sx[at])); \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),                            \
                                         _mm512_mul_ps(d, _mm512_set1_ps(q.dx[at])), acc[r]); \
                if (type == T_Q4_1)                                                        \
                    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(q.dxs[at]), acc[r]);        \
            }                                                                              \
        }                                                                                  \
        const __mmask16 keep = columns >= 16 ? 0xffff : (__mmask16)((1u << columns) - 1);  \
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);      \
    }
Q8_VNNI_TILE(1) Q8_VNNI_TILE(2) Q8_VNNI_TILE(3) Q8_VNNI_TILE(4)
Q8_VNNI_TILE(5) Q8_VNNI_TILE(6) Q8_VNNI_TILE(7) Q8_VNNI_TILE(8)
Q8_VNNI_TILE(9) Q8_VNNI_TILE(10) Q8_VNNI_TILE(11) Q8_VNNI_TILE(12)
Q8_VNNI_TILE(13) Q8_VNNI_TILE(14) Q8_VNNI_TILE(15) Q8_VNNI_TILE(16)
#define Q8_TILE_ROWS 16 /* the most rows one tile takes */
typedef void (*q8_tile_fn)(int, es_q8_rows, int64_t, const uint8_t *, int64_t, float *, int64_t);
static const q8_tile_fn q8_vnni_tiles[Q8_TILE_ROWS + 1] = {
    0, q8_vnni_1, q8_vnni_2, q8_vnni_3, q8_vnni_4, q8_vnni_5, q8_vnni_6, q8_vnni_7, q8_vnni_8,
    q8_vnni_9, q8_vnni_10, q8_vnni_11, q8_vnni_12, q8_vnni_13, q8_vnni_14, q8_vnni_15,
    q8_vnni_16};

/* Columns j0..j1 (j0 a multiple of 16) of every row. */
static void columns_q8(int isa, es_q8_rows q, int64_t rows, int64_t K, const uint8_t *packed,
                       int type, int64_t N, float *y, int64_t ldy, int64_t j0, int64_t j1) {
    cpu_features();
    const int64_t group_bytes = K / 32 * q8_group_block_bytes(type);
    for (int64_t j = j0; j < j1; j += 16) {
        const uint8_t *wg = packed + j / 16 * group_bytes;
        const int64_t columns = MIN(16, MIN(j1, N) - j);
        for (int64_t r = 0; r < rows; r += Q8_TILE_ROWS) {
            const int64_t R = MIN(Q8_TILE_ROWS, rows - r);
            es_q8_rows qr = {q.xq + r * K, q.dx + r * (K / 32), q.sx + r * (K / 32),
                             q.dxs + r * (K / 32)};
            if (isa == 2 && has_vnni) q8_vnni_tiles[R](type, qr, K, wg, columns, y + r * ldy + j, ldy);
            else if (isa >= 1) q8_group_avx2(type, qr, R, K, wg, columns, y + r * ldy + j, ldy);
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
    es_q8_rows q8 = {malloc(n * max_Kq), malloc(sizeof(float) * n * (max_Kq / 32 + 1)),
                     malloc(sizeof(int32_t) * n * (max_Kq / 32 + 1)),
                     malloc(sizeof(float) * n * (max_Kq / 32 + 1))};
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
    free(q8.xq); free(q8.dx); free(q8.sx); free(q8.dxs);
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
    es_q8_rows q8 = {malloc(n * widest), malloc(sizeof(float) * n * (widest / 32 + 1)),
                     malloc(sizeof(int32_t) * n * (widest / 32 + 1)),
                     malloc(sizeof(float) * n * (widest / 32 + 1))};
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
    free(q8.xq); free(q8.dx); free(q8.sx); free(q8.dxs);
    free(x); free(qkv); free(a); free(t1); free(gu); free(xl); free(projected);
}
