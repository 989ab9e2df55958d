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

/* The k largest values of one row and every value tied with the k-th (the sampler keeps ties
 * with the k-th value, and bf16 logits tie often), at most `cap`, as (value, index bits) pairs
 * sorted descending; returns how many (-1: more than cap). Two passes: the maximum of every
 * block of TOPK_BLOCK values, then the k-th largest of those maxima, t0, bounds the k-th largest
 * value from below (k blocks each hold a value >= t0): only blocks whose maximum reaches t0 are
 * read again, value by value, into a heap of k; a third pass over the same blocks collects
 * everything >= the k-th value but -inf (a row masked down to fewer than k finite values, as a
 * grammar does, keeps those). Scratch: hv (k + blocks floats), hi (k), pairs (2 * cap). */
#define DEFINE_TOPK_ROW(NAME, T, LOAD)                                                             \
/* The maximum of every block of TOPK_BLOCK values into maxima; returns the row's maximum. */     \
static float NAME##_maxima(const T *xr, long cols, float *maxima)                                  \
{                                                                                                   \
    const long blocks = (cols + TOPK_BLOCK - 1) / TOPK_BLOCK;                                      \
    float top = -INFINITY;                                                                          \
    for (long b = 0; b < blocks; b++) {                                                            \
        const long c0 = b * TOPK_BLOCK, c1 = c0 + TOPK_BLOCK < cols ? c0 + TOPK_BLOCK : cols;      \
        float m = -INFINITY;                                                                        \
        _Pragma("omp simd reduction(max:m)")                                                       \
        for (long c = c0; c < c1; c++) { float v = LOAD(xr, c); m = v > m ? v : m; }               \
        maxima[b] = m;                                                                              \
        top = m > top ? m : top;                                                                    \
    }                                                                                               \
    return top;                                                                                     \
}                                                                                                   \
/* The k largest values (k <= cols) into the min-heap (hv, hi): hv[0] is the k-th. */             \
static void NAME##_heap(const T *xr, long cols, int k, const float *maxima, float *hv, int64_t *hi) \
{                                                                                                   \
    const long blocks = (cols + TOPK_BLOCK - 1) / TOPK_BLOCK;                                      \
    float t0 = -INFINITY;                                                                           \
    int n = 0;                                                                                      \
    if (blocks >= k) {  /* the k-th largest block maximum, through the heap */                     \
        for (long b = 0; b < blocks; b++) heap_offer(hv, hi, k, &n, maxima[b], b);                 \
        t0 = hv[0];                                                                                 \
        n = 0;                                                                                      \
    }                                                                                               \
    for (long b = 0; b < blocks; b++) {                                                            \
        if (maxima[b] < t0) continue;                                                              \
        const long c0 = b * TOPK_BLOCK, c1 = c0 + TOPK_BLOCK < cols ? c0 + TOPK_BLOCK : cols;      \
        for (long c = c0; c < c1; c++) {                                                           \
            const float v = LOAD(xr, c);                                                            \
            if (v >= t0) heap_offer(hv, hi, k, &n, v, c);                                          \
        }                                                                                           \
    }                                                                                               \
}                                                                                                   \
static long NAME(const T *xr, long cols, int k, long cap, float *hv, int64_t *hi, float *pairs)   \
{                                                                                                   \
    const long blocks = (cols + TOPK_BLOCK - 1) / TOPK_BLOCK;                                      \
    float *maxima = hv + k;                                                                         \
    NAME##_maxima(xr, cols, maxima);                                                                \
    NAME##_heap(xr, cols, k, maxima, hv, hi);                                                      \
    const float kth = hv[0];                                                                        \
    long count = 0;                                                                                 \
    for (long b = 0; b < blocks; b++) {                                                            \
        if (maxima[b] < kth) continue;                                                             \
        const long c0 = b * TOPK_BLOCK, c1 = c0 + TOPK_BLOCK < cols ? c0 + TOPK_BLOCK : cols;      \
        for (long c = c0; c < c1; c++) {                                                           \
            const float v = LOAD(xr, c);                                                            \
            if (v < kth || v == -INFINITY) continue;  /* -inf (masked): never drawn */             \
            if (count == cap) return -1;                                                            \
            int32_t index = (int32_t)c;                                                             \
            pairs[2 * count] = v;                                                                   \
            memcpy(&pairs[2 * count + 1], &index, sizeof index);                                    \
            count++;                                                                                \
        }                                                                                           \
    }                                                                                               \
    qsort(pairs, (size_t)count, 2 * sizeof(float), by_value_descending);                           \
    return count;                                                                                   \
}

