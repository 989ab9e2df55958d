/* LoRA deltas for the CPU path, fp32 and bf16, added in place (SGMV: tokens grouped by slot):
 * out[t] += (x[t] A[s]^T) B[s] for every token t of each group, whose adapter sits in slot s.
 *
 * torch's way (a gather, two batched matmuls and an index_add per fused linear) spends more on
 * its five calls than on the arithmetic at decode sizes, and its expand multiplies the zero
 * blocks of B too. Here one call does it:
 * - shrink, y = x A^T in fp32: 16 rows of A against a token at once (scores16: vdpbf16ps on
 *   bf16 where the CPU has it), parallel over tokens; a group's tokens share A in cache.
 * - expand: per (group, 64 output columns), up to 4 tokens' columns accumulate in fp32 from each
 *   row of B they need, starting from out's values, rounded once when stored.
 *
 * Layout (services.engine.lora.adapter): A [slots, rows, in], B [slots, rows, out], contiguous,
 * rows = n_slices * rank; B is block-diagonal: slice i's rows [i*rank, (i+1)*rank) have nonzero
 * entries only in its columns [slice_cols[i], slice_cols[i+1]), so the expand skips the rest.
 * Groups: tokens[group_starts[g] .. group_starts[g+1]) use slot group_slots[g]. */
#include <stdint.h>
#include <stdlib.h>

#include "strata_math.h"
#include "strata_dot16.h"

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])
#define STORE_F32(p, i, v) ((p)[i] = (v))
#define STORE_BF16(p, i, v) ((p)[i] = f32_to_bf16(v))

#define TOKENS_PER_PASS 4  /* tokens sharing each loaded row of B */
#define COLS 64            /* output columns per task: 4 tokens x 64 fp32 sums */

/* The expand of up to TOKENS_PER_PASS tokens over one block of <= COLS output columns:
 * outs[t][c] += sum_r y[t * y_stride + r] * br[r * b_stride + c]. With AVX-512 the 4 x 64 sums
 * stay in 16 registers (a plain loop keeps them on the stack: 3x slower). */
#if defined(__AVX512F__)
static inline __m512 load16_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline void store16_f32(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void store16_bf16(uint16_t *p, __m512 v, __mmask16 m) {  /* round to nearest even */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);  /* NaN stays NaN */
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}
/* M (tokens) is a constant in each copy, so the sums stay in registers: with a runtime count
 * gcc keeps them on the stack (3x slower). */
#define DEFINE_EXPAND(NAME, T, LOAD16, STORE16)                                                      \
static inline __attribute__((always_inline)) void NAME##_m(                                           \
    const float *y, long y_stride, const T *br, long b_stride, long rank, T *const *outs, const int M, long w) \
{                                                                                                     \
    __mmask16 mk[4];                                                                                  \
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) {                                                \
        const long left = w - 16 * q;                                                                 \
        mk[q] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;        \
    }                                                                                                 \
    __m512 acc[TOKENS_PER_PASS][4];                                                                   \
    _Pragma("GCC unroll 4") for (int t = 0; t < M; t++)                                                  \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) acc[t][q] = LOAD16(outs[t] + 16 * q, mk[q]);                     \
    for (long r = 0; r < rank; r++) {                                                                 \
        __m512 bv[4];                                                                                 \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) bv[q] = LOAD16(br + r * b_stride + 16 * q, mk[q]);               \
        _Pragma("GCC unroll 4") for (int t = 0; t < M; t++) {                                            \
            const __m512 yr = _mm512_set1_ps(y[t * y_stride + r]);                                    \
            _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) acc[t][q] = _mm512_fmadd_ps(yr, bv[q], acc[t][q]);           \
        }                                                                                             \
    }                                                                                                 \
    _Pragma("GCC unroll 4") for (int t = 0; t < M; t++)                                                  \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) STORE16(outs[t] + 16 * q, acc[t][q], mk[q]);                     \
}                                                                                                     \
static void NAME(const float *y, long y_stride, const T *br, long b_stride, long rank, T *const *outs, \
                 int m, long w)                                                                       \
{                                                                                                     \
    switch (m) {                                                                                      \
    case 4: NAME##_m(y, y_stride, br, b_stride, rank, outs, 4, w); break;                             \
    case 3: NAME##_m(y, y_stride, br, b_stride, rank, outs, 3, w); break;                             \
    case 2: NAME##_m(y, y_stride, br, b_stride, rank, outs, 2, w); break;                             \
    default: NAME##_m(y, y_stride, br, b_stride, rank, outs, 1, w); break;                            \
    }                                                                                                 \
}
#else
#define DEFINE_EXPAND(NAME, T, LOAD16, STORE16)                                                      \
static void NAME(const float *y, long y_stride, const T *br, long b_stride, long rank, T *const *outs, \
                 int m, long w)                                                                       \
{                                                                                                     \
    for (int t = 0; t < m; t++)                                                                       \
        for (long c = 0; c < w; c++) {                                                                \
            float s = LOAD16(outs[t], c);                                                             \
            for (long r = 0; r < rank; r++) s += y[t * y_stride + r] * LOAD16(br + r * b_stride, c);  \
            STORE16(outs[t], c, s);                                                                   \
        }                                                                                             \
}
#define load16_f32 LOAD_F32
#define load16_bf16 LOAD_BF16
#define store16_f32 STORE_F32
#define store16_bf16 STORE_BF16
#endif
DEFINE_EXPAND(expand_f32, float, load16_f32, store16_f32)
DEFINE_EXPAND(expand_bf16, uint16_t, load16_bf16, store16_bf16)

