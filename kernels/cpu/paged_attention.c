/* Paged decode attention for the CPU path.
 *
 * The torch path gathers every sequence's blocks into a contiguous copy before attending, which
 * moves the KV bytes three times. This kernel reads each cached K and V row once, straight
 * through the block table: one task per (sequence, KV head), all query heads of the group at
 * once (GQA), exact softmax in two passes over the scores.
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], fp32, contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 64

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
    if (group > MAX_GROUP || group * num_kv_heads != num_heads) return -1;
    const long row_stride = (long)num_kv_heads * head_dim;   /* between tokens of a block */
    const long block_stride = (long)block_size * row_stride;
    int failed = 0;

#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < num_kv_heads; h++) {
            const int ctx = context_lens[b];
            const int32_t *table = block_tables + (long)b * max_blocks;
            const float *qg = q + ((long)b * num_heads + (long)h * group) * head_dim;
            float *og = out + ((long)b * num_heads + (long)h * group) * head_dim;
            float *scores = (float *)malloc(sizeof(float) * (size_t)group * (ctx > 0 ? ctx : 1));
            if (!scores) { failed = 1; continue; }
            float maxs[MAX_GROUP], sums[MAX_GROUP];
            for (int g = 0; g < group; g++) maxs[g] = -INFINITY, sums[g] = 0.f;

            for (int t = 0; t < ctx; t++) {
                const float *krow = k_cache + (long)table[t / block_size] * block_stride
                                    + (long)(t % block_size) * row_stride + (long)h * head_dim;
                for (int g = 0; g < group; g++) {
                    const float *qr = qg + (long)g * head_dim;
                    float s = 0.f;
                    for (int d = 0; d < head_dim; d++) s += qr[d] * krow[d];
                    s *= scale;
                    scores[(long)g * ctx + t] = s;
                    if (s > maxs[g]) maxs[g] = s;
                }
            }
            for (int g = 0; g < group; g++) {
                float *sg = scores + (long)g * ctx;
                float sum = 0.f;
                for (int t = 0; t < ctx; t++) { sg[t] = expf(sg[t] - maxs[g]); sum += sg[t]; }
                sums[g] = sum;
                memset(og + (long)g * head_dim, 0, sizeof(float) * head_dim);
            }
            for (int t = 0; t < ctx; t++) {
                const float *vrow = v_cache + (long)table[t / block_size] * block_stride
                                    + (long)(t % block_size) * row_stride + (long)h * head_dim;
                for (int g = 0; g < group; g++) {
                    const float p = scores[(long)g * ctx + t];
                    float *o = og + (long)g * head_dim;
                    for (int d = 0; d < head_dim; d++) o[d] += p * vrow[d];
                }
            }
            for (int g = 0; g < group; g++) {
                const float inv = sums[g] > 0.f ? 1.f / sums[g] : 0.f;
                float *o = og + (long)g * head_dim;
                for (int d = 0; d < head_dim; d++) o[d] *= inv;
            }
            free(scores);
        }
    }
    return failed ? -2 : 0;
}