DEFINE_TOPK_ROW(topk_row_f32, float, LOAD_F32)
DEFINE_TOPK_ROW(topk_row_bf16, uint16_t, LOAD_BF16)

static inline int32_t pair_index(const float *pairs, long i) {
    int32_t index;
    memcpy(&index, &pairs[2 * i + 1], sizeof index);
    return index;
}

/* topk_row over rows: values as fp32 [rows, cap] (-inf past the count), indices [rows, cap],
 * counts[r] (-1: more than cap qualify). */
#define DEFINE_TOPK(NAME, T, ROW)                                                                  \
void NAME(const T *x, long rows, long cols, long row_stride, int k, int cap, float *values,      \
          int64_t *indices, int64_t *counts, int num_threads)                                       \
{                                                                                                   \
    const long blocks = (cols + TOPK_BLOCK - 1) / TOPK_BLOCK;                                      \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * cols > 65536)") \
    for (long r = 0; r < rows; r++) {                                                              \
        float *hv = (float *)malloc(sizeof(float) * (size_t)(k + blocks + 2 * (long)cap));         \
        int64_t *hi = (int64_t *)malloc(sizeof(int64_t) * (size_t)k);                             \
        const long count = hv && hi ? ROW(x + r * row_stride, cols, k, cap, hv, hi, hv + k + blocks) : -1; \
        counts[r] = count;                                                                          \
        if (count >= 0) {                                                                           \
            const float *pairs = hv + k + blocks;                                                   \
            for (long i = 0; i < cap; i++) {                                                       \
                values[r * cap + i] = i < count ? pairs[2 * i] : -INFINITY;                        \
                indices[r * cap + i] = i < count ? pair_index(pairs, i) : 0;                       \
            }                                                                                       \
        }                                                                                           \
        free(hv);                                                                                   \
        free(hi);                                                                                   \
    }                                                                                               \
}

DEFINE_TOPK(strata_topk_f32, float, topk_row_f32)
DEFINE_TOPK(strata_topk_bf16, uint16_t, topk_row_bf16)

/* One draw by inverse CDF from a row's weights w (the unnormalized probabilities, largest 1; 0
 * outside the row's top-k set), total their sum: min-p keeps w >= keep_min; top-p by rejection:
 * draw with the round's uniform among the kept weights above the pivot, accept if the mass
 * strictly above the token is below top_p of the total, else raise the pivot to the token's
 * weight (everything at or below it is outside the set). Returns the token, or -1 when all
 * `rounds` draws were rejected. bsum: scratch, one float per SAMPLE_BLOCK. */
