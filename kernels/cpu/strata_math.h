/* Math shared by the CPU kernels: bf16 conversions and an exp that the compiler vectorizes.
 *
 * libm's expf is a scalar call (about 7 ns); without -ffast-math (which these kernels avoid: it
 * sets flush-to-zero for the whole process) gcc cannot use its vector variant. strata_expf is
 * plain arithmetic on floats and ints, so a loop over it becomes SIMD code: 2^x split into an
 * integer power (built in the exponent bits) and a degree-6 polynomial on [-0.5, 0.5], about
 * 2 ulp from expf over the range where expf is finite and normal. */
#ifndef STRATA_MATH_H
#define STRATA_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Bit casts through memcpy: gcc vectorizes these, not union punning. */
static inline float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }

static inline float bf16_to_f32(uint16_t x) { return bits_to_f32((uint32_t)x << 16); }

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    const uint32_t u = f32_to_bits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;  /* NaN stays NaN (branch-free: vectorizes) */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* Cephes' exp2f polynomial on [-0.5, 0.5], highest degree first: one definition for the scalar
 * and vector forms below, so that every kernel's exp gives the same values. */
#define EXP2_C6 1.535336188319500e-4f
#define EXP2_C5 1.339887440266574e-3f
#define EXP2_C4 9.618437357674640e-3f
#define EXP2_C3 5.550332471162809e-2f
#define EXP2_C2 2.402264791363012e-1f
#define EXP2_C1 6.931472028550421e-1f
#define EXP2_C0 1.0f

/* The polynomial by Horner's rule over vectors of type V (SET1 broadcasts, FMA multiplies and
 * adds): written once for every vector width. */
#define DEFINE_EXP2_POLY(NAME, V, SET1, FMA)                                                       \
static inline V NAME(V f) {                                                                        \
    V p = SET1(EXP2_C6);                                                                           \
    p = FMA(p, f, SET1(EXP2_C5));                                                                  \
    p = FMA(p, f, SET1(EXP2_C4));                                                                  \
    p = FMA(p, f, SET1(EXP2_C3));                                                                  \
    p = FMA(p, f, SET1(EXP2_C2));                                                                  \
    p = FMA(p, f, SET1(EXP2_C1));                                                                  \
    return FMA(p, f, SET1(EXP2_C0));                                                               \
}

static inline float strata_expf(float x) {
    /* Below -87.3 the result would be subnormal: return 0 (as softmax and silu need); above
     * 88.7 it overflows: clamp, so the caller sees FLT_MAX-scale values, not inf. */
    const float lo = -87.33654f, hi = 88.72283f;
    const float clamped = x < lo ? lo : (x > hi ? hi : x);  /* not fminf/fmaxf: they block SIMD */
    const float t = clamped * 1.44269504088896341f;     /* x / ln 2 */
    const float nf = floorf(t + 0.5f);                   /* nearest integer */
    const int n = (int)nf;
    const float f = t - nf;                              /* in [-0.5, 0.5] */
    /* 2^f: Cephes' exp2f polynomial */
    float p = EXP2_C6;
    p = p * f + EXP2_C5;
    p = p * f + EXP2_C4;
    p = p * f + EXP2_C3;
    p = p * f + EXP2_C2;
    p = p * f + EXP2_C1;
    p = p * f + EXP2_C0;
    const float r = p * bits_to_f32((uint32_t)(n + 127) << 23);
    return x < lo ? 0.f : r;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

/* 2^f for f in [-0.5, 0.5], eight at a time: strata_expf's polynomial (AVX2 without AVX-512). */
DEFINE_EXP2_POLY(exp2_poly8, __m256, _mm256_set1_ps, _mm256_fmadd_ps)
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* 2^f for f in [-0.5, 0.5], sixteen at a time: strata_expf's polynomial (the AVX-512 kernels
 * scale it by 2^n with vscalefps). */
DEFINE_EXP2_POLY(exp2_poly16, __m512, _mm512_set1_ps, _mm512_fmadd_ps)

static inline __m512 bf16x16_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 bf16x16_load(const uint16_t *p) { return bf16x16_widen(_mm256_loadu_si256((const __m256i *)p)); }

/* Round to nearest even, NaN kept quiet: f32_to_bf16 sixteen at a time. With AVX512-BF16 one
 * instruction does it (it also flushes fp32 subnormals, below 1.2e-38, to zero). */
static inline __m256i bf16x16_narrow(__m512 f) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(f);
#endif
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
static inline void bf16x16_store(uint16_t *p, __m512 f) { _mm256_storeu_si256((__m256i *)p, bf16x16_narrow(f)); }
static inline __m512 bf16x16_round(__m512 f) { return bf16x16_widen(bf16x16_narrow(f)); }

/* strata_expf sixteen at a time (the same clamp and polynomial; 2^n by scalef). */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.33654f);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.72283f));
    const __m512 t = _mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    /* below the clamp: 0; NaN stays NaN */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), _mm512_scalef_ps(exp2_poly16(f), n));
}

/* silu(g) * u over bf16 values (widened), as torch's bf16 F.silu(gate) * up: silu rounded to
 * bf16 before the product; the caller rounds the product. One definition for the element-wise
 * kernel (layer_ops.c) and the one fused into the gate/up product (blocked_linear.c), so the
 * two give the same bits. */
static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    __m512 inv = _mm512_rcp14_ps(den);  /* 14 bits; one Newton step: about 1 ulp, no divide */
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
    return _mm512_mul_ps(bf16x16_round(_mm512_mul_ps(g, inv)), u);
}
#endif

#endif
