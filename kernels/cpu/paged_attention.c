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
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8_i8(const int8_t *p, int left) {
    int8_t part[8] = {0};
    if (left >= 8) memcpy(part, p, 8);
    else for (int i = 0; i < left; i++) part[i] = p[i];
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)part)));
}
DEFINE_SCORES16_AVX2(scores16_i8, float, load8_f32, int8_t, load8_i8)
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

/* Blocks fetched ahead of the one being read (see DEFINE_SPAN). */
#define PREFETCH_BLOCKS 2

/* A block being fetched ahead of use, a few cache lines at a time between the loads that
 * compute: a whole block's prefetches at once (128 lines of a bf16 block of 16 rows x 4 KV heads
 * x 64) would fill the core's miss buffers and stall it until most of them arrive. The lines go
 * to L2 (prefetcht1), not L1: L2 tracks many more misses in flight than L1, and L1 would evict
 * them before use anyway (two blocks ahead is 16 KB of a 32 KB L1). Into L1, M's batch of 32 at
 * 145 tokens took 1.4x as long and 32 sequences of 600 tokens 2x (bench/decode_attention.py). */
typedef struct { const char *next, *end; } prefetch_cursor;

static inline void prefetch_lines(prefetch_cursor *c, long lines) {
    for (; lines > 0 && c->next < c->end; lines--, c->next += 64) __builtin_prefetch(c->next, 0, 2);
}

/* Finish the block being fetched, then start on `block` (NULL: nothing more). */
static inline void prefetch_restart(prefetch_cursor *c, const void *block, long bytes) {
    prefetch_lines(c, (c->end - c->next + 63) / 64);
    c->next = (const char *)block;
    c->end = block ? c->next + bytes : c->next;
}

/* Block i of a span's stream, its K blocks then its V blocks; NULL past the end. */
#define STREAM_BLOCK(i)                                                                            \
    ((i) >= 2 * span_blocks ? (const void *)0                                                       \
     : (const void *)((const char *)((i) < span_blocks ? (const void *)k_cache : (const void *)v_cache) \
                      + (long)table[first_block + (i) % span_blocks] * block_bytes))

/* Rows of V per tile: the tile's widened rows stay in L1 while every head of the group reads them. */
#define PV_TILE 16

/* For each of `heads` query heads h: acc[h] += sum_j p[h][j] * v[j] over a tile of `tile` V rows
 * (fp32, `v_stride` floats apart; p rows `p_stride` apart). Each 64-float slice of a head's
 * output stays in registers for the whole tile (four with AVX-512, eight with AVX2): one
 * broadcast and an FMA a register per row, where a plain loop would load and store the output
 * for every row. */
#if defined(__AVX512F__)
/* `heads` (1-4) heads' 64-float slices over the tile at once, each V row's four loads shared by
 * them: one head alone is four chains of FMAs, each waiting on its last. At L's group of 7 (fp32)
 * the kernel ran 1.05-1.10x as fast (ad-hoc A/B). Each sum still adds its rows in order. */