#define PARALLEL_MIN 262144 /* multiply-adds below which one thread does it all */

#define DEFINE_LORA(NAME, T, LOAD, SCORES16, EXPAND)                                                  \
int NAME(const T *x, long x_stride, long in, const T *a, const T *b, long rows, long rank,           \
         const long *slice_cols, int n_slices, long out_features, const int64_t *tokens,              \
         const int64_t *group_starts, const int64_t *group_slots, int n_groups, T *out,               \
         long out_stride, int num_threads)                                                            \
{                                                                                                     \
    const long n = group_starts[n_groups];                                                           \
    long n_blocks = 0;  /* column blocks of every slice, each within one slice */                    \
    for (int i = 0; i < n_slices; i++) n_blocks += (slice_cols[i + 1] - slice_cols[i] + COLS - 1) / COLS; \
    float *y = malloc(sizeof(float) * (size_t)(n * rows + 1));                                      \
    long *blocks = malloc(sizeof(long) * (size_t)(3 * n_blocks + 1));                               \
    int64_t *slot_of = malloc(sizeof(int64_t) * (size_t)(n + 1));                                   \
    if (!y || !blocks || !slot_of) { free(y); free(blocks); free(slot_of); return 1; }               \
    for (long i = 0, k = 0; i < n_slices; i++)                                                       \
        for (long c = slice_cols[i]; c < slice_cols[i + 1]; c += COLS, k++) {                        \
            blocks[3 * k] = i; blocks[3 * k + 1] = c;                                                 \
            blocks[3 * k + 2] = c + COLS < slice_cols[i + 1] ? c + COLS : slice_cols[i + 1];          \
        }                                                                                             \
    for (int g = 0; g < n_groups; g++)                                                               \
        for (long p = group_starts[g]; p < group_starts[g + 1]; p++) slot_of[p] = group_slots[g];    \
    const long work = n * rows * (in + out_features / (n_slices > 0 ? n_slices : 1));                \
    _Pragma("omp parallel num_threads(num_threads) if(work >= PARALLEL_MIN)")                        \
    {                                                                                                 \
        _Pragma("omp for schedule(static)")                                                          \
        for (long p = 0; p < n; p++) {  /* shrink */                                                 \
            const T *xt = x + tokens[p] * x_stride;                                                  \
            const T *as = a + slot_of[p] * rows * in;                                                \
            float *yp = y + p * rows;                                                                 \
            long j = 0;                                                                               \
            if (HAVE_SCORES16)                                                                        \
                for (; j + 16 <= rows; j += 16) SCORES16(xt, as + j * in, in, (int)in, 1.f, yp + j); \
            for (; j < rows; j++) {                                                                   \
                const T *ar = as + j * in;                                                            \
                float s = 0.f;                                                                        \
                _Pragma("omp simd reduction(+:s)")                                                   \
                for (long k = 0; k < in; k++) s += LOAD(ar, k) * LOAD(xt, k);                        \
                yp[j] = s;                                                                            \
            }                                                                                         \
        }                                                                                             \
        _Pragma("omp for schedule(static)")                                                          \
        for (long task = 0; task < (long)n_groups * n_blocks; task++) {  /* expand */                \
            const long g = task / n_blocks, *blk = blocks + 3 * (task % n_blocks);                   \
            const long i = blk[0], c0 = blk[1], w = blk[2] - blk[1];                                 \
            const T *bs = b + (group_slots[g] * rows + i * rank) * out_features + c0;                \
            for (long p0 = group_starts[g]; p0 < group_starts[g + 1]; p0 += TOKENS_PER_PASS) {       \
                const int m = group_starts[g + 1] - p0 < TOKENS_PER_PASS ? (int)(group_starts[g + 1] - p0) \
                                                                          : TOKENS_PER_PASS;          \
                T *outs[TOKENS_PER_PASS];                                                             \
                for (int t = 0; t < m; t++) outs[t] = out + tokens[p0 + t] * out_stride + c0;         \
                EXPAND(y + p0 * rows + i * rank, rows, bs, out_features, rank, outs, m, w);          \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    free(y); free(blocks); free(slot_of);                                                            \
    return 0;                                                                                         \
}

DEFINE_LORA(strata_lora_sgmv_f32, float, LOAD_F32, SCORES16_F32, expand_f32)
DEFINE_LORA(strata_lora_sgmv_bf16, uint16_t, LOAD_BF16, SCORES16_BF16, expand_bf16)
