/* C driver loaded by engine/kernels/decode_layers.py: every decoder layer of a decode step in
   one call. float32: through the same C kernels the layer-by-layer path calls (their
   addresses come in `pd_kernels`), in the same order, on the same buffers: the result is
   bit for bit that path's. bfloat16 (`pd_model.bf16`): the AMX GEMM on bfloat16 weights,
   the float32 norm, rotary and gate on float32 activations, a bfloat16 KV cache. What it
   saves is the Python between the kernels. */
#include <stdint.h>
#include <string.h>

typedef struct { /* engine/kernels/csrc/decode_attention.c's argument block */
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    const void* q;
    int64_t q_seq_stride, q_head_stride;
    const void* k_cache;
    const void* v_cache;
    const int64_t* block_tables;
    int64_t table_stride;
    const int64_t* seq_lens;
    int64_t max_seq_len;
    float scale;
    void* out;
} pd_decode_args;

typedef void (*pd_gemm_fn)(int64_t M, int64_t K, int64_t N, const float* x, const float* wp,
                           const float* bias, float* y, int threads);
typedef void (*pd_norm_fn)(int64_t T, int64_t n, const float* x, int64_t ldx,
                           const float* residual, int64_t ldr, const float* weight, float eps,
                           float* out, float* sum_out);
typedef void (*pd_rope_fn)(int64_t T, int64_t H, int64_t D, const float* x, int64_t ldx,
                           const float* cos, const float* sin, float* out);
typedef void (*pd_silu_fn)(int64_t T, int64_t inter, const float* gate_up, int64_t ld,
                           float* out);
typedef int (*pd_attn_fn)(const pd_decode_args* a, int num_threads);
typedef int (*pd_gemm_bf16_fn)(int64_t M, int64_t K, int64_t N, const uint16_t* x, int64_t ldx,
                               const uint16_t* wp, const float* bias, void* y, int64_t ldy,
                               int y_bf16, int threads);
typedef void (*pd_to_bf16_fn)(int64_t n, const float* src, uint16_t* dst);

typedef struct {
    pd_gemm_fn gemm;
    pd_norm_fn norm;
    pd_rope_fn rope;
    pd_silu_fn silu;
    pd_attn_fn attention;
    pd_gemm_bf16_fn gemm_bf16; /* NULL where AMX does not run */
    pd_to_bf16_fn to_bf16;
    pd_attn_fn attention_bf16;
} pd_kernels;

typedef struct { /* one layer's packed weights (biases NULL where none) and KV cache; norms
                    and biases float32 in both modes */
    const float *input_norm, *post_norm;
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    void *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
} pd_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, block_size, bf16;
    float eps, scale;
    const pd_layer* layers;
} pd_model;

typedef struct {
    int64_t num_seqs; /* one token each */
    float* h;         /* [T, hidden]: the embeddings in, the last layer's MLP output out */
    float* residual;  /* [T, hidden]: the residual stream out */
    const float *cos, *sin; /* [T, head_dim] */
    const int64_t* slots;   /* [T] flat cache slot of each new token */
    const int64_t* block_tables;
    int64_t table_stride;
    const int64_t* seq_lens;
    int64_t max_seq_len;
    /* scratch */
    float *x, *qkv, *qk, *attn, *o, *gate_up, *act;
    uint16_t *xb, *qkb, *attnb; /* bf16 only: [T, max(hidden, inter)], [T, H + KVH, D], [T, H * D] */
    int threads;
} pd_step;

/* y[T, N] = x[T, K] @ W (+ bias), x float32: the float32 GEMM, or (bf16) x rounded into
   the step's bfloat16 buffer and the bfloat16 GEMM. Returns 0 or the GEMM's status. */
static int project(const pd_kernels* k, const pd_model* m, const pd_step* s, int64_t K,
                   int64_t N, const float* x, const void* w, const float* bias, float* y) {
    if (!m->bf16) {
        k->gemm(s->num_seqs, K, N, x, w, bias, y, s->threads);
        return 0;
    }
    k->to_bf16(s->num_seqs * K, x, s->xb);
    return k->gemm_bf16(s->num_seqs, K, N, s->xb, K, w, bias, y, N, 0, s->threads);
}