static inline __attribute__((always_inline)) void pv_heads64(const int heads, const float *v, long v_stride, int tile,
                                                             const float *p, long p_stride, float *acc, long acc_stride)
{
    __m512 a[4][4];
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < 4; i++) a[h][i] = _mm512_loadu_ps(acc + h * acc_stride + 16 * i);
    for (int j = 0; j < tile; j++) {
        const float *vj = v + j * v_stride;
        const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
        const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
        for (int h = 0; h < heads; h++) {
            const __m512 pj = _mm512_set1_ps(p[h * p_stride + j]);
            a[h][0] = _mm512_fmadd_ps(pj, v0, a[h][0]);
            a[h][1] = _mm512_fmadd_ps(pj, v1, a[h][1]);
            a[h][2] = _mm512_fmadd_ps(pj, v2, a[h][2]);
            a[h][3] = _mm512_fmadd_ps(pj, v3, a[h][3]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc + h * acc_stride + 16 * i, a[h][i]);
}
#endif

static void pv_tile(const float *v, long v_stride, int tile, int head_dim, const float *p, long p_stride,
                    int heads, float *acc) {
    int d0 = 0;
#if defined(__AVX512F__)
    for (; d0 + 64 <= head_dim; d0 += 64)
        for (int h = 0, take; h < heads; h += take) {
            /* four heads at a time; 5 and 6 as 3 + 2 and 3 + 3, not leaving one head alone */
            const int left = heads - h;
            take = left == 5 || left == 6 ? 3 : left < 4 ? left : 4;
            const float *ph = p + h * p_stride;
            float *ah = acc + (long)h * head_dim + d0;
            switch (take) {
            case 4: pv_heads64(4, v + d0, v_stride, tile, ph, p_stride, ah, head_dim); break;
            case 3: pv_heads64(3, v + d0, v_stride, tile, ph, p_stride, ah, head_dim); break;
            case 2: pv_heads64(2, v + d0, v_stride, tile, ph, p_stride, ah, head_dim); break;
            default: pv_heads64(1, v + d0, v_stride, tile, ph, p_stride, ah, head_dim); break;
            }
        }
    for (; d0 + 16 <= head_dim; d0 += 16)
        for (int h = 0; h < heads; h++) {
            const float *ph = p + h * p_stride;
            float *ah = acc + (long)h * head_dim + d0;
            __m512 a = _mm512_loadu_ps(ah);
            for (int j = 0; j < tile; j++)
                a = _mm512_fmadd_ps(_mm512_set1_ps(ph[j]), _mm512_loadu_ps(v + j * v_stride + d0), a);
            _mm512_storeu_ps(ah, a);
        }
#elif defined(__AVX2__) && defined(__FMA__)
    /* Before, AVX2 took the plain loop below: on a Zen 3 about a third of the fp32 kernel's time
     * at M's batch 64 was its loads and stores of the output (perf annotate). */
    for (; d0 + 64 <= head_dim; d0 += 64)
        for (int h = 0; h < heads; h++) {
            const float *ph = p + h * p_stride;
            float *ah = acc + (long)h * head_dim + d0;
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(ah + 8 * i);
            for (int j = 0; j < tile; j++) {
                const __m256 pj = _mm256_broadcast_ss(ph + j);
                const float *vj = v + j * v_stride + d0;
                for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), a[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(ah + 8 * i, a[i]);
        }
    for (; d0 + 8 <= head_dim; d0 += 8)
        for (int h = 0; h < heads; h++) {
            const float *ph = p + h * p_stride;
            float *ah = acc + (long)h * head_dim + d0;
            __m256 a = _mm256_loadu_ps(ah);
            for (int j = 0; j < tile; j++)
                a = _mm256_fmadd_ps(_mm256_broadcast_ss(ph + j), _mm256_loadu_ps(v + j * v_stride + d0), a);
            _mm256_storeu_ps(ah, a);
        }
#endif
    if (d0 < head_dim)  /* plain C, or the tail of head_dim past the last full vector */
        for (int h = 0; h < heads; h++)
            for (int j = 0; j < tile; j++) {
                const float pj = p[h * p_stride + j];
                const float *vj = v + j * v_stride;
                float *ah = acc + (long)h * head_dim;
                _Pragma("omp simd")
                for (int d = d0; d < head_dim; d++) ah[d] += pj * vj[d];
            }
}

/* One span [t0, t1) of one sequence, all heads. q: fp32 [num_heads, head_dim]; qn: the query
 * SCORES16 reads (type TQ). k_scales/v_scales: the int8 cache's scales (unused otherwise). Writes per head
 * h: stats[2h] = max score, stats[2h + 1] = sum of exp(score - max), acc[h] = sum of
 * exp(score - max) * v (unnormalized). scores: scratch of num_heads * (t1 - t0) floats. */
#define DEFINE_SPAN(NAME, T, TQ, LOAD, SCORES16, SCALE, V_IN_PLACE)                                \
static void NAME(const float *q, const TQ *qn, const T *k_cache, const T *v_cache,                \
                 const float *k_scales, const float *v_scales,                                     \
                 const int32_t *table, int t0, int t1, int num_heads, int num_kv_heads,            \
                 int head_dim, int block_size, float scale, float *scores, float *stats, float *acc) \
{                                                                                                   \
    const int group = num_heads / num_kv_heads, n = t1 - t0;                                       \
    const long row = (long)num_kv_heads * head_dim;                                                \
    const long block_stride = (long)block_size * row;                                              \
    /* The span's blocks are read as one stream, its K blocks then its V blocks; while one block  \
     * is read, the one PREFETCH_BLOCKS further on is fetched, spread over the reading (blocks    \
     * are scattered: the hardware prefetchers do not follow the table). */                      \
    const int first_block = t0 / block_size, span_blocks = (t1 - 1) / block_size - first_block + 1; \
    const long block_bytes = block_stride * (long)sizeof(T), block_lines = (block_bytes + 63) / 64; \
    prefetch_cursor ahead = {0, 0};                                                                \
    for (int i = 1; i <= PREFETCH_BLOCKS; i++) prefetch_restart(&ahead, STREAM_BLOCK(i), block_bytes); \
    for (int t = t0; t < t1;) {  /* a run of consecutive rows: the span's part of one block */    \
        const int offset = t % block_size, run = t1 - t < block_size - offset ? t1 - t : block_size - offset; \
        const T *krow0 = k_cache + (long)table[t / block_size] * block_stride + (long)offset * row; \
        const long slot0 = (long)table[t / block_size] * block_size + offset;                      \
        prefetch_restart(&ahead, STREAM_BLOCK(t / block_size - first_block + PREFETCH_BLOCKS), block_bytes); \
        const long k_lines = (block_lines + num_heads * (run / 16 + 1) - 1) / (num_heads * (run / 16 + 1)); \
        int j = 0;                                                                                  \
        if (HAVE_SCORES16)                                                                          \
            for (; j + 16 <= run; j += 16)                                                          \
                for (int h = 0; h < num_heads; h++) {                                              \
                    prefetch_lines(&ahead, k_lines);                                               \
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
        _Pragma("omp simd reduction(max:m)")  /* else a scalar chain of maxss: NaN rules */        \
        for (int i = 0; i < n; i++) m = sh[i] > m ? sh[i] : m;                                     \
        for (int i = 0; i < n; i++) { sh[i] = strata_expf(sh[i] - m); sum += sh[i]; }                     \
        stats[2 * h] = m;                                                                          \
        stats[2 * h + 1] = sum;                                                                    \
    }                                                                                              \
    memset(acc, 0, sizeof(float) * (size_t)num_heads * head_dim);                                  \
    /* V: a tile of up to PV_TILE consecutive rows of one KV head, widened once (scaled for int8;  \
     * fp32 rows are read in place), then every query head of its group adds p * v over the     \
     * tile with its output in registers (pv_tile). */                                          \
    float vbuf[PV_TILE * head_dim];                                                                \
    for (int t = t0; t < t1;) {                                                                    \
        const int offset = t % block_size;                                                         \
        int run = block_size - offset < t1 - t ? block_size - offset : t1 - t;                     \
        run = run < PV_TILE ? run : PV_TILE;                                                       \
        const int32_t block = table[t / block_size];                                               \
        const T *vrow0 = v_cache + (long)block * block_stride + (long)offset * row;                 \
        const long slot0 = (long)block * block_size + offset;                                      \
        if (offset == 0 || t == t0)                                                                \
            prefetch_restart(&ahead, STREAM_BLOCK(span_blocks + t / block_size - first_block + PREFETCH_BLOCKS), \
                             block_bytes);                                                          \
        const long v_lines = (block_lines + num_kv_heads - 1) / num_kv_heads;                      \
        for (int kh = 0; kh < num_kv_heads; kh++) {                                                \
            prefetch_lines(&ahead, v_lines);                                                       \
            const T *vh = vrow0 + (long)kh * head_dim;                                             \
            const float *vt = vbuf;                                                                \
            long vt_stride = head_dim;                                                             \
            if (V_IN_PLACE) {                                                                      \
                vt = (const float *)vh;                                                            \
                vt_stride = row;                                                                   \
            } else {                                                                               \
                for (int j = 0; j < run; j++) {                                                    \
                    const float vs = SCALE(v_scales, slot0 + j, kh, num_kv_heads);                 \
                    _Pragma("omp simd")                                                            \
                    for (int d = 0; d < head_dim; d++) vbuf[(long)j * head_dim + d] = LOAD(vh + (long)j * row, d) * vs; \
                }                                                                                   \
            }                                                                                       \
            pv_tile(vt, vt_stride, run, head_dim, scores + (long)kh * group * n + (t - t0), n, group, \
                    acc + (long)kh * group * head_dim);                                            \
        }                                                                                           \
        t += run;                                                                                  \
    }                                                                                              \
}

DEFINE_SPAN(span_f32, float, float, LOAD_F32, SCORES16_F32, NO_SCALE, 1)
DEFINE_SPAN(span_bf16, uint16_t, uint16_t, LOAD_BF16, SCORES16_BF16, NO_SCALE, 0)
DEFINE_SPAN(span_i8, int8_t, float, LOAD_I8, SCORES16_I8, ROW_SCALE, 0)

/* q/out: [batch, num_heads, head_dim] of T, heads contiguous, q_stride/out_stride elements from
 * one token to the next (q may be a view into the fused qkv projection); caches of TC (with
 * k_scales/v_scales for int8, NULL otherwise); block_tables [batch, max_blocks]; context_lens
 * [batch]. */
#define DEFINE_KERNEL(NAME, T, TC, SPAN, WIDEN, NARROW, QN)                                        \
int NAME(const T *q, long q_stride, const TC *k_cache, const TC *v_cache, const int32_t *block_tables, \
         const int32_t *context_lens, T *out, long out_stride, int batch, int num_heads, int num_kv_heads, \
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
            const T *qb = q + (long)b * q_stride;                                                  \
            for (long i = 0; i < n; i++) qf[i] = WIDEN(qb[i]);                                     \
            SPAN(qf, QN(qf, qb), k_cache, v_cache, k_scales, v_scales, block_tables + (long)b * max_blocks, t0, t1, num_heads, \
                 num_kv_heads, head_dim, block_size, scale, work, stats, acc);                     \
            free(work);                                                                             \
        }                                                                                           \
        /* Merge each sequence's spans: rescale to the largest max, sum, normalize. */            \
        _Pragma("omp for schedule(static)")                                                        \
        for (int b = 0; b < batch; b++) {                                                          \
            T *ob = out + (long)b * out_stride;                                                    \
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

/* The step's new K and V rows into their cache slots: row i of k (and v), `k_stride` elements
 * after row i - 1 (views into the fused qkv projection), to slot slots[i] of caches of
 * `num_slots` rows of `row` elements. -1 (nothing written) if a slot is out of range. */
#define DEFINE_STORE_KV(NAME, T)                                                                   \
int NAME(const T *k, long k_stride, const T *v, long v_stride, const int64_t *slots, long n,       \
         T *k_cache, T *v_cache, long num_slots, long row)                                          \
{                                                                                                   \
    for (long i = 0; i < n; i++)                                                                   \
        if (slots[i] < 0 || slots[i] >= num_slots) return -1;                                      \
    for (long i = 0; i < n; i++) {                                                                 \
        memcpy(k_cache + slots[i] * row, k + i * k_stride, sizeof(T) * (size_t)row);               \
        memcpy(v_cache + slots[i] * row, v + i * v_stride, sizeof(T) * (size_t)row);               \
    }                                                                                               \
    return 0;                                                                                       \
}

DEFINE_STORE_KV(strata_store_kv_f32, float)
DEFINE_STORE_KV(strata_store_kv_bf16, uint16_t)
