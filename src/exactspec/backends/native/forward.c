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

#include "kernels.h"


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
int es_forward(const es_model *m, const es_segment *segs, int64_t n_segs,
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
    if (seg_start) {
        seg_start[0] = 0;
        for (int64_t s = 0; s < n_segs; s++) seg_start[s + 1] = seg_start[s] + segs[s].n_tokens;
    }
    if (threads < 1) threads = 1;
    /* each thread's scratch: a product's panel, then attention's */
    const int64_t per_thread = PANEL_COLUMNS * max_K + attention_scratch(H, Hkv, max_L);
    float *h = malloc(sizeof(float) * n * E), *x = malloc(sizeof(float) * n * max_K),
          *q = malloc(sizeof(float) * n * QD), *k = malloc(sizeof(float) * n * KD),
          *v = malloc(sizeof(float) * n * KD), *a = malloc(sizeof(float) * n * QD),
          *t1 = malloc(sizeof(float) * n * E), *g = malloc(sizeof(float) * n * F),
          *u = malloc(sizeof(float) * n * F), *cs = malloc(sizeof(float) * n * (n_rot + 1)),
          *xl = malloc(sizeof(float) * (n_logits ? n_logits : 1) * E),
          *scratch = malloc(sizeof(float) * threads * per_thread);
    const int64_t max_Kq = max_K > QD ? max_K : QD; /* the widest input of a product */
    es_q8_rows q8 = q8_rows_alloc(n, max_Kq);
    int status = seg_start && h && x && q && k && v && a && t1 && g && u && cs && xl && scratch
                 && q8.xq ? 0 : -1;
    if (status) goto done;
    const float scale = 1.0f / sqrtf((float)d);
    /* attention items per kv head: whole kv heads where they share out evenly among the
     * threads, else each head on its own (3 kv heads on 2 threads would leave one idle a
     * third of the time) */
    const int64_t kv_items = n_segs * Hkv,
                  split = kv_items % threads == 0 || kv_items >= 4 * threads ? 1 : H / Hkv;

#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t r0 = n * t / nt, r1 = n * (t + 1) / nt;
        float *panel = scratch + t * per_thread, *e = panel + PANEL_COLUMNS * max_K;
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
#undef LINEAR
#undef QUANTIZE
    }
done:
    q8_rows_free(q8);
    free(seg_start); free(h); free(x); free(q); free(k); free(v); free(a); free(t1);
    free(g); free(u); free(cs); free(xl); free(scratch);
    return status;
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

int es_head_step(const es_head *m, float *k_cache, float *v_cache, int64_t n_past,
                 int64_t n, const float *hidden, const float *features,
                 const int64_t *tokens, float *out, float *logits, int threads, int isa) {
    const int64_t E = m->n_embd, H = m->n_head, Hkv = m->n_head_kv, d = m->head_dim,
                  F = m->n_ff, QD = H * d, KD = Hkv * d, QKV = QD + 2 * KD, L = n_past + n,
                  NF = m->n_features;
    int64_t widest = 2 * F > 2 * E ? 2 * F : 2 * E;
    if (features && NF > widest) widest = NF;
    float *projected = features ? malloc(sizeof(float) * n * E) : NULL;
    if (features) hidden = projected;
    if (threads < 1) threads = 1;
    const int64_t per_thread = attention_scratch(H, Hkv, L);
    float *x = malloc(sizeof(float) * n * widest), *qkv = malloc(sizeof(float) * n * QKV),
          *a = malloc(sizeof(float) * n * QD), *t1 = malloc(sizeof(float) * n * E),
          *gu = malloc(sizeof(float) * n * 2 * F), *xl = malloc(sizeof(float) * E),
          *scratch = malloc(sizeof(float) * threads * per_thread);
    es_q8_rows q8 = q8_rows_alloc(n, widest);
    int status = x && qkv && a && t1 && gu && xl && scratch && q8.xq
                 && (projected || !features) ? 0 : -1;
    if (status) goto done;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t split = Hkv % threads == 0 || Hkv >= 4 * threads ? 1 : H / Hkv; /* es_forward's */
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t r0 = n * t / nt, r1 = n * (t + 1) / nt;
        float *e = scratch + t * per_thread;
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
    }
done:
    q8_rows_free(q8);
    free(x); free(qkv); free(a); free(t1); free(gu); free(xl); free(projected); free(scratch);
    return status;
}