static long draw_weights(const float *w, long cols, float *bsum, float keep_min, float top_p, double total,
                         const double *uniforms, int rounds) {
    const long nblocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    float pivot = -1.f;  /* weights above the pivot are drawn from; all, at first */
    for (int round = 0; round < rounds; round++) {
        double kept = 0.0;  /* block sums of the drawable weights, then their total */
        for (long b = 0; b < nblocks; b++) {
            const long c0 = b * SAMPLE_BLOCK, c1 = c0 + SAMPLE_BLOCK < cols ? c0 + SAMPLE_BLOCK : cols;
            float part = 0.f;
            _Pragma("omp simd reduction(+:part)")
            for (long c = c0; c < c1; c++)
                part += (w[c] > pivot && w[c] >= keep_min) ? w[c] : 0.f;
            bsum[b] = part;
            kept += part;
        }
        const double target = uniforms[round] * kept;
        double run = 0.0;
        long pick = -1, last = -1, b = 0;
        while (b < nblocks - 1 && run + bsum[b] <= target) run += bsum[b++];  /* its block */
        for (; b < nblocks && pick < 0; b++) {  /* then value by value */
            const long c1 = (b + 1) * SAMPLE_BLOCK < cols ? (b + 1) * SAMPLE_BLOCK : cols;
            for (long c = b * SAMPLE_BLOCK; c < c1; c++) {
                const float e = (w[c] > pivot && w[c] >= keep_min) ? w[c] : 0.f;
                if (e <= 0.f) continue;
                last = c;
                run += e;
                if (run > target) { pick = c; break; }
            }
        }
        if (pick < 0) pick = last;  /* rounding: the target met the end of the row */
        if (pick < 0) return -1;
        if (top_p >= 1.f) return pick;
        const float wp = w[pick];
        double above = 0.0;
        for (long c0 = 0; c0 < cols; c0 += 4096) {
            const long c1 = c0 + 4096 < cols ? c0 + 4096 : cols;
            float part = 0.f;
            _Pragma("omp simd reduction(+:part)")
            for (long c = c0; c < c1; c++) part += w[c] > wp ? w[c] : 0.f;
            above += part;
        }
        if (above < (double)top_p * total) return pick;
        pivot = wp;
    }
    return -1;
}

/* w[c] = exp((x[c] - m) / T) where x[c] >= floor, else 0 (fp32 partial sums, fp64 across them);
 * returns the sum. */
#define DEFINE_ROW_WEIGHTS(NAME, T, LOAD)                                                          \
static double NAME(const T *xr, long cols, float m, float inv_t, float floor_r, float *w) {       \
    double total = 0.0;                                                                             \
    for (long c0 = 0; c0 < cols; c0 += 4096) {                                                     \
        const long c1 = c0 + 4096 < cols ? c0 + 4096 : cols;                                       \
        float part = 0.f;                                                                           \
        _Pragma("omp simd reduction(+:part)")                                                      \
        for (long c = c0; c < c1; c++) {                                                           \
            const float v = LOAD(xr, c);                                                            \
            const float e = v >= floor_r ? strata_expf((v - m) * inv_t) : 0.f;                     \
            w[c] = e;                                                                               \
            part += e;                                                                              \
        }                                                                                           \
        total += part;                                                                              \
    }                                                                                               \
    return total;                                                                                   \
}                                                                                                   \
static float NAME##_max(const T *xr, long cols) {                                                  \
    float m = -INFINITY;                                                                            \
    _Pragma("omp simd reduction(max:m)")                                                           \
    for (long c = 0; c < cols; c++) { float v = LOAD(xr, c); m = v > m ? v : m; }                  \
    return m;                                                                                       \
}

DEFINE_ROW_WEIGHTS(row_weights_f32, float, LOAD_F32)
DEFINE_ROW_WEIGHTS(row_weights_bf16, uint16_t, LOAD_BF16)

/* Inverse-CDF sampling over whole rows, for rows without a top-k cut (or whose k-th value ties
 * past the candidates: floor_value is that k-th value, else -inf): weights w = exp((x - max) / T)
 * in a per-row buffer that stays in cache, then draw_weights with the row's uniforms ([rows,
 * rounds]). out[r] = -1 when all rounds were rejected (the caller finishes the row). */
