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
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const float r = p * bits_to_f32((uint32_t)(n + 127) << 23);
    return x < lo ? 0.f : r;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 2^f for f in [-0.5, 0.5], sixteen at a time: strata_expf's polynomial (the AVX-512 kernels
 * scale it by 2^n with vscalefps). */
static inline __m512 exp2_poly16(__m512 f) {
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return p;
}
#endif

#endif
