/* ---- weights in their GGUF block formats ----
 *
 * A weight matrix w [N, K] is kept as the GGUF file stores it (memory-mapped, never copied):
 * row j is K / B blocks of B weights each, types by ggml's numbers, the bit layouts ggml's
 * (ggml-common.h; decode_block below turns one block into unsigned integers u, no rounding):
 *
 *     F32  (0)   B = 1    the float itself
 *     F16  (1)   B = 1    IEEE half -> float: exact
 *     BF16 (30)  B = 1    bfloat16 -> float (the 16 bits shifted up): exact
 *     Q8_0 (8)   B = 32   half d, int8 q[32]:           w = (float)q * d                exact
 *     Q4_0 (2)   B = 32   half d, 16 bytes of nibbles:  w = (float)(u - 8) * d          exact
 *     Q4_1 (3)   B = 32   half d, half m, 16 bytes:     w = (float)u * d + m            one rounding
 *     Q5_0 (6)   B = 32   half d, 4 bytes of fifth bits, 16 bytes:
 *                                                       w = (float)(u - 16) * d         exact
 *     Q5_1 (7)   B = 32   half d, half m, as Q5_0:      w = (float)u * d + m            one rounding
 *     Q4_K (12)  B = 256  half d, half dmin, 12 bytes of 6-bit sc[8] and mn[8] (one each per
 *                         32), 128 bytes of nibbles:    w = (d * (float)sc) * (float)u
 *                                                           - dmin * (float)mn          one rounding
 *     Q5_K (13)  B = 256  as Q4_K with 32 bytes of fifth bits
 *     Q6_K (14)  B = 256  128 bytes of low nibbles, 64 of high 2 bits, int8 sc[16] (one per
 *                         16), half d:              w = (d * (float)sc) * (float)(u - 32)   exact
 *
 * (Q4 weight i < 16 of a block of 32 is byte i's low nibble, weight i + 16 its high one.)
 * Each product is of a half's 11-bit significand and small integers: d * sc has at most
 * 11 + 7 bits and its product with u (or u - 32) at most 23, within float32's 24, so it is
 * exact, and only the addition of m (Q4_1, Q5_1) or the subtraction of dmin * mn (itself
 * exact; Q4_K, Q5_K) rounds, once, to nearest even: the same floats as ggml's reference
 * dequantisation and gguf-py's. Dequantising is thus the same on every instruction-set path.
 */

#include "kernels.h"


static void k_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) *sc = q[j] & 63, *mn = q[j + 4] & 63;
    else *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4), *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
}

void decode_block(int type, const uint8_t *p, q8_block *c) {
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

void dequantize_row(int type, const uint8_t *w, int64_t row, int64_t K, float *out) {
    if (dequantize_isa < 0) {
        __builtin_cpu_init();
        dequantize_isa = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c") ? 2
                         : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 1 : 0;
    }
    if (dequantize_isa == 2) dequantize_row_avx512(type, w, row, K, out);
    else if (dequantize_isa == 1) dequantize_row_avx2(type, w, row, K, out);
    else dequantize_row_portable(type, w, row, K, out);
}


/* ---- re-quantising to Q4_0 (a cheaper draft model) ----
 *
 * Each row of w [N, K] of `type` is dequantised (above: exact, or the one rounding stated),
 * then each block of 32 floats x_0..x_31 becomes one Q4_0 block:
 *
 *     a   = the x_i of largest |x_i| (the first of equals), sign kept
 *     d   = half(a / -8)                      (float division, then round to nearest even;
 *                                              |d| clamped to the largest finite half)
 *     u_i = clamp(floor(x_i / float(d) + 8.5), 0, 15)     (u_i = 8 where d = 0)
 *
 * so that a maps to u = 0 and w_i = (u_i - 8) * d as Q4_0 reads it (the scheme of ggml's
 * reference quantiser, dividing by the stored half rather than the float). The result
 * depends on nothing but the block's 32 floats, so it is the same on every path and thread
 * split. Its fidelity is the draft's business only: a draft drafts from the q it computes
 * with these weights, so exactness never depends on them.
 */
int es_quantize_q4_0(const uint8_t *w, int type, int64_t N, int64_t K, uint8_t *out) {
    const int64_t out_bytes = es_row_bytes(T_Q4_0, K);
    int failed = 0;
#pragma omp parallel
    {
        float *x = malloc(sizeof(float) * (size_t)K);
        if (!x) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < N; row++) {
            if (!x) continue;
            dequantize_row(type, w, row, K, x);
            uint8_t *o = out + row * out_bytes;
            for (int64_t b = 0; b < K / 32; b++, o += 18) {
                const float *xb = x + 32 * b;
                float a = 0.0f;
                for (int i = 0; i < 32; i++)
                    if (__builtin_fabsf(xb[i]) > __builtin_fabsf(a)) a = xb[i];
                float d = a / -8.0f;
                if (d > 65504.0f) d = 65504.0f;
                if (d < -65504.0f) d = -65504.0f;
                const uint16_t bits = float_to_half(d);
                __builtin_memcpy(o, &bits, 2);
                const float dh = half_to_float(bits);
                for (int i = 0; i < 16; i++) {
                    int lo = 8, hi = 8;
                    if (dh != 0.0f) {
                        lo = (int)__builtin_floorf(xb[i] / dh + 8.5f);
                        hi = (int)__builtin_floorf(xb[i + 16] / dh + 8.5f);
                        lo = lo < 0 ? 0 : lo > 15 ? 15 : lo;
                        hi = hi < 0 ? 0 : hi > 15 ? 15 : hi;
                    }
                    o[2 + i] = (uint8_t)(lo | hi << 4);
                }
            }
        }
        free(x);
    }
    return failed ? -1 : 0;
}