#define DEFINE_SAMPLE_ROWS(NAME, T, WEIGHTS)                                                       \
void NAME(const T *x, long rows, long cols, long row_stride, const float *temperature,           \
          const float *min_p, const float *top_p, const float *floor_value, const double *uniforms, \
          int rounds, int64_t *out, int num_threads)                                                \
{                                                                                                   \
    _Pragma("omp parallel num_threads(num_threads)")                                               \
    {                                                                                               \
        const long nblocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;                             \
        float *w = (float *)malloc(sizeof(float) * (size_t)(cols + nblocks));                      \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (long r = 0; r < rows; r++) {                                                          \
            out[r] = -1;                                                                            \
            if (!w) continue;                                                                       \
            const T *xr = x + r * row_stride;                                                      \
            const double total = WEIGHTS(xr, cols, WEIGHTS##_max(xr, cols), 1.f / temperature[r],  \
                                         floor_value[r], w);                                        \
            out[r] = draw_weights(w, cols, w + cols, min_p[r], top_p[r], total, uniforms + r * rounds, rounds); \
        }                                                                                           \
        free(w);                                                                                    \
    }                                                                                               \
}

DEFINE_SAMPLE_ROWS(strata_sample_rows_f32, float, row_weights_f32)
DEFINE_SAMPLE_ROWS(strata_sample_rows_bf16, uint16_t, row_weights_bf16)

/* ---- Sampling fused: penalties, candidates or weights, filters and the draw, one pass a row --- */

/* One sampled row's parameters (mirrored by kernels.cpu.SAMPLE_ROW, a numpy dtype). */
typedef struct {
    int64_t row;          /* the row of x */
    int64_t seen_offset;  /* where its seen ids start in seen_ids / seen_counts */
    uint64_t seed;        /* with position, the key of the row's uniforms: the request's seed, or a fresh random key */
    int64_t position;     /* output position */
    float temperature, top_p, log_min_p;  /* log_min_p: -inf when min-p is off */
    float repetition, frequency, presence;
    int32_t seen_len;     /* distinct seen ids; 0 when the row has no penalty */
    int32_t top_k;        /* 0: none (the whole row is drawn from) */
} strata_sample_row;

static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The sampler's counter-based uniform of (seed, position, round) (services/engine/sampler.py's
 * counter_uniforms, bit for bit). */
double strata_counter_uniform(uint64_t seed, int64_t position, int64_t round_) {
    uint64_t key = splitmix64(seed) ^ ((uint64_t)position * 0xD6E8FEB86659FD93ull);
    key = splitmix64(key ^ ((uint64_t)round_ * 0xA0761D6478BD642Full));
    return (double)(key >> 11) * (1.0 / 9007199254740992.0);
}

/* Penalized values of the seen ids, as the torch path computes them in fp32: repetition (divide
 * positive, multiply negative), then frequency and presence over output counts. True division
 * and the torch path's order of operations: the file's -freciprocal-math and -fassociative-math
 * would otherwise allow a multiply by 1/penalty and a regrouped subtraction. */
__attribute__((noinline, optimize("no-reciprocal-math", "no-associative-math")))
static void penalize(const float *raw, const float *counts, long n, const strata_sample_row *p, float *out) {
    for (long j = 0; j < n; j++) {
        float v = raw[j];
        if (p->repetition != 1.f) v = v > 0.f ? v / p->repetition : v * p->repetition;
        out[j] = v - (p->frequency * counts[j] + p->presence * (counts[j] > 0.f ? 1.f : 0.f));
    }
}

__attribute__((noinline, optimize("no-reciprocal-math")))
static void divide(float *v, long n, float by) {
    for (long i = 0; i < n; i++) v[i] = v[i] / by;
}

/* From candidates (value, index bits) sorted descending, the row's k-th value and all its ties
 * among them: scale by 1/T, keep the top-k set (>= the k-th value), then the top-p prefix (the
 * token whose preceding mass reaches top_p and its ties stay), then min-p (p >= min_p * p_max);
 * draw by inverse CDF with u. Returns the token, -1 if none is finite. */
