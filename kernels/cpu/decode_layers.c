/* A decode step through every decoder layer in one call: the CPU path's counterpart of the CUDA
 * graph a GPU engine replays for its decode batches.
 *
 * A decode step of a small batch is a few hundred small ops (ten a layer). Called one by one
 * from Python, each pays its wrapper (checks, a new output tensor, a ctypes call), and pays it
 * with cold caches: the weights just streamed through them. On a 2-core Xeon an op-by-op step
 * at one row took 58.1 ms at L (24 layers) and 6.72 ms at M (8), fused 48.8 and 4.98 ms
 * (bench/decode_layers.py). Here the same kernels run in the same order on the same buffers
 * from C, so a step gives the same bits as the op-by-op path (tests/engine/test_fused_decode.py).
 *
 * Per layer (Llama/Qwen2/Qwen3 pre-norm): x = rms_norm(h + residual) (layer 0: residual = h),
 * qkv = x Wqkv^T (+ bias), per-head q/k norms where the model has them, rotary on q and k, the
 * new K/V rows into the paged cache, decode attention, h = attn Wo^T, x = rms_norm(h + residual),
 * act = silu(x Wg^T) * (x Wu^T) (one pass where the bf16 weight fuses it), h = act Wd^T.
 * Every linear layer is a blocked weight (kernels/cpu/blocked_linear.c); the caller checks that
 * each runs there at this row count. The final norm and the logits stay with the caller.
 */
#include <stdint.h>
#include <string.h>

/* The kernels this file strings together (compiled into the same object). */
int strata_blocked_linear_f32(const float *x, long M, long K, long x_stride, const uint32_t *w, long N,
                              const float *bias, float *y, long y_stride, int num_threads);
int strata_blocked_linear_bf16(const uint16_t *x, long M, long K, long x_stride, const uint32_t *w, long N,
                               const float *bias, uint16_t *y, long y_stride, int num_threads, int mode);
#define DECLARE_OPS(S, T)                                                                                   \
void strata_rms_norm_##S(const T *x, long x_stride, T *residual, long res_stride, const T *weight, T *out,  \
                         long out_stride, long rows, int hidden, float eps, int num_threads);               \
void strata_rotary_##S(const int64_t *positions, T *q, long q_stride, int q_heads, T *k, long k_stride,    \
                       int k_heads, const float *cos_sin, int head_dim, long tokens, int num_threads);      \
void strata_silu_and_mul_##S(const T *x, T *out, long rows, int d, int num_threads);                       \
int strata_store_kv_##S(const T *k, long k_stride, const T *v, long v_stride, const int64_t *slots, long n,  \
                        T *k_cache, T *v_cache, long num_slots, long row);                                  \
int strata_paged_decode_attention_##S(const T *q, long q_stride, const T *k_cache, const T *v_cache,       \
                                      const int32_t *block_tables, const int32_t *context_lens, T *out,     \
                                      long out_stride, int batch, int num_heads, int num_kv_heads,          \
                                      int head_dim, int block_size, int max_blocks, float scale,            \
                                      int num_threads, const float *k_scales, const float *v_scales);
DECLARE_OPS(f32, float)
DECLARE_OPS(bf16, uint16_t)

#define PLAIN 0
#define GATED_SWIGLU 2 /* blocked_linear.c's modes */

/* One layer's operands (kernels/cpu/decode_layers.py's DECODE_LAYER, field for field). */
typedef struct {
    const void *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm/k_norm [head_dim], or NULL */
    const uint32_t *qkv, *o, *gate_up, *down;             /* blocked words */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* the blocked fp32 biases, or NULL */
    void *k_cache, *v_cache;                              /* [num_slots, kv_heads, head_dim] */
    int64_t num_slots;
    int32_t gate_up_swiglu; /* bf16: the weight fuses silu(gate) * up into its product */
} strata_decode_layer;

/* The step (DECODE_STEP): one token per sequence, `tokens` of them. h holds the embeddings on
 * entry and the last layer's output on return, residual the stream it adds to. Scratch: x
 * [tokens, hidden], qkv [tokens, q + 2 kv], attn [tokens, q], gate_up [tokens, 2 intermediate]
 * (unused where every gate_up fuses its activation), act [tokens, intermediate]. */
typedef struct {
    void *h, *residual, *x, *qkv, *attn, *gate_up, *act;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *context_lens;
    const float *cos_sin;
    int64_t tokens;
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, max_blocks, threads;
    float eps, scale;
} strata_decode_step;

static inline int linear_f32(const float *x, long M, long K, const uint32_t *w, long N, const float *bias,
                             float *y, long y_width, int threads, int mode)
{
    return mode == PLAIN ? strata_blocked_linear_f32(x, M, K, K, w, N, bias, y, y_width, threads) : -3;
}

static inline int linear_bf16(const uint16_t *x, long M, long K, const uint32_t *w, long N, const float *bias,
                              uint16_t *y, long y_width, int threads, int mode)
{
    return strata_blocked_linear_bf16(x, M, K, K, w, N, bias, y, y_width, threads, mode);
}

