/* Paged decode attention for the CPU path.
 *
 * The torch path gathers every sequence's blocks into a contiguous copy before attending, which
 * moves the KV bytes three times. This kernel reads each cached K and V row once, straight
 * through the block table. One task per sequence: a token's K (then V) row holds all KV heads
 * side by side, so the task streams through contiguous memory and serves every query head of
 * every group from it (GQA). Exact softmax in two passes over the scores.
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], fp32, contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int strata_paged_decode_attention_f32(
    const float *q,               /* [batch, num_heads, head_dim] */
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables,  /* [batch, max_blocks] */
    const int32_t *context_lens,  /* [batch] */
    float *out,                   /* [batch, num_heads, head_dim] */
    int batch, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    float scale, int num_threads)
{
    const int group = num_heads / num_kv_heads;
    if (group * num_kv_heads != num_heads) return -1;
    const long row = (long)num_kv_heads * head_dim;  /* one token's K (or V) for all heads */
    const long block_stride = (long)block_size * row;
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int b = 0; b < batch; b++) {
        const int ctx = context_lens[b];
        const int32_t *table = block_tables + (long)b * max_blocks;
        const float *qb = q + (long)b * num_heads * head_dim;
        float *ob = out + (long)b * num_heads * head_dim;
        memset(ob, 0, sizeof(float) * (size_t)num_heads * head_dim);
        if (ctx <= 0) continue;
        float *scores = (float *)malloc(sizeof(float) * (size_t)num_heads * ctx);  /* [head][token] */
        if (!scores) { failed = 1; continue; }

        for (int t = 0; t < ctx; t++) {
            const float *krow = k_cache + (long)table[t / block_size] * block_stride + (long)(t % block_size) * row;
            for (int h = 0; h < num_heads; h++) {
                const float *kh = krow + (long)(h / group) * head_dim;
                const float *qh = qb + (long)h * head_dim;
                float s = 0.f;
                for (int d = 0; d < head_dim; d++) s += qh[d] * kh[d];
                scores[(long)h * ctx + t] = s * scale;
            }
        }
        for (int h = 0; h < num_heads; h++) {
            float *sh = scores + (long)h * ctx;
            float m = -INFINITY, sum = 0.f;
            for (int t = 0; t < ctx; t++) m = sh[t] > m ? sh[t] : m;
            for (int t = 0; t < ctx; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }
            const float inv = 1.f / sum;  /* sum >= 1: the max term is exp(0) */
            for (int t = 0; t < ctx; t++) sh[t] *= inv;
        }
        for (int t = 0; t < ctx; t++) {
            const float *vrow = v_cache + (long)table[t / block_size] * block_stride + (long)(t % block_size) * row;
            for (int h = 0; h < num_heads; h++) {
                const float p = scores[(long)h * ctx + t];
                const float *vh = vrow + (long)(h / group) * head_dim;
                float *oh = ob + (long)h * head_dim;
                for (int d = 0; d < head_dim; d++) oh[d] += p * vh[d];
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