static long draw_candidates(float *pairs, long count, const strata_sample_row *p, double u, float *v, double *w) {
    for (long i = 0; i < count; i++) v[i] = pairs[2 * i];
    divide(v, count, p->temperature);
    if (!(v[0] > -INFINITY)) return -1;
    const long k = p->top_k < count ? p->top_k : count;
    long keep = k;
    while (keep < count && v[keep] >= v[k - 1]) keep++;
    double total = 0.0;
    for (long i = 0; i < keep; i++) total += (w[i] = exp((double)v[i] - (double)v[0]));
    if (p->top_p < 1.f) {
        long reached = 0;  /* tokens whose preceding mass is below top_p */
        double before = 0.0;
        while (reached < keep && before < (double)p->top_p * total) before += w[reached++];
        const float last = v[(reached > 0 ? reached : 1) - 1];
        long n = 0;
        while (n < keep && v[n] >= last) n++;
        keep = n;
    }
    if (p->log_min_p > -INFINITY) {
        long n = 1;
        while (n < keep && v[n] >= v[0] + p->log_min_p) n++;
        keep = n;
    }
    double kept = 0.0;
    for (long i = 0; i < keep; i++) kept += w[i];
    const double target = u * kept;
    double run = 0.0;
    for (long i = 0; i < keep; i++) {
        run += w[i];
        if (run > target) return pair_index(pairs, i);
    }
    return pair_index(pairs, keep - 1);  /* rounding: the target met the end */
}

/* Whether the rows' parameters fit their tensors: rows increasing (each row once) and in x, top_k
 * in [0, cols), seen ranges inside seen_ids and every seen id in the vocabulary. */
static int sample_rows_valid(const strata_sample_row *params, long n, long rows, long cols,
                             const int64_t *seen_ids, long seen_size) {
    for (long r = 0; r < n; r++) {
        const strata_sample_row *p = &params[r];
        if (p->row < 0 || p->row >= rows || (r > 0 && p->row <= params[r - 1].row)) return 0;
        if (p->top_k < 0 || p->top_k >= cols || p->seen_len < 0 || p->seen_offset < 0
            || p->seen_offset + p->seen_len > seen_size || !(p->temperature > 0.f)) return 0;
        for (long j = 0; j < p->seen_len; j++)
            if (seen_ids[p->seen_offset + j] < 0 || seen_ids[p->seen_offset + j] >= cols) return 0;
    }
    return 1;
}

/* Sampled rows, each in one pass. The penalized values of a row's seen ids are computed aside
 * and those ids masked in x while it is read (then restored). A top-k row: the vocabulary is
 * scanned for the k largest and their ties (which must fit k + tie_room candidates, else -1),
 * the seen values at or above the unseen k-th merged in, and the draw made from them
 * (draw_candidates, round 0). A row without top-k: weights over the whole row with the seen
 * ids' weights from their penalized values, then up to `rounds` top-p rejection rounds
 * (draw_weights; -1 if all are rejected). Uniforms are counter-based on (seed, position,
 * round): a row's token depends on its own logits and parameters only. out[row] gets each
 * token; returns how many are -1 (for the caller's general path), or -2 (nothing done) when a
 * parameter does not fit (sample_rows_valid). */
