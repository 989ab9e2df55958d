/* Paged decode attention for the CPU path, for fp32 and bf16 caches.
 *
 * The torch path gathers every sequence's blocks into a contiguous copy before attending, which
 * moves the KV bytes three times. This kernel reads each cached K and V row once, straight
 * through the block table. A token's K (then V) row holds all KV heads side by side, so a task
 * streams through contiguous memory and serves every query head of every group from it (GQA).
 *
 * Tasks are (sequence, span of its context): a long context is split into spans when the batch
 * is smaller than the thread count, so a batch of one still keeps every thread busy. Each span
 * yields, per head, its running max, its sum of exponentials and its unnormalized output; the
 * spans of a sequence are then merged exactly (the flash-decoding combine). All arithmetic in
 * fp32; bf16 is widened on load (its bits are the top half of an fp32).
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], contiguous. An int8 cache
 * (kv_cache_dtype=int8) has a scale per token and KV head beside it, fp32 [num_blocks,
 * block_size, num_kv_heads]: a score is the int8 dot product times its K row's scale, and a V
 * row is widened and multiplied by its scale once for the whole query group.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "strata_math.h"
#include "strata_dot16.h"


#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])
#define IDENTITY(x) (x)

/* Shortest span worth a task of its own. */
#define MIN_SPAN 128

#if defined(__AVX512F__)
/* int8 K rows (their scales applied by the caller): the fp32 query against widened integers. */
static void scores16_i8(const float *q, const int8_t *k, long row, int head_dim, float scale, float *out) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += 16) {
        const __mmask16 m = head_dim - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (head_dim - d)) - 1);
        const __m512 qv = _mm512_maskz_loadu_ps(m, q + d);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, k + j * row + d))),
                                     qv, acc[j]);
    }
    _mm512_storeu_ps(out, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}
#define SCORES16_I8(q, k, row, d, scale, out) scores16_i8(q, k, row, d, scale, out)
#else
#define SCORES16_I8(q, k, row, d, scale, out) ((void)0)
#endif

#define LOAD_I8(p, i) ((float)(p)[i])
/* A cached row's scale: 1 for full-precision caches (folded away), else its entry. */
#define NO_SCALE(scales, slot, kv_head, num_kv_heads) 1.f
#define ROW_SCALE(scales, slot, kv_head, num_kv_heads) ((scales)[(long)(slot) * (num_kv_heads) + (kv_head)])
/* The query a span's SCORES16 reads: in the cache's own dtype (fp32, bf16 pairs for vdpbf16ps),
 * or the fp32 one for int8 caches. */
#define Q_NATIVE(qf, qb) (qb)
#define Q_FP32(qf, qb) (qf)

/* One span [t0, t1) of one sequence, all heads. q: fp32 [num_heads, head_dim]; qn: the query
 * SCORES16 reads (type TQ). k_scales/v_scales: the int8 cache's scales (unused otherwise). Writes per head
 * h: stats[2h] = max score, stats[2h + 1] = sum of exp(score - max), acc[h] = sum of
 * exp(score - max) * v (unnormalized). scores: scratch of num_heads * (t1 - t0) floats. */
