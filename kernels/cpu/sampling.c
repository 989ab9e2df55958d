/* The sampler's reductions over the vocabulary for the CPU path, reading fp32 or bf16 logits in
 * place (no fp32 copy of a [rows, vocab] tensor), parallel over rows.
 *
 * argmax: the first index of the largest value (as torch.argmax), NaN-free input assumed.
 * top-k: the k largest values (as fp32), their ties, and their indices, sorted by value
 * descending; a bound from blocks' maxima (computed in one vectorized pass) leaves only a few
 * blocks to read value by value, where torch.topk puts every element through its selection.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "strata_math.h"

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])
#define CHUNK 256
#define TOPK_BLOCK 64
#define SAMPLE_BLOCK 1024

#define DEFINE_ARGMAX(NAME, T, LOAD)                                                               \
void NAME(const T *x, long rows, long cols, long row_stride, int64_t *out, int num_threads)      \
{                                                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * cols > 65536)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *xr = x + r * row_stride;                                                          \
        float best = -INFINITY;                                                                    \
        long best_i = 0;                                                                            \
        for (long c0 = 0; c0 < cols; c0 += CHUNK) {                                                \
            const long c1 = c0 + CHUNK < cols ? c0 + CHUNK : cols;                                 \
            float m = -INFINITY;                                                                    \
            _Pragma("omp simd reduction(max:m)")                                                   \
            for (long c = c0; c < c1; c++) { float v = LOAD(xr, c); m = v > m ? v : m; }           \
            if (m > best) {  /* the first index of this chunk's max */                             \
                long c = c0;                                                                        \
                while (LOAD(xr, c) != m) c++;                                                      \
                best = m;                                                                           \
                best_i = c;                                                                         \
            }                                                                                       \
        }                                                                                           \
        out[r] = best_i;                                                                            \
    }                                                                                               \
}

DEFINE_ARGMAX(strata_argmax_f32, float, LOAD_F32)
DEFINE_ARGMAX(strata_argmax_bf16, uint16_t, LOAD_BF16)

/* A min-heap of (value, index) of size k: heap[0] is the smallest kept value. */
static void sift_down(float *hv, int64_t *hi, int k, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, s = i;
        if (l < k && hv[l] < hv[s]) s = l;
        if (r < k && hv[r] < hv[s]) s = r;
        if (s == i) return;
        float tv = hv[i]; hv[i] = hv[s]; hv[s] = tv;
        int64_t ti = hi[i]; hi[i] = hi[s]; hi[s] = ti;
        i = s;
    }
}

/* Push (v, i) into a heap holding n of at most k values. */
static inline void heap_offer(float *hv, int64_t *hi, int k, int *n, float v, int64_t i) {
    if (*n < k) {  /* sift up */
        int j = (*n)++;
        while (j > 0 && hv[(j - 1) / 2] > v) { hv[j] = hv[(j - 1) / 2]; hi[j] = hi[(j - 1) / 2]; j = (j - 1) / 2; }
        hv[j] = v; hi[j] = i;
    } else if (v > hv[0]) {
        hv[0] = v; hi[0] = i;
        sift_down(hv, hi, k, 0);
    }
}

static int by_value_descending(const void *a, const void *b) {
    const float x = ((const float *)a)[0], y = ((const float *)b)[0];
    return (x < y) - (x > y);
}

/* The k largest values and every value tied with the k-th (the sampler keeps ties with the k-th
 * value, and bf16 logits tie often), at most `cap` per row, sorted descending; counts[r] is how
 * many (-1: more than cap). Two passes: the maximum of every block of TOPK_BLOCK values, then
 * the k-th largest of those maxima, t0, bounds the k-th largest value from below (k blocks each
 * hold a value >= t0): only blocks whose maximum reaches t0 are read again, value by value, into
 * a heap of k; a third pass over the same blocks collects everything >= the k-th value. */