#define DEFINE_SAMPLE_FUSED(NAME, T, LOAD, TOPK_ROW, WEIGHTS, NEG_INF)                             \
long NAME(T *x, long rows, long cols, long row_stride, const strata_sample_row *params, long n,  \
          const int64_t *seen_ids, const float *seen_counts, long seen_size, int tie_room,          \
          int rounds, int64_t *out, int num_threads)                                                \
{                                                                                                   \
    if (!sample_rows_valid(params, n, rows, cols, seen_ids, seen_size) || rounds < 1 || rounds > 64) return -2; \
    const long blocks = (cols + TOPK_BLOCK - 1) / TOPK_BLOCK, nblocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK; \
    long left = 0;                                                                                  \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) if(n * cols > 65536) reduction(+:left)") \
    for (long r = 0; r < n; r++) {                                                                 \
        const strata_sample_row *p = &params[r];                                                    \
        T *xr = x + p->row * row_stride;                                                           \
        const int k = p->top_k;                                                                     \
        const long seen = p->seen_len, cap = k + tie_room < cols ? k + tie_room : cols;            \
        const long room = cap + seen;  /* candidates and seen values, merged */                    \
        /* top-k: heap (k), block maxima, pairs (2 room), values (room); whole row: w (cols), block sums */ \
        const long scratch = k ? k + blocks + 3 * room : cols + nblocks;                           \
        float *buf = (float *)malloc(sizeof(float) * (size_t)(scratch + 3 * seen));                \
        int64_t *hi = (int64_t *)malloc(sizeof(int64_t) * (size_t)(k ? k : 1));                   \
        double *w = (double *)malloc(sizeof(double) * (size_t)(k ? room : 1));                    \
        long token = -1;                                                                            \
        if (buf && hi && w) {                                                                       \
            float *raw = buf + scratch, *penalized = raw + seen;                                    \
            T *saved = (T *)(penalized + seen);                                                     \
            const int64_t *ids = seen_ids + p->seen_offset;                                         \
            for (long j = 0; j < seen; j++) {                                                      \
                raw[j] = LOAD(xr, ids[j]);                                                          \
                saved[j] = xr[ids[j]];                                                              \
                xr[ids[j]] = NEG_INF;                                                               \
            }                                                                                       \
            penalize(raw, seen_counts + p->seen_offset, seen, p, penalized);                       \
            if (k) {                                                                                \
                float *pairs = buf + k + blocks;                                                    \
                long count = TOPK_ROW(xr, cols, k, cap, buf, hi, pairs);                           \
                for (long j = 0; j < seen; j++) xr[ids[j]] = saved[j];                             \
                if (count >= 0) {                                                                   \
                    /* the unseen k-th (-inf: fewer finite values): the merged one is >= it */     \
                    const float kth = count >= k ? pairs[2 * (k - 1)] : -INFINITY;                 \
                    const long unseen = count;                                                      \
                    for (long j = 0; j < seen; j++) {                                              \
                        if (!(penalized[j] >= kth) || penalized[j] == -INFINITY) continue;         \
                        int32_t index = (int32_t)ids[j];                                            \
                        pairs[2 * count] = penalized[j];                                            \
                        memcpy(&pairs[2 * count + 1], &index, sizeof index);                        \
                        count++;                                                                    \
                    }                                                                               \
                    if (count > unseen) qsort(pairs, (size_t)count, 2 * sizeof(float), by_value_descending); \
                    const double u = strata_counter_uniform(p->seed, p->position, 0);              \
                    if (count > 0) token = draw_candidates(pairs, count, p, u, pairs + 2 * room, w); \
                }                                                                                   \
            } else {                                                                                \
                float m = WEIGHTS##_max(xr, cols);                                                  \
                for (long j = 0; j < seen; j++) m = penalized[j] > m ? penalized[j] : m;           \
                if (m > -INFINITY) {                                                                \
                    const float inv_t = 1.f / p->temperature;                                      \
                    double total = WEIGHTS(xr, cols, m, inv_t, -INFINITY, buf);                    \
                    for (long j = 0; j < seen; j++)  /* masked: their weights were 0 */            \
                        total += (buf[ids[j]] = strata_expf((penalized[j] - m) * inv_t));           \
                    double uniforms[64];                                                            \
                    for (int i = 0; i < rounds; i++) uniforms[i] = strata_counter_uniform(p->seed, p->position, i); \
                    const float keep_min = p->log_min_p > -INFINITY ? expf(p->log_min_p) : 0.f;    \
                    token = draw_weights(buf, cols, buf + cols, keep_min, p->top_p, total, uniforms, rounds); \
                }                                                                                   \
                for (long j = 0; j < seen; j++) xr[ids[j]] = saved[j];                             \
            }                                                                                       \
        }                                                                                           \
        out[p->row] = token;                                                                        \
        left += token < 0;                                                                          \
        free(buf);                                                                                  \
        free(hi);                                                                                   \
        free(w);                                                                                    \
    }                                                                                               \
    return left;                                                                                    \
}