#define DEFINE_SPAN(NAME, T, TQ, LOAD, SCORES16, SCALE)                                            \
static void NAME(const float *q, const TQ *qn, const T *k_cache, const T *v_cache,                \
                 const float *k_scales, const float *v_scales,                                     \
                 const int32_t *table, int t0, int t1, int num_heads, int num_kv_heads,            \
                 int head_dim, int block_size, float scale, float *scores, float *stats, float *acc) \
{                                                                                                   \
    const int group = num_heads / num_kv_heads, n = t1 - t0;                                       \
    const long row = (long)num_kv_heads * head_dim;                                                \
    const long block_stride = (long)block_size * row;                                              \
    for (int t = t0; t < t1;) {  /* a run of consecutive rows: the span's part of one block */    \
        const int offset = t % block_size, run = t1 - t < block_size - offset ? t1 - t : block_size - offset; \
        const T *krow0 = k_cache + (long)table[t / block_size] * block_stride + (long)offset * row; \
        const long slot0 = (long)table[t / block_size] * block_size + offset;                      \
        if (t + run < t1) {  /* the next block lives elsewhere: start fetching it now */           \
            const char *next = (const char *)(k_cache + (long)table[(t + run) / block_size] * block_stride); \
            for (long off = 0; off < block_stride * (long)sizeof(T); off += 64) __builtin_prefetch(next + off); \
        }                                                                                           \
        int j = 0;                                                                                  \
        if (HAVE_SCORES16)                                                                          \
            for (; j + 16 <= run; j += 16)                                                          \
                for (int h = 0; h < num_heads; h++) {                                              \
                    float *sh = scores + (long)h * n + (t - t0) + j;                                \
                    SCORES16(qn + (long)h * head_dim, krow0 + (long)j * row + (long)(h / group) * head_dim, \
                             row, head_dim, scale, sh);                                             \
                    for (int i = 0; i < 16; i++) sh[i] *= SCALE(k_scales, slot0 + j + i, h / group, num_kv_heads); \
                }                                                                                   \
        for (; j < run; j++) {                                                                     \
            const T *krow = krow0 + (long)j * row;                                                 \
            for (int h = 0; h < num_heads; h++) {                                                  \
                const T *kh = krow + (long)(h / group) * head_dim;                                 \
                const float *qh = q + (long)h * head_dim;                                          \
                float s = 0.f;                                                                     \
                _Pragma("omp simd reduction(+:s)")                                                 \
                for (int d = 0; d < head_dim; d++) s += qh[d] * LOAD(kh, d);                       \
                scores[(long)h * n + (t - t0) + j] = s * scale * SCALE(k_scales, slot0 + j, h / group, num_kv_heads); \
            }                                                                                      \
        }                                                                                          \
        t += run;                                                                                  \
    }                                                                                              \
    for (int h = 0; h < num_heads; h++) {                                                          \
        float *sh = scores + (long)h * n;                                                          \
        float m = -INFINITY, sum = 0.f;                                                            \
        for (int i = 0; i < n; i++) m = sh[i] > m ? sh[i] : m;                                     \
        for (int i = 0; i < n; i++) { sh[i] = strata_expf(sh[i] - m); sum += sh[i]; }                     \
        stats[2 * h] = m;                                                                          \
        stats[2 * h + 1] = sum;                                                                    \
    }                                                                                              \
    memset(acc, 0, sizeof(float) * (size_t)num_heads * head_dim);                                  \
    float vf[head_dim];  /* one KV head's V row, widened once for the whole group */               \
    for (int t = t0; t < t1; t++) {                                                                \
        const T *vrow = v_cache + (long)table[t / block_size] * block_stride + (long)(t % block_size) * row; \
        if ((t % block_size == 0 || t == t0) && (t / block_size + 1) * block_size < t1) {          \
            const char *next = (const char *)(v_cache + (long)table[t / block_size + 1] * block_stride); \
            for (long off = 0; off < block_stride * (long)sizeof(T); off += 64) __builtin_prefetch(next + off); \
        }                                                                                           \
        const long slot = (long)table[t / block_size] * block_size + t % block_size;               \
        for (int kh = 0; kh < num_kv_heads; kh++) {                                                \
            const T *vh = vrow + (long)kh * head_dim;                                              \
            const float vs = SCALE(v_scales, slot, kh, num_kv_heads);                              \
            _Pragma("omp simd")                                                                    \
            for (int d = 0; d < head_dim; d++) vf[d] = LOAD(vh, d) * vs;                           \
            for (int h = kh * group; h < (kh + 1) * group; h++) {                                  \
                const float p = scores[(long)h * n + (t - t0)];                                    \
                float *ah = acc + (long)h * head_dim;                                              \
                _Pragma("omp simd")                                                                \
                for (int d = 0; d < head_dim; d++) ah[d] += p * vf[d];                             \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_SPAN(span_f32, float, float, LOAD_F32, SCORES16_F32, NO_SCALE)
DEFINE_SPAN(span_bf16, uint16_t, uint16_t, LOAD_BF16, SCORES16_BF16, NO_SCALE)
DEFINE_SPAN(span_i8, int8_t, float, LOAD_I8, SCORES16_I8, ROW_SCALE)

/* q/out: [batch, num_heads, head_dim] of T; caches of TC (with k_scales/v_scales for int8,
 * NULL otherwise); block_tables [batch, max_blocks]; context_lens [batch]. */
#define DEFINE_KERNEL(NAME, T, TC, SPAN, WIDEN, NARROW, QN)                                        \
int NAME(const T *q, const TC *k_cache, const TC *v_cache, const int32_t *block_tables,          \
         const int32_t *context_lens, T *out, int batch, int num_heads, int num_kv_heads,          \
         int head_dim, int block_size, int max_blocks, float scale, int num_threads,               \
         const float *k_scales, const float *v_scales)                                             \
{                                                                                                   \
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;                             \
    if (num_threads < 1) num_threads = 1;                                                          \
    /* Spans per sequence: enough tasks for the threads, none shorter than MIN_SPAN. */            \
    const int want = batch >= num_threads ? 1 : (2 * num_threads + batch - 1) / batch;             \
    int *first = (int *)malloc(sizeof(int) * ((size_t)batch + 1));                                 \
    if (!first) return -2;                                                                          \
    first[0] = 0;                                                                                   \
    for (int b = 0; b < batch; b++) {                                                              \
        int ctx = context_lens[b] > 0 ? context_lens[b] : 0;                                       \
        int spans = ctx / MIN_SPAN < want ? ctx / MIN_SPAN : want;                                 \
        first[b + 1] = first[b] + (spans > 1 ? spans : 1);                                         \
    }                                                                                              \
    const int tasks = first[batch];                                                                \
    const long per_head = head_dim + 2;                                                            \
    float *partial = (float *)malloc(sizeof(float) * (size_t)tasks * num_heads * per_head);        \
    if (!partial) { free(first); return -2; }                                                      \
    int failed = 0;                                                                                \
    _Pragma("omp parallel num_threads(num_threads)")                                               \
    {                                                                                               \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int task = 0; task < tasks; task++) {                                                 \
            int b = 0;                                                                              \
            while (first[b + 1] <= task) b++;                                                      \
            const int ctx = context_lens[b] > 0 ? context_lens[b] : 0;                             \
            const int spans = first[b + 1] - first[b], s = task - first[b];                        \
            const int t0 = (int)((long)ctx * s / spans), t1 = (int)((long)ctx * (s + 1) / spans);  \
            float *stats = partial + (long)task * num_heads * per_head;                            \
            float *acc = stats + 2L * num_heads;                                                    \
            if (t1 <= t0) {                                                                         \
                for (int h = 0; h < num_heads; h++) { stats[2 * h] = -INFINITY; stats[2 * h + 1] = 0.f; } \
                memset(acc, 0, sizeof(float) * (size_t)num_heads * head_dim);                      \
                continue;                                                                           \
            }                                                                                       \
            const long n = (long)num_heads * head_dim;                                             \
            float *work = (float *)malloc(sizeof(float) * ((size_t)num_heads * (t1 - t0) + n));    \
            if (!work) { failed = 1; continue; }                                                   \
            float *qf = work + (size_t)num_heads * (t1 - t0);                                      \
            const T *qb = q + (long)b * n;                                                         \
            for (long i = 0; i < n; i++) qf[i] = WIDEN(qb[i]);                                     \
            SPAN(qf, QN(qf, qb), k_cache, v_cache, k_scales, v_scales, block_tables + (long)b * max_blocks, t0, t1, num_heads, \
                 num_kv_heads, head_dim, block_size, scale, work, stats, acc);                     \
            free(work);                                                                             \
        }                                                                                           \
        /* Merge each sequence's spans: rescale to the largest max, sum, normalize. */            \
        _Pragma("omp for schedule(static)")                                                        \
        for (int b = 0; b < batch; b++) {                                                          \
            T *ob = out + (long)b * num_heads * head_dim;                                          \
            for (int h = 0; h < num_heads; h++) {                                                  \
                float m = -INFINITY;                                                                \
                for (int task = first[b]; task < first[b + 1]; task++) {                           \
                    float mt = partial[(long)task * num_heads * per_head + 2 * h];                 \
                    m = mt > m ? mt : m;                                                            \
                }                                                                                   \
                float o[head_dim], denom = 0.f;                                                     \
                memset(o, 0, sizeof(float) * (size_t)head_dim);                                    \
                for (int task = first[b]; task < first[b + 1] && m > -INFINITY; task++) {          \
                    const float *stats = partial + (long)task * num_heads * per_head;              \
                    if (stats[2 * h] == -INFINITY) continue;                                        \
                    const float w = strata_expf(stats[2 * h] - m);                                        \
                    const float *acc = stats + 2L * num_heads + (long)h * head_dim;                \
                    denom += w * stats[2 * h + 1];                                                  \
                    for (int d = 0; d < head_dim; d++) o[d] += w * acc[d];                         \
                }                                                                                   \
                const float inv = denom > 0.f ? 1.f / denom : 0.f;  /* no context: zeros */        \
                for (int d = 0; d < head_dim; d++) ob[(long)h * head_dim + d] = NARROW(o[d] * inv); \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    free(partial);                                                                                  \
    free(first);                                                                                    \
    return failed ? -2 : 0;                                                                         \
}

DEFINE_KERNEL(strata_paged_decode_attention_f32, float, float, span_f32, IDENTITY, IDENTITY, Q_NATIVE)
DEFINE_KERNEL(strata_paged_decode_attention_bf16, uint16_t, uint16_t, span_bf16, bf16_to_f32, f32_to_bf16, Q_NATIVE)
/* int8 caches (kv_cache_dtype=int8) under fp32 and bf16 models. */
DEFINE_KERNEL(strata_paged_decode_attention_i8_f32, float, int8_t, span_i8, IDENTITY, IDENTITY, Q_FP32)
DEFINE_KERNEL(strata_paged_decode_attention_i8_bf16, uint16_t, int8_t, span_i8, bf16_to_f32, f32_to_bf16, Q_FP32)