/* The step's new K (rotated, in `qk`) and V (in `qkv`) into the layer's cache, then decode
   attention over it into `attn` (bfloat16: `attnb`, its q and cached K/V rounded). */
static int attend(const pd_kernels* k, const pd_model* m, const pd_step* s, const pd_layer* L) {
    const int64_t T = s->num_seqs, D = m->head_dim, H = m->num_heads, KVH = m->num_kv_heads;
    const int64_t q_size = H * D, kv_size = KVH * D, width = q_size + 2 * kv_size;
    const int64_t heads = H + KVH;
    if (m->bf16) k->to_bf16(T * heads * D, s->qk, s->qkb);
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = s->slots[t];
        const float* v = s->qkv + t * width + q_size + kv_size;
        if (m->bf16) {
            memcpy((uint16_t*)L->k_cache + slot * kv_size, s->qkb + t * heads * D + q_size,
                   (size_t)kv_size * sizeof(uint16_t));
            k->to_bf16(kv_size, v, (uint16_t*)L->v_cache + slot * kv_size);
        } else {
            memcpy((float*)L->k_cache + slot * kv_size, s->qk + t * heads * D + q_size,
                   (size_t)kv_size * sizeof(float));
            memcpy((float*)L->v_cache + slot * kv_size, v, (size_t)kv_size * sizeof(float));
        }
    }
    pd_decode_args a = {T, H, KVH, D, m->block_size,
                        m->bf16 ? (const void*)s->qkb : (const void*)s->qk, heads * D, D,
                        L->k_cache, L->v_cache, s->block_tables, s->table_stride,
                        s->seq_lens, s->max_seq_len, m->scale,
                        m->bf16 ? (void*)s->attnb : (void*)s->attn};
    return (m->bf16 ? k->attention_bf16 : k->attention)(&a, s->threads);
}

/* Returns 0, or a kernel's nonzero status (its scratch could not be had). */
int pd_decode_layers(const pd_kernels* k, const pd_model* m, const pd_step* s) {
    const int64_t T = s->num_seqs, hidden = m->hidden, D = m->head_dim;
    const int64_t H = m->num_heads, KVH = m->num_kv_heads, inter = m->inter;
    const int64_t q_size = H * D, width = q_size + 2 * KVH * D;
    int status;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const pd_layer* L = &m->layers[l];
        /* x, residual = input_layernorm(h, residual); the first layer adds nothing */
        k->norm(T, hidden, s->h, hidden, l == 0 ? NULL : s->residual, hidden, L->input_norm,
                m->eps, s->x, s->residual);
        if ((status = project(k, m, s, hidden, width, s->x, L->qkv, L->qkv_bias, s->qkv)))
            return status;
        k->rope(T, H + KVH, D, s->qkv, width, s->cos, s->sin, s->qk); /* q and k heads */
        if ((status = attend(k, m, s, L))) return status;
        status = 0;
        if (m->bf16) /* attention's output is bfloat16 already: the GEMM reads it as it is */
            status = k->gemm_bf16(T, q_size, hidden, s->attnb, q_size, L->o, L->o_bias, s->o,
                                  hidden, 0, s->threads);
        else
            k->gemm(T, q_size, hidden, s->attn, L->o, L->o_bias, s->o, s->threads);
        if (status) return status;
        k->norm(T, hidden, s->o, hidden, s->residual, hidden, L->post_norm, m->eps, s->x,
                s->residual);
        if ((status = project(k, m, s, hidden, 2 * inter, s->x, L->gate_up, L->gate_up_bias,
                              s->gate_up)))
            return status;
        k->silu(T, inter, s->gate_up, 2 * inter, s->act);
        if ((status = project(k, m, s, inter, hidden, s->act, L->down, L->down_bias, s->h)))
            return status;
    }
    return 0;
}