DEFINE_SAMPLE_FUSED(strata_sample_fused_f32, float, LOAD_F32, topk_row_f32, row_weights_f32, -INFINITY)
DEFINE_SAMPLE_FUSED(strata_sample_fused_bf16, uint16_t, LOAD_BF16, topk_row_bf16, row_weights_bf16, (uint16_t)0xFF80)

/* ---- Logprobs: log-softmax facts of raw logits rows, without an fp32 copy of them ---------- */

/* Per row: its log-sum-exp (exp of fp32 differences from the row's maximum, fp32 partial sums
 * added in fp64), its n_top largest logprobs with their ids (descending), and, where targets is
 * given, the target's logprob and rank (1 + how many values exceed the target's). */
#define DEFINE_LOGPROB_ROWS(NAME, T, LOAD, TOPK_ROW)                                               \
void NAME(const T *x, long rows, long cols, long row_stride, int n_top, const int64_t *targets,  \
          float *lse, float *top_values, int64_t *top_ids, float *target_logprob,                   \
          int64_t *target_rank, int num_threads)                                                    \
{                                                                                                   \
    const long blocks = (cols + TOPK_BLOCK - 1) / TOPK_BLOCK;                                      \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * cols > 65536)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *xr = x + r * row_stride;                                                          \
        float *maxima = (float *)malloc(sizeof(float) * (size_t)(blocks + 3 * n_top + 1));        \
        int64_t *hi = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n_top + 1));                   \
        if (!maxima || !hi) { free(maxima); free(hi); lse[r] = NAN; continue; }                    \
        const float m = TOPK_ROW##_maxima(xr, cols, maxima);                                       \
        double sum = 0.0;                                                                           \
        for (long c0 = 0; c0 < cols; c0 += 4096) {                                                 \
            const long c1 = c0 + 4096 < cols ? c0 + 4096 : cols;                                   \
            float part = 0.f;                                                                       \
            _Pragma("omp simd reduction(+:part)")                                                  \
            for (long c = c0; c < c1; c++) part += strata_expf(LOAD(xr, c) - m);                   \
            sum += part;                                                                            \
        }                                                                                           \
        const float l = m + (float)log(sum);                                                        \
        lse[r] = l;                                                                                 \
        if (n_top > 0) {                                                                            \
            float *hv = maxima + blocks, *pairs = hv + n_top;                                      \
            TOPK_ROW##_heap(xr, cols, n_top, maxima, hv, hi);                                      \
            for (int i = 0; i < n_top; i++) {                                                      \
                int32_t index = (int32_t)hi[i];                                                     \
                pairs[2 * i] = hv[i];                                                               \
                memcpy(&pairs[2 * i + 1], &index, sizeof index);                                    \
            }                                                                                       \
            qsort(pairs, (size_t)n_top, 2 * sizeof(float), by_value_descending);              \
            for (int i = 0; i < n_top; i++) {                                                      \
                top_values[r * n_top + i] = pairs[2 * i] - l;                                       \
                top_ids[r * n_top + i] = pair_index(pairs, i);                                      \
            }                                                                                       \
        }                                                                                           \
        if (targets) {                                                                              \
            const float vt = LOAD(xr, targets[r]);                                                  \
            long above = 0;                                                                         \
            _Pragma("omp simd reduction(+:above)")                                                 \
            for (long c = 0; c < cols; c++) above += LOAD(xr, c) > vt;                             \
            target_logprob[r] = vt - l;                                                             \
            target_rank[r] = above + 1;                                                             \
        }                                                                                           \
        free(maxima);                                                                               \
        free(hi);                                                                                   \
    }                                                                                               \
}

DEFINE_LOGPROB_ROWS(strata_logprob_rows_f32, float, LOAD_F32, topk_row_f32)
DEFINE_LOGPROB_ROWS(strata_logprob_rows_bf16, uint16_t, LOAD_BF16, topk_row_bf16)