#define DEFINE_TOPK(NAME, T, LOAD)                                                                 \
void NAME(const T *x, long rows, long cols, long row_stride, int k, int cap, float *values,      \
          int64_t *indices, int64_t *counts, int num_threads)                                       \
{                                                                                                   \
    const long blocks = (cols + TOPK_BLOCK - 1) / TOPK_BLOCK;                                      \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * cols > 65536)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *xr = x + r * row_stride;                                                          \
        float *hv = (float *)malloc(sizeof(float) * (size_t)k + sizeof(float) * (size_t)blocks + 2 * sizeof(float) * (size_t)cap); \
        int64_t *hi = (int64_t *)malloc(sizeof(int64_t) * (size_t)k);                             \
        if (!hv || !hi) { free(hv); free(hi); counts[r] = -1; continue; }                          \
        float *maxima = hv + k, *pairs = maxima + blocks;  /* pairs: (value, index as float bits) */ \
        float t0 = -INFINITY;                                                                       \
        for (long b = 0; b < blocks; b++) {                                                        \
            const long c0 = b * TOPK_BLOCK, c1 = c0 + TOPK_BLOCK < cols ? c0 + TOPK_BLOCK : cols;  \
            float m = -INFINITY;                                                                    \
            _Pragma("omp simd reduction(max:m)")                                                   \
            for (long c = c0; c < c1; c++) { float v = LOAD(xr, c); m = v > m ? v : m; }           \
            maxima[b] = m;                                                                          \
        }                                                                                           \
        int n = 0;                                                                                  \
        if (blocks >= k) {  /* the k-th largest block maximum, through the heap */                 \
            for (long b = 0; b < blocks; b++) heap_offer(hv, hi, k, &n, maxima[b], b);             \
            t0 = hv[0];                                                                             \
            n = 0;                                                                                  \
        }                                                                                           \
        for (long b = 0; b < blocks; b++) {                                                        \
            if (maxima[b] < t0) continue;                                                          \
            const long c0 = b * TOPK_BLOCK, c1 = c0 + TOPK_BLOCK < cols ? c0 + TOPK_BLOCK : cols;  \
            for (long c = c0; c < c1; c++) {                                                       \
                const float v = LOAD(xr, c);                                                        \
                if (v >= t0) heap_offer(hv, hi, k, &n, v, c);                                      \
            }                                                                                       \
        }                                                                                           \
        const float kth = hv[0];  /* n == k: the caller asks for k <= cols */                      \
        long count = 0;                                                                             \
        for (long b = 0; b < blocks && count <= cap; b++) {                                        \
            if (maxima[b] < kth) continue;                                                         \
            const long c0 = b * TOPK_BLOCK, c1 = c0 + TOPK_BLOCK < cols ? c0 + TOPK_BLOCK : cols;  \
            for (long c = c0; c < c1; c++) {                                                       \
                const float v = LOAD(xr, c);                                                        \
                if (v < kth) continue;                                                              \
                if (count == cap) { count = cap + 1; break; }                                       \
                int32_t index = (int32_t)c;                                                         \
                pairs[2 * count] = v;                                                               \
                memcpy(&pairs[2 * count + 1], &index, sizeof index);                                \
                count++;                                                                            \
            }                                                                                       \
        }                                                                                           \
        if (count > cap) {                                                                          \
            counts[r] = -1;                                                                         \
        } else {                                                                                    \
            qsort(pairs, (size_t)count, 2 * sizeof(float), by_value_descending);                   \
            for (long i = 0; i < cap; i++) {                                                       \
                int32_t index = 0;                                                                  \
                if (i < count) memcpy(&index, &pairs[2 * i + 1], sizeof index);                     \
                values[r * cap + i] = i < count ? pairs[2 * i] : -INFINITY;                        \
                indices[r * cap + i] = index;                                                       \
            }                                                                                       \
            counts[r] = count;                                                                      \
        }                                                                                           \
        free(hv);                                                                                   \
        free(hi);                                                                                   \
    }                                                                                               \
}

DEFINE_TOPK(strata_topk_f32, float, LOAD_F32)
DEFINE_TOPK(strata_topk_bf16, uint16_t, LOAD_BF16)

/* Inverse-CDF sampling over whole rows, for rows without a top-k cut (or whose k-th value ties
 * past the candidates): weights w = exp((x - max) / T) (the unnormalized probabilities, largest
 * 1) in a per-row buffer that stays in cache; min-p keeps w >= min_p; top-p by rejection: draw
 * with uniform u of this round among the kept weights above the pivot, accept if the mass
 * strictly above the token (over the row's top-k set, x >= floor) is below top_p of that set's
 * total, else raise the pivot to the token's weight. out[r] = -1 when `rounds` draws were all
 * rejected (the caller finishes the row). uniforms: [rows, rounds]. */
