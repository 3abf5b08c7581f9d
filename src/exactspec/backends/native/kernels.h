/* exactspec's batch-invariant decode kernels: what their files share (see
 * exactspec/backends/native/__init__.py and docs/design.md, "Batch-invariant kernels that
 * read the weights once" and "The native backend").
 *
 * One file per concern, each section's header giving its exact arithmetic:
 *   kernels.h        this header: the block types, the helpers every file uses (the 8- and
 *                    16-lane sums, the halves), the calls between files
 *   blocks.c         GGUF weight blocks: their bits decoded and dequantised (es_row_bytes)
 *   float_product.c  float32 products over float32 or dequantised block weights (es_linear,
 *                    es_linear_typed; the CPU's path, es_best_isa)
 *   int8_product.c   products with int8 activations over repacked blocks (es_quantize_rows,
 *                    es_repack, es_linear_q8) on AVX-512 VNNI, AVX2 and portable C
 *   attention.c      attention for a block of queries, exp and silu (es_attention)
 *   forward.c        the Llama-family forward pass (es_forward) and the draft head's step
 *                    (es_head_step)
 * exactspec/backends/native/__init__.py compiles each file on its own and links them into one
 * library per version of all of them (their bytes and the flags hashed).
 *
 * The invariant: on one instruction-set path (portable, AVX2, AVX-512), every output element
 * of every kernel is computed by the same arithmetic whatever the number of rows, the other
 * rows, the sequences beside it or the thread split; tiling and threads only choose which
 * elements are computed together. Every rounding is written in the source (intrinsics, or
 * one C operation each), so the files need -ffp-contract=off (no fused multiply-add the
 * source does not ask for) and must not be built with -ffast-math; -O3 keeps the tiles'
 * accumulators in registers, -fopenmp runs the threads.
 *
 * The entry points return nothing, or (es_forward, es_head_step, es_linear_typed,
 * es_attention) 0, or -1 when their scratch memory could not be allocated (nothing written).
 */
#ifndef EXACTSPEC_KERNELS_H
#define EXACTSPEC_KERNELS_H

#ifdef __FAST_MATH__
#error "exactspec's kernels fix every rounding: build them without -ffast-math"
#endif

#include <math.h>
#include <stdint.h>
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define ES_INTERNAL __attribute__((visibility("hidden"))) /* between the files only */

/* ggml's type numbers of the weight types the kernels read */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

/* ---- halves and unaligned reads ---- */

static inline float half_to_float(uint16_t h) {
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

/* float -> IEEE half, rounded to nearest even (subnormal halves included; inf and nan kept),
 * in integer arithmetic: no _Float16 or F16C needed */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    __builtin_memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, e = (x >> 23) & 0xff;
    uint32_t m = x & 0x7fffff;
    if (e == 0xff) return (uint16_t)(sign | 0x7c00 | (m ? 0x200 : 0));
    const int32_t he = (int32_t)e - 112; /* the half's biased exponent */
    if (he >= 31) return (uint16_t)(sign | 0x7c00);
    if (he <= 0) { /* a subnormal half (or zero): the 24-bit significand shifted down */
        if (he < -10) return (uint16_t)sign;
        m |= 0x800000;
        const int shift = 14 - he;
        uint32_t h = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = sign | (uint32_t)he << 10 | m >> 13; /* a carry may round up to inf */
    const uint32_t rest = m & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)h;
}

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    __builtin_memcpy(&v, p, 2);
    return v;
}

/* ---- the 8-lane dot product and the lane sums (float_product.c's header gives the order) ---- */

static inline float dot_portable(const float *x, const float *w, int64_t K) {
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

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l, l+4 */
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                       /* l, l+2 */
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));                                   /* 0 + 1 */
    return _mm_cvtss_f32(q);
}

__attribute__((target("avx512f"))) static inline float hsum16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
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

/* ---- GGUF blocks (blocks.c) ---- */

/* One column's super-block of the file decoded: u[32 S] unsigned integers, sc (Q6_K: 16
 * int8 per 16 weights; Q4_K, Q5_K: 8 6-bit per 32), mn (8 6-bit), the halves d and m (m,
 * or dmin). The bit layouts are ggml's (ggml-common.h). */
typedef struct { uint8_t u[256]; int8_t sc[16]; uint8_t mn[8]; uint16_t d, m; } q8_block;

ES_INTERNAL void decode_block(int type, const uint8_t *p, q8_block *c);
/* out[0..K) = row `row` of w [N, K] of `type`, dequantised (blocks.c; the same floats on
 * every path, so the fastest the CPU runs is used) */
ES_INTERNAL void dequantize_row(int type, const uint8_t *w, int64_t row, int64_t K, float *out);
int64_t es_row_bytes(int type, int64_t K);
/* out = w [N, K] of `type` re-quantised to Q4_0 (blocks.c); 0, or -1 if scratch failed */
int es_quantize_q4_0(const uint8_t *w, int type, int64_t N, int64_t K, uint8_t *out);

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

/* ---- float32 products (float_product.c) ---- */

#define PANEL_COLUMNS 6 /* the widest tile: the floats of scratch a product needs per K */
/* columns j0..j1 of y [rows, N] (row stride ldy) = x @ w^T, w of `type`; panel: PANEL_COLUMNS * K floats */
ES_INTERNAL void columns(int isa, const float *x, int64_t ldx, int64_t rows, int64_t K,
                         const void *w, int type, float *y, int64_t ldy, int64_t j0, int64_t j1,
                         float *panel);
/* thread t of n's share [j0, j1) of N output columns: whole blocks of 48 */
ES_INTERNAL void column_share(int64_t N, int t, int n, int64_t *j0, int64_t *j1);
int es_best_isa(void);

/* ---- int8 products (int8_product.c) ---- */

/* rows quantised per block of 32: int8 values, scales, sums, sums of each block's first 16 */
typedef struct { int8_t *xq; float *dx; int32_t *sx; float *dxs; int32_t *sxa; } es_q8_rows;
/* room for n rows of K inputs (a multiple of 32), or all null if an allocation failed */
ES_INTERNAL es_q8_rows q8_rows_alloc(int64_t n, int64_t K);
ES_INTERNAL void q8_rows_free(es_q8_rows q);
void es_quantize_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, int64_t K,
                      es_q8_rows q, int isa);
/* columns j0..j1 (j0 a multiple of 16) of every row of the int8 product */
ES_INTERNAL void columns_q8(int isa, es_q8_rows q, int64_t rows, int64_t K,
                            const uint8_t *packed, int type, int64_t N, float *y, int64_t ldy,
                            int64_t j0, int64_t j1);

/* ---- attention, exp and silu (attention.c) ---- */

/* floats of scratch attend_kv_head needs per thread */
ES_INTERNAL int64_t attention_scratch(int64_t H, int64_t Hkv, int64_t L);
ES_INTERNAL void attend_kv_head(const float *q, int64_t nq, int64_t H, int64_t d, int64_t sq,
                                int64_t sh, const float *k, const float *v, int64_t Hkv,
                                int64_t L, int64_t skh, int64_t skj, int64_t svh, int64_t svj,
                                float scale, float *out, int64_t so, int64_t soh, float *e,
                                int isa, const int64_t *tree_rows, const int64_t *tree_offsets,
                                int64_t g, int64_t h0, int64_t h1);
/* x[i] = silu(g[i]) * u[i], i < n */
ES_INTERNAL void silu_mul(const float *g, const float *u, float *x, int64_t n, int isa);

#endif
