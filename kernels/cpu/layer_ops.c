/* The decoder layer's element-wise ops for the CPU path, fp32 and bf16, one pass each.
 *
 * In plain torch, a bf16 RMSNorm with its residual add is seven passes (and a rotary embedding
 * nine) over the activations, each allocating its result; these do one pass in place or into
 * one output, parallel over rows. Arithmetic is fp32, rounded to the model dtype where the torch
 * path (services.engine.backends.TorchOps) rounds: the residual sum, the normalized row before
 * the weight multiplies it, silu before the product.
 */
#include <math.h>
#include <stdint.h>

#include "strata_math.h"


static inline float round_f32(float f) { return f; }
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])
#define STORE_F32(p, i, v) ((p)[i] = (v))
#define STORE_BF16(p, i, v) ((p)[i] = f32_to_bf16(v))

/* Fewer elements than this run on one thread: waking a second one costs more than it saves. */
#define PARALLEL_MIN 65536

/* RMSNorm over rows of `hidden` (row strides in elements). With a residual (may be NULL):
 * residual = x + residual first, and the norm reads that sum (vLLM's fused_add_rms_norm).
 * out = weight * round(x * rsqrt(mean(x^2) + eps)). `out` may alias `x`. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                               \
void NAME(const T *x, long x_stride, T *residual, long res_stride, const T *weight, T *out,      \
          long out_stride, long rows, int hidden, float eps, int num_threads)                      \
{                                                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * hidden >= PARALLEL_MIN)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *xr = x + r * x_stride;                                                            \
        T *orow = out + r * out_stride;                                                            \
        float sum = 0.f;                                                                           \
        if (residual) {                                                                            \
            T *rr = residual + r * res_stride;                                                     \
            for (int i = 0; i < hidden; i++) {                                                     \
                float v = ROUND(LOAD(xr, i) + LOAD(rr, i));                                        \
                STORE(rr, i, v);                                                                   \
                sum += v * v;                                                                      \
            }                                                                                      \
            xr = rr;                                                                               \
        } else {                                                                                   \
            _Pragma("omp simd reduction(+:sum)")                                                   \
            for (int i = 0; i < hidden; i++) { float v = LOAD(xr, i); sum += v * v; }              \
        }                                                                                          \
        const float inv = 1.f / sqrtf(sum / (float)hidden + eps);                                  \
        for (int i = 0; i < hidden; i++) STORE(orow, i, LOAD(weight, i) * ROUND(LOAD(xr, i) * inv)); \
    }                                                                                              \
}

DEFINE_RMS_NORM(strata_rms_norm_f32, float, LOAD_F32, STORE_F32, round_f32)
DEFINE_RMS_NORM(strata_rms_norm_bf16, uint16_t, LOAD_BF16, STORE_BF16, round_bf16)

/* NeoX-style rotary embedding in place (Hugging Face's rotate_half): for each token t and head,
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin from row positions[t] of the
 * fp32 table [max_position, head_dim] (cos in the first half, sin in the second). q and k are
 * [tokens, heads, head_dim] with token strides in elements (views into the fused qkv output). */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE)                                                        \
void NAME(const int64_t *positions, T *q, long q_stride, int q_heads, T *k, long k_stride,       \
          int k_heads, const float *cos_sin, int head_dim, long tokens, int num_threads)           \
{                                                                                                   \
    const int half = head_dim / 2;                                                                 \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(tokens * (q_heads + k_heads) * head_dim >= PARALLEL_MIN)") \
    for (long t = 0; t < tokens; t++) {                                                            \
        const float *cs = cos_sin + positions[t] * head_dim;                                       \
        for (int h = 0; h < q_heads + k_heads; h++) {                                              \
            T *x = h < q_heads ? q + t * q_stride + (long)h * head_dim                             \
                               : k + t * k_stride + (long)(h - q_heads) * head_dim;                \
            for (int i = 0; i < half; i++) {                                                       \
                const float x1 = LOAD(x, i), x2 = LOAD(x, i + half), c = cs[i], s = cs[half + i]; \
                STORE(x, i, x1 * c - x2 * s);                                                      \
                STORE(x, i + half, x2 * c + x1 * s);                                               \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_ROTARY(strata_rotary_f32, float, LOAD_F32, STORE_F32)
DEFINE_ROTARY(strata_rotary_bf16, uint16_t, LOAD_BF16, STORE_BF16)

/* out[r, i] = silu(x[r, i]) * x[r, d + i] (SwiGLU on the fused gate/up projection): x [rows, 2d]
 * contiguous, out [rows, d]. silu is rounded to the model dtype before the product, as torch's
 * F.silu(gate) * up rounds it. */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                                           \
void NAME(const T *x, T *out, long rows, int d, int num_threads)                                  \
{                                                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * d >= PARALLEL_MIN)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *g = x + r * 2L * d, *u = g + d;                                                   \
        T *o = out + r * (long)d;                                                                  \
        _Pragma("omp simd")                                                                        \
        for (int i = 0; i < d; i++) {                                                              \
            const float a = LOAD(g, i);                                                            \
            STORE(o, i, ROUND(a / (1.f + strata_expf(-a))) * LOAD(u, i));                          \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_SILU_AND_MUL(strata_silu_and_mul_f32, float, LOAD_F32, STORE_F32, round_f32)
DEFINE_SILU_AND_MUL(strata_silu_and_mul_bf16, uint16_t, LOAD_BF16, STORE_BF16, round_bf16)