/* Returns 0; else the failing kernel's code (linear -1/-2/-3: no kernel for this dtype or mode;
 * store -4: a slot outside the cache; attention -5: its own failure) plus -16 times the layer. */
#define DEFINE_DECODE_LAYERS(S, T)                                                                          \
int strata_decode_layers_##S(const strata_decode_layer *layers, int num_layers, const strata_decode_step *s) \
{                                                                                                            \
    const long n = s->tokens, hidden = s->hidden, hd = s->head_dim, inter = s->intermediate;              \
    const long q_width = (long)s->num_heads * hd, kv_width = (long)s->num_kv_heads * hd;                   \
    const long qkv_width = q_width + 2 * kv_width;                                                         \
    const int threads = s->threads;                                                                        \
    const float eps = s->eps;                                                                              \
    T *h = (T *)s->h, *residual = (T *)s->residual, *x = (T *)s->x, *qkv = (T *)s->qkv;                    \
    T *attn = (T *)s->attn, *gate_up = (T *)s->gate_up, *act = (T *)s->act;                                \
    if (n <= 0) return 0;                                                                                  \
    for (int l = 0; l < num_layers; l++) {                                                                 \
        const strata_decode_layer *L = layers + l;                                                         \
        int rc;                                                                                            \
        if (l == 0) {                                                                                      \
            memcpy(residual, h, sizeof(T) * (size_t)(n * hidden));                                         \
            strata_rms_norm_##S(h, hidden, NULL, 0, (const T *)L->input_norm, x, hidden, n, (int)hidden, eps, threads); \
        } else {                                                                                           \
            strata_rms_norm_##S(h, hidden, residual, hidden, (const T *)L->input_norm, x, hidden, n, (int)hidden, eps, threads); \
        }                                                                                                  \
        if ((rc = linear_##S(x, n, hidden, L->qkv, qkv_width, L->qkv_bias, qkv, qkv_width, threads, PLAIN))) \
            return rc - 16 * l;                                                                            \
        T *q = qkv, *k = qkv + q_width, *v = k + kv_width;                                                 \
        if (L->q_norm) /* per-head norms in place, token by token (the heads of a token are rows) */      \
            for (long t = 0; t < n; t++) {                                                                 \
                strata_rms_norm_##S(q + t * qkv_width, hd, NULL, 0, (const T *)L->q_norm, q + t * qkv_width, hd, \
                                    s->num_heads, (int)hd, eps, threads);                                  \
                strata_rms_norm_##S(k + t * qkv_width, hd, NULL, 0, (const T *)L->k_norm, k + t * qkv_width, hd, \
                                    s->num_kv_heads, (int)hd, eps, threads);                               \
            }                                                                                              \
        strata_rotary_##S(s->positions, q, qkv_width, s->num_heads, k, qkv_width, s->num_kv_heads, s->cos_sin, \
                          (int)hd, n, threads);                                                            \
        if (strata_store_kv_##S(k, qkv_width, v, qkv_width, s->slots, n, (T *)L->k_cache, (T *)L->v_cache,   \
                                L->num_slots, kv_width))                                                   \
            return -4 - 16 * l;                                                                            \
        if (strata_paged_decode_attention_##S(q, qkv_width, (const T *)L->k_cache, (const T *)L->v_cache,   \
                                              s->block_tables, s->context_lens, attn, q_width, (int)n,      \
                                              s->num_heads, s->num_kv_heads, (int)hd, s->block_size,        \
                                              s->max_blocks, s->scale, threads, NULL, NULL))                \
            return -5 - 16 * l;                                                                            \
        if ((rc = linear_##S(attn, n, q_width, L->o, hidden, L->o_bias, h, hidden, threads, PLAIN)))         \
            return rc - 16 * l;                                                                            \
        strata_rms_norm_##S(h, hidden, residual, hidden, (const T *)L->post_norm, x, hidden, n, (int)hidden, eps, threads); \
        if (L->gate_up_swiglu) {                                                                           \
            if ((rc = linear_##S(x, n, hidden, L->gate_up, 2 * inter, L->gate_up_bias, act, inter, threads,  \
                                 GATED_SWIGLU)))                                                           \
                return rc - 16 * l;                                                                        \
        } else {                                                                                           \
            if ((rc = linear_##S(x, n, hidden, L->gate_up, 2 * inter, L->gate_up_bias, gate_up, 2 * inter,   \
                                 threads, PLAIN)))                                                         \
                return rc - 16 * l;                                                                        \
            strata_silu_and_mul_##S(gate_up, act, n, (int)inter, threads);                                 \
        }                                                                                                  \
        if ((rc = linear_##S(act, n, inter, L->down, hidden, L->down_bias, h, hidden, threads, PLAIN)))     \
            return rc - 16 * l;                                                                            \
    }                                                                                                      \
    return 0;                                                                                              \
}

DEFINE_DECODE_LAYERS(f32, float)
DEFINE_DECODE_LAYERS(bf16, uint16_t)
