/* Sixteen dot products at a time, for the CPU kernels that score many rows against one vector
 * (paged attention's K rows against a query, LoRA's A rows against a token). */
#ifndef STRATA_DOT16_H
#define STRATA_DOT16_H
#include <stdint.h>

/* scores16_*: one vector (q) against 16 consecutive rows (k, `row` elements apart), scaled, into
 * out[0..15]. With AVX-512 the 16 dot products accumulate in 16 registers (bf16 pairs straight
 * through vdpbf16ps where the CPU has AVX512-BF16) and one transpose-add tree reduces them, where
 * a dot product at a time would pay a horizontal sum for each. With AVX2 (below) the same in two
 * halves of 8 rows. */
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

static inline __m512 loadu16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 loadu16_bf16(const uint16_t *p) {  /* widened: bf16 bits are an fp32's top half */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Rows outer, the query's `chunks` vectors of 16 in registers: one pointer walks the rows. With
 * the chunks outer, the sixteen rows' addresses did not fit the integer registers, and gcc reloaded
 * one from the stack for about every other load. At L's group of 7 (fp32) the decode kernel ran
 * 1.06-1.07x as fast, 1.2x with its blocks in cache (ad-hoc A/B). Each sum adds its chunks in the
 * same order. */
#define DEFINE_ROWS16(NAME, T, LOAD16)                                                             \
static inline __attribute__((always_inline)) void NAME(const int chunks, const T *q, const T *k, long row, \
                                                       __m512 *acc) {                              \
    __m512 qv[8];                                                                                  \
    for (int c = 0; c < chunks; c++) qv[c] = LOAD16(q + 16 * c);                                   \
    for (int j = 0; j < 16; j++, k += row) {                                                       \
        __m512 a = _mm512_fmadd_ps(LOAD16(k), qv[0], _mm512_setzero_ps());                         \
        for (int c = 1; c < chunks; c++) a = _mm512_fmadd_ps(LOAD16(k + 16 * c), qv[c], a);        \
        acc[j] = a;                                                                                \
    }                                                                                              \
}
DEFINE_ROWS16(rows16_f32, float, loadu16_f32)
#if !defined(__AVX512BF16__)
DEFINE_ROWS16(rows16_bf16, uint16_t, loadu16_bf16)
#endif

static inline void scores16_f32(const float *q, const float *k, long row, int head_dim, float scale, float *out) {
    __m512 acc[16];
    switch (head_dim) {
    case 64: rows16_f32(4, q, k, row, acc); goto reduce;
    case 128: rows16_f32(8, q, k, row, acc); goto reduce;
    }
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += 16) {
        const __mmask16 m = head_dim - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (head_dim - d)) - 1);
        const __m512 qv = _mm512_maskz_loadu_ps(m, q + d);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, k + j * row + d), qv, acc[j]);
    }
reduce:
    _mm512_storeu_ps(out, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}

static inline void scores16_bf16(const uint16_t *q, const uint16_t *k, long row, int head_dim, float scale, float *out) {
    __m512 acc[16];
#if !defined(__AVX512BF16__)
    switch (head_dim) {
    case 64: rows16_bf16(4, q, k, row, acc); goto reduce;
    case 128: rows16_bf16(8, q, k, row, acc); goto reduce;
    }
#endif
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
reduce:
#endif
    _mm512_storeu_ps(out, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}
#define HAVE_SCORES16 1
#define SCORES16_F32(q, k, row, d, scale, out) scores16_f32(q, k, row, d, scale, out)
#define SCORES16_BF16(q, k, row, d, scale, out) scores16_bf16(q, k, row, d, scale, out)
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (16 registers): two halves of 8 rows, 8 sums each, one transpose-add tree a half. A dot
 * product at a time chained its FMAs through one sum and paid a horizontal sum each: on a Zen 3
 * the fp32 decode kernel ran 1.1-1.4x faster this way at M's batch 64 (8 heads, 4 KV heads),
 * 1.5-1.7x at L's (14 and 2), 1.3-2.3x on one 2048-token context (ad-hoc A/B). */
#include <immintrin.h>

static inline __m256 reduce8(const __m256 *a) {  /* lane j = sum of a[j]'s 8 lanes */
    const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 b2 = _mm256_hadd_ps(a[4], a[5]), b3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);  /* per 128-bit half */
    return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

static inline __m256i tail_mask8(int left) {  /* the first min(left, 8) lanes */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __m256 load8_f32(const float *p, int left) {
    return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask8(left));
}

static inline __m256 load8_bf16(const uint16_t *p, int left) {  /* widened: bf16 bits are an fp32's top half */
    __m128i bits;
    if (left >= 8) {
        bits = _mm_loadu_si128((const __m128i *)p);
    } else {
        uint16_t part[8] = {0};
        for (int i = 0; i < left; i++) part[i] = p[i];
        bits = _mm_loadu_si128((const __m128i *)part);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* q (TQ, widened by LOADQ) against 16 rows of k (TK, widened by LOADK) */
#define DEFINE_SCORES16_AVX2(NAME, TQ, LOADQ, TK, LOADK)                                           \
static inline void NAME(const TQ *q, const TK *k, long row, int head_dim, float scale, float *out) { \
    for (int half = 0; half < 2; half++, k += 8 * row) {                                           \
        __m256 acc[8];                                                                             \
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();                                  \
        for (int d = 0; d < head_dim; d += 8) {                                                    \
            const __m256 qv = LOADQ(q + d, head_dim - d);                                          \
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(LOADK(k + j * row + d, head_dim - d), qv, acc[j]); \
        }                                                                                          \
        _mm256_storeu_ps(out + 8 * half, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));     \
    }                                                                                              \
}
DEFINE_SCORES16_AVX2(scores16_f32, float, load8_f32, float, load8_f32)
DEFINE_SCORES16_AVX2(scores16_bf16, uint16_t, load8_bf16, uint16_t, load8_bf16)
#define HAVE_SCORES16 1
#define SCORES16_F32(q, k, row, d, scale, out) scores16_f32(q, k, row, d, scale, out)
#define SCORES16_BF16(q, k, row, d, scale, out) scores16_bf16(q, k, row, d, scale, out)
#else
#define HAVE_SCORES16 0
#define SCORES16_F32(q, k, row, d, scale, out) ((void)0)
#define SCORES16_BF16(q, k, row, d, scale, out) ((void)0)
#endif

#endif