#define DEFINE_SAMPLE_ROWS(NAME, T, LOAD)                                                          \
void NAME(const T *x, long rows, long cols, long row_stride, const float *temperature,           \
          const float *min_p, const float *top_p, const float *floor_value, const double *uniforms, \
          int rounds, int64_t *out, int num_threads)                                                \
{                                                                                                   \
    _Pragma("omp parallel num_threads(num_threads)")                                               \
    {                                                                                               \
        const long nblocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;                             \
        float *w = (float *)malloc(sizeof(float) * (size_t)(cols + nblocks));                      \
        float *bsum = w ? w + cols : NULL;                                                          \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (long r = 0; r < rows; r++) {                                                          \
            out[r] = -1;                                                                            \
            if (!w) continue;                                                                       \
            const T *xr = x + r * row_stride;                                                      \
            const float floor_r = floor_value[r], inv_t = 1.f / temperature[r];                    \
            float m = -INFINITY;                                                                    \
            _Pragma("omp simd reduction(max:m)")                                                   \
            for (long c = 0; c < cols; c++) { float v = LOAD(xr, c); m = v > m ? v : m; }         \
            double total = 0.0;  /* over the top-k set, for top-p */                               \
            float part = 0.f;                                                                       \
            for (long c0 = 0; c0 < cols; c0 += 4096) {  /* fp32 partial sums, fp64 across them */   \
                const long c1 = c0 + 4096 < cols ? c0 + 4096 : cols;                               \
                part = 0.f;                                                                         \
                _Pragma("omp simd reduction(+:part)")                                              \
                for (long c = c0; c < c1; c++) {                                                   \
                    const float v = LOAD(xr, c);                                                    \
                    const float e = v >= floor_r ? strata_expf((v - m) * inv_t) : 0.f;             \
                    w[c] = e;                                                                       \
                    part += e;                                                                      \
                }                                                                                   \
                total += part;                                                                      \
            }                                                                                       \
            const float keep_min = min_p[r];  /* w >= min_p: p >= min_p * p_max */                \
            float pivot = -1.f;  /* weights above the pivot are drawn from; all, at first */       \
            for (int round = 0; round < rounds; round++) {                                         \
                double kept = 0.0;  /* block sums of the drawable weights, then their total */    \
                for (long b = 0; b < nblocks; b++) {                                               \
                    const long c0 = b * SAMPLE_BLOCK, c1 = c0 + SAMPLE_BLOCK < cols ? c0 + SAMPLE_BLOCK : cols; \
                    part = 0.f;                                                                     \
                    _Pragma("omp simd reduction(+:part)")                                          \
                    for (long c = c0; c < c1; c++)                                                 \
                        part += (w[c] > pivot && w[c] >= keep_min) ? w[c] : 0.f;                   \
                    bsum[b] = part;                                                                 \
                    kept += part;                                                                   \
                }                                                                                   \
                const double target = uniforms[r * rounds + round] * kept;                         \
                double run = 0.0;                                                                   \
                long pick = -1, last = -1, b = 0;                                                   \
                while (b < nblocks - 1 && run + bsum[b] <= target) run += bsum[b++];  /* its block */ \
                for (; b < nblocks && pick < 0; b++) {  /* then value by value */                  \
                    const long c1 = (b + 1) * SAMPLE_BLOCK < cols ? (b + 1) * SAMPLE_BLOCK : cols;   \
                    for (long c = b * SAMPLE_BLOCK; c < c1; c++) {                                 \
                        const float e = (w[c] > pivot && w[c] >= keep_min) ? w[c] : 0.f;           \
                        if (e <= 0.f) continue;                                                     \
                        last = c;                                                                   \
                        run += e;                                                                   \
                        if (run > target) { pick = c; break; }                                     \
                    }                                                                               \
                }                                                                                   \
                if (pick < 0) pick = last;  /* rounding: the target met the end of the row */      \
                if (pick < 0) break;                                                                \
                if (top_p[r] >= 1.f) { out[r] = pick; break; }                                     \
                const float wp = w[pick];                                                           \
                double above = 0.0;                                                                 \
                for (long c0 = 0; c0 < cols; c0 += 4096) {                                         \
                    const long c1 = c0 + 4096 < cols ? c0 + 4096 : cols;                           \
                    part = 0.f;                                                                     \
                    _Pragma("omp simd reduction(+:part)")                                          \
                    for (long c = c0; c < c1; c++) part += w[c] > wp ? w[c] : 0.f;                 \
                    above += part;                                                                  \
                }                                                                                   \
                if (above < (double)top_p[r] * total) { out[r] = pick; break; }                    \
                pivot = wp;  /* everything at or below a rejected token is outside the set */      \
            }                                                                                       \
        }                                                                                           \
        free(w);                                                                                    \
    }                                                                                               \
}

DEFINE_SAMPLE_ROWS(strata_sample_rows_f32, float, LOAD_F32)
DEFINE_SAMPLE_ROWS(strata_sample_rows_bf16, uint16_t, LOAD_BF16)
