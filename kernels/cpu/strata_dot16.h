/* Sixteen dot products at a time, for the CPU kernels that score many rows against one vector
 * (paged attention's K rows against a query, LoRA's A rows against a token). */
#ifndef STRATA_DOT16_H
#define STRATA_DOT16_H
#include <stdint.h>

/* scores16_*: one vector (q) against 16 consecutive rows (k, `row` elements apart), scaled, into
 * out[0..15]. With AVX-512 the 16 dot products accumulate in 16 registers (bf16 pairs straight
 * through vdpbf16ps where the CPU has AVX512-BF16) and one transpose-add tree reduces them, where
 * a dot product at a time would pay a horizontal sum for each. */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 reduce16(const __m512 *a) {  /* lane j = sum of a[j]'s 16 lanes */
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit chunk: [x0+x2, y0+y2, x1+x3, y1+y3] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per chunk: the chunk sums of a[4i .. 4i+3] */
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

static inline void scores16_f32(const float *q, const float *k, long row, int head_dim, float scale, float *out) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += 16) {
        const __mmask16 m = head_dim - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (head_dim - d)) - 1);
        const __m512 qv = _mm512_maskz_loadu_ps(m, q + d);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, k + j * row + d), qv, acc[j]);
    }
    _mm512_storeu_ps(out, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}

static inline void scores16_bf16(const uint16_t *q, const uint16_t *k, long row, int head_dim, float scale, float *out) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    for (int d = 0; d < head_dim; d += 32) {  /* 32 bf16 pairs per instruction, fp32 sums */
        const __mmask32 m = head_dim - d >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (head_dim - d)) - 1);
        const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + d);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_maskz_loadu_epi16(m, k + j * row + d), qv);
    }
#else
    for (int d = 0; d < head_dim; d += 16) {  /* widen: bf16 bits are the top half of an fp32 */
        const __mmask16 m = head_dim - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (head_dim - d)) - 1);
        const __m512 qv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, q + d)), 16));
        for (int j = 0; j < 16; j++) {
            const __m512 kv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, k + j * row + d)), 16));
            acc[j] = _mm512_fmadd_ps(kv, qv, acc[j]);
        }
    }
#endif
    _mm512_storeu_ps(out, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}
#define HAVE_SCORES16 1
#define SCORES16_F32(q, k, row, d, scale, out) scores16_f32(q, k, row, d, scale, out)
#define SCORES16_BF16(q, k, row, d, scale, out) scores16_bf16(q, k, row, d, scale, out)
#else
#define HAVE_SCORES16 0
#define SCORES16_F32(q, k, row, d, scale, out) ((void)0)
#define SCORES16_BF16(q, k, row, d, scale, out) ((void)0)
#endif

#endif
