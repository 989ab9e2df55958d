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


/* bf16 rows with AVX-512: sixteen values per instruction, the same roundings as the plain loops
 * below (the conversions written out: gcc's vectorization of the plain loops runs 5-10x slower).
 * Each returns 0 where it does not take the row (a width not a multiple of 16), and the plain
 * loop runs. */
#if defined(__AVX512F__)
#include <immintrin.h>

static int rms_norm_row_bf16(const uint16_t *x, uint16_t *res, const uint16_t *w, uint16_t *out, int hidden, float eps) {
    if (hidden % 16) return 0;
    __m512 acc = _mm512_setzero_ps();
    const uint16_t *src = x;
    if (res) {
        for (int i = 0; i < hidden; i += 16) {
            const __m256i sum = bf16x16_narrow(_mm512_add_ps(bf16x16_load(x + i), bf16x16_load(res + i)));
            _mm256_storeu_si256((__m256i *)(res + i), sum);
            const __m512 v = bf16x16_widen(sum);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        src = res;
    } else {
        for (int i = 0; i < hidden; i += 16) {
            const __m512 v = bf16x16_load(x + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)hidden + eps));
    for (int i = 0; i < hidden; i += 16)
        bf16x16_store(out + i, _mm512_mul_ps(bf16x16_load(w + i), bf16x16_round(_mm512_mul_ps(bf16x16_load(src + i), inv))));
    return 1;
}

static int rotary_head_bf16(uint16_t *x, const float *cs, int head_dim) {
    const int half = head_dim / 2;
    if (half % 16) return 0;
    for (int i = 0; i < half; i += 16) {
        const __m512 x1 = bf16x16_load(x + i), x2 = bf16x16_load(x + half + i);
        const __m512 c = _mm512_loadu_ps(cs + i), s = _mm512_loadu_ps(cs + half + i);
        bf16x16_store(x + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)));
        bf16x16_store(x + half + i, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)));
    }
    return 1;
}

static int silu_and_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int d) {
    if (d % 16) return 0;
    for (int i = 0; i < d; i += 16) {
        bf16x16_store(o + i, silu_mul16(bf16x16_load(g + i), bf16x16_load(u + i)));
    }
    return 1;
}
#define RMS_NORM_ROW_BF16 rms_norm_row_bf16
#define ROTARY_HEAD_BF16 rotary_head_bf16
#define SILU_AND_MUL_ROW_BF16 silu_and_mul_row_bf16
#else
#define RMS_NORM_ROW_BF16(x, res, w, out, hidden, eps) 0
#define ROTARY_HEAD_BF16(x, cs, head_dim) 0
#define SILU_AND_MUL_ROW_BF16(g, u, o, d) 0
#endif
#define NO_FAST_RMS_NORM(x, res, w, out, hidden, eps) 0
#define NO_FAST_ROTARY(x, cs, head_dim) 0
#define NO_FAST_SILU(g, u, o, d) 0

/* Fewer elements than this run on one thread: waking a second one costs more than it saves. */
#define PARALLEL_MIN 65536

/* RMSNorm over rows of `hidden` (row strides in elements). With a residual (may be NULL):
 * residual = x + residual first, and the norm reads that sum (vLLM's fused_add_rms_norm).
 * out = weight * round(x * rsqrt(mean(x^2) + eps)). `out` may alias `x`. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND, FAST_ROW)                                               \
void NAME(const T *x, long x_stride, T *residual, long res_stride, const T *weight, T *out,      \
          long out_stride, long rows, int hidden, float eps, int num_threads)                      \
{                                                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * hidden >= PARALLEL_MIN)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *xr = x + r * x_stride;                                                            \
        T *orow = out + r * out_stride;                                                            \
        if (FAST_ROW(xr, residual ? residual + r * res_stride : 0, weight, orow, hidden, eps)) continue; \
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

DEFINE_RMS_NORM(strata_rms_norm_f32, float, LOAD_F32, STORE_F32, round_f32, NO_FAST_RMS_NORM)
DEFINE_RMS_NORM(strata_rms_norm_bf16, uint16_t, LOAD_BF16, STORE_BF16, round_bf16, RMS_NORM_ROW_BF16)

/* NeoX-style rotary embedding in place (Hugging Face's rotate_half): for each token t and head,
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin from row positions[t] of the
 * fp32 table [max_position, head_dim] (cos in the first half, sin in the second). q and k are
 * [tokens, heads, head_dim] with token strides in elements (views into the fused qkv output). */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, FAST_HEAD)                                                        \
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
            if (FAST_HEAD(x, cs, head_dim)) continue;                                              \
            for (int i = 0; i < half; i++) {                                                       \
                const float x1 = LOAD(x, i), x2 = LOAD(x, i + half), c = cs[i], s = cs[half + i]; \
                STORE(x, i, x1 * c - x2 * s);                                                      \
                STORE(x, i + half, x2 * c + x1 * s);                                               \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_ROTARY(strata_rotary_f32, float, LOAD_F32, STORE_F32, NO_FAST_ROTARY)
DEFINE_ROTARY(strata_rotary_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROTARY_HEAD_BF16)

/* out[r, i] = silu(x[r, i]) * x[r, d + i] (SwiGLU on the fused gate/up projection): x [rows, 2d]
 * contiguous, out [rows, d]. silu is rounded to the model dtype before the product, as torch's
 * F.silu(gate) * up rounds it. */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND, FAST_ROW)                                           \
void NAME(const T *x, T *out, long rows, int d, int num_threads)                                  \
{                                                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * d >= PARALLEL_MIN)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *g = x + r * 2L * d, *u = g + d;                                                   \
        T *o = out + r * (long)d;                                                                  \
        if (FAST_ROW(g, u, o, d)) continue;                                                        \
        _Pragma("omp simd")                                                                        \
        for (int i = 0; i < d; i++) {                                                              \
            const float a = LOAD(g, i);                                                            \
            STORE(o, i, ROUND(a / (1.f + strata_expf(-a))) * LOAD(u, i));                          \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_SILU_AND_MUL(strata_silu_and_mul_f32, float, LOAD_F32, STORE_F32, round_f32, NO_FAST_SILU)
DEFINE_SILU_AND_MUL(strata_silu_and_mul_bf16, uint16_t, LOAD_BF16, STORE_BF16, round_bf16, SILU_AND_MUL_ROW_BF16)
