/* Weight-only quantized linear layers for the CPU: y = x W^T (+ bias) with W held as int8 (one
 * scale per output channel) or int4 (one scale per group of G input channels), read packed.
 *
 * Decode at small batch is bound by the bytes of weight read per step, so the kernel streams the
 * packed integers and widens them in registers, 16 output channels at a time; no full-precision
 * copy of W exists, not even of a tile in memory. Products and sums are fp32; the group's sum is
 * scaled once per group (int4) or once at the end (int8), which is the dequantize-then-matmul
 * result up to fp32 rounding. x and y are fp32 or bf16 (bf16 x widened once per call, except for
 * int4 on CPUs with AVX512-BF16, which read it as it is; y rounded to nearest even on store).
 *
 * Packed layout (kernels/cpu/quant.py writes it): W's N rows padded to a multiple of 64, as
 * [N/16][K/V][16] 32-bit words, V = 32 / BITS values per word: word (b, w, l) holds
 * W[16b + l, V*w + j] for j < V in bits [BITS*j, BITS*(j+1)), as signed integers. Scales: fp32
 * [N/16][K/G][16] (G = K for int8). A load of 64 bytes is 16 channels' next V inputs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "strata_math.h"

#define LANES 16

/* Value j of a packed word, sign-extended: shift it to the top, arithmetic shift back down. */
static inline int32_t unpack_value(int32_t word, int bits, int j) {
    return (int32_t)((uint32_t)word << (32 - bits * (j + 1))) >> (32 - bits);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The loop of every AVX-512 tile: MT rows of x (XT, row stride K) against NT blocks of 16
 * channels, a group of G inputs at a time (its sums scaled once), V inputs per 32-bit word;
 * STEP(ARG, x, K, kw, packed, part, MT, NT) adds the words `packed` (inputs V*kw ...) into the
 * group's sums `part`. out: [MT][NT*16]. */
#define DEFINE_TILE_LOOP(NAME, XT, V, MT, NT, SETUP, STEP, ARG)                                    \
static void NAME(const void *xv, long K, const int32_t *w, long w_block, const float *s,         \
                 long s_block, int G, float *out)                                                  \
{                                                                                                   \
    const XT *x = (const XT *)xv;                                                                  \
    SETUP                                                                                           \
    __m512 acc[MT][NT];                                                                             \
    for (int m = 0; m < MT; m++)                                                                    \
        for (int b = 0; b < NT; b++) acc[m][b] = _mm512_setzero_ps();                              \
    const long groups = K / G, words = G / (V);                                                    \
    for (long g = 0; g < groups; g++) {                                                            \
        __m512 part[MT][NT];                                                                        \
        for (int m = 0; m < MT; m++)                                                                \
            for (int b = 0; b < NT; b++) part[m][b] = _mm512_setzero_ps();                         \
        for (long i = 0; i < words; i++) {                                                         \
            const long kw = g * words + i;                                                         \
            __m512i packed[NT];                                                                     \
            for (int b = 0; b < NT; b++) packed[b] = _mm512_loadu_si512(w + b * w_block + kw * LANES); \
            STEP(ARG, x, K, kw, packed, part, MT, NT)                                               \
        }                                                                                           \
        for (int b = 0; b < NT; b++) {                                                              \
            const __m512 sv = _mm512_loadu_ps(s + b * s_block + g * LANES);                         \
            for (int m = 0; m < MT; m++) acc[m][b] = _mm512_fmadd_ps(part[m][b], sv, acc[m][b]);   \
        }                                                                                           \
    }                                                                                               \
    for (int m = 0; m < MT; m++)                                                                    \
        for (int b = 0; b < NT; b++) _mm512_storeu_ps(out + (m * NT + b) * LANES, acc[m][b]);      \
}

/* fp32 x: each value widened to fp32 in a register (shift it to the top, arithmetic shift back). */
#define STEP_WIDEN(BITS, x, K, kw, packed, part, MT, NT)                                           \
    _Pragma("GCC unroll 8")                                                                         \
    for (int j = 0; j < 32 / (BITS); j++) {                                                        \
        __m512 wf[NT];                                                                              \
        for (int b = 0; b < NT; b++)                                                                \
            wf[b] = _mm512_cvtepi32_ps(_mm512_srai_epi32(                                           \
                _mm512_slli_epi32(packed[b], 32 - (BITS) * (j + 1)), 32 - (BITS)));                \
        const long k = kw * (32 / (BITS)) + j;                                                      \
        for (int m = 0; m < MT; m++) {                                                              \
            const __m512 xb = _mm512_set1_ps(x[m * K + k]);                                         \
            for (int b = 0; b < NT; b++) part[m][b] = _mm512_fmadd_ps(wf[b], xb, part[m][b]);     \
        }                                                                                           \
    }

/* One tile over fp32 x. */
#define DEFINE_TILE(NAME, BITS, MT, NT) DEFINE_TILE_LOOP(NAME, float, 32 / (BITS), MT, NT, , STEP_WIDEN, BITS)
#else
/* Portable: the same arithmetic, one lane at a time. */
#define DEFINE_TILE(NAME, BITS, MT, NT)                                                            \
static void NAME(const void *xv, long K, const int32_t *w, long w_block, const float *s,         \
                 long s_block, int G, float *out)                                                  \
{                                                                                                   \
    enum { V = 32 / (BITS) };                                                                       \
    const float *x = (const float *)xv;                                                            \
    const long groups = K / G, words = G / V;                                                      \
    for (int m = 0; m < MT; m++)                                                                    \
        for (int b = 0; b < NT; b++)                                                                \
            for (int l = 0; l < LANES; l++) {                                                       \
                float acc = 0.f;                                                                    \
                for (long g = 0; g < groups; g++) {                                                \
                    float part = 0.f;                                                               \
                    for (long i = 0; i < words; i++) {                                             \
                        const long kw = g * words + i;                                             \
                        const int32_t word = w[b * w_block + kw * LANES + l];                      \
                        for (int j = 0; j < V; j++)                                                \
                            part += (float)unpack_value(word, BITS, j) * x[m * K + kw * V + j];    \
                    }                                                                               \
                    acc += part * s[b * s_block + g * LANES + l];                                  \
                }                                                                                   \
                out[(m * NT + b) * LANES + l] = acc;                                                \
            }                                                                                       \
}
#endif

/* Tiles: 1, 2 or 4 rows of x; 4 channel blocks for one or two rows, 2 for four (registers). */
DEFINE_TILE(tile8_1x4, 8, 1, 4)
DEFINE_TILE(tile8_2x4, 8, 2, 4)
DEFINE_TILE(tile8_4x2, 8, 4, 2)
DEFINE_TILE(tile4_1x4, 4, 1, 4)
DEFINE_TILE(tile4_2x4, 4, 2, 4)
DEFINE_TILE(tile4_4x2, 4, 4, 2)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* int4 under bf16 activations, on CPUs with AVX512-BF16: the byte holding a pair of inputs' values
 * becomes that pair as bf16 (exact: integers -8..7) by a 16-entry table lookup (vpermw: the low
 * nibble indexes the pair's first half, the high nibble, shifted up, its second), and vdpbf16ps
 * multiplies the pair of x by each channel's pair, summing in fp32. Five instructions per 32
 * weights where widening to fp32 takes three per 16, and x is read as it is (bf16). */
#define HAVE_BF16_INT4 1
#define BF16_INT4_TABLE                                                                             \
    uint16_t lut[32];  /* bf16 of the signed nibble, twice (vpermw reads 5 index bits) */         \
    for (int n = 0; n < 32; n++) lut[n] = f32_to_bf16((float)((n & 15) < 8 ? (n & 15) : (n & 15) - 16)); \
    const __m512i table = _mm512_loadu_si512(lut);
#define STEP_INT4_BF16(UNUSED, x, K, kw, packed, part, MT, NT)                                     \
    _Pragma("GCC unroll 4")                                                                         \
    for (int j = 0; j < 4; j++) {  /* byte j: the values of inputs 8kw + 2j and + 1 */             \
        __m512bh pairs[NT];                                                                         \
        for (int b = 0; b < NT; b++) {                                                              \
            const __m512i t = _mm512_srli_epi32(packed[b], 8 * j);                                  \
            const __m512i idx = _mm512_mask_blend_epi16(0xAAAAAAAAu, t, _mm512_slli_epi32(t, 12));  \
            pairs[b] = (__m512bh)_mm512_permutexvar_epi16(idx, table);                              \
        }                                                                                           \
        const long k = kw * 8 + 2 * j;                                                              \
        for (int m = 0; m < MT; m++) {                                                              \
            int32_t xpair;                                                                          \
            memcpy(&xpair, x + m * K + k, sizeof xpair);                                            \
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(xpair);                                 \
            for (int b = 0; b < NT; b++) part[m][b] = _mm512_dpbf16_ps(part[m][b], pairs[b], xb); \
        }                                                                                           \
    }
#define DEFINE_TILE4_BF16(NAME, MT, NT) DEFINE_TILE_LOOP(NAME, uint16_t, 8, MT, NT, BF16_INT4_TABLE, STEP_INT4_BF16, 0)
DEFINE_TILE4_BF16(tile4bf_1x4, 1, 4)
DEFINE_TILE4_BF16(tile4bf_2x4, 2, 4)
DEFINE_TILE4_BF16(tile4bf_4x2, 4, 2)
#else
#define HAVE_BF16_INT4 0
#endif

typedef void (*tile_fn)(const void *, long, const int32_t *, long, const float *, long, int, float *);

/* y[M, N] = x[M, K] W^T * scales (+ bias). x: fp32 [M, K]; y fp32 or bf16 (`bf16_out`), row
 * stride y_stride; bias the same dtype as y, or NULL. W's rows are padded to a multiple of
 * BLOCKS_PER_ITEM * 16 (the packer does it), so every work item has all its blocks. */
#define BLOCKS_PER_ITEM 4

static int qlinear(const void *x, size_t x_size, const tile_fn tiles[3], long M, long K, const int32_t *w, int bits,
                   const float *scales, int G, long N, const void *bias, void *y, long y_stride, int bf16_out,
                   int num_threads)
{
    if (bits != 8 && bits != 4) return -1;
    const int V = 32 / bits;
    if (K % G || G % V || N <= 0) return -1;
    const long blocks = (N + LANES - 1) / LANES;
    const long items = (blocks + BLOCKS_PER_ITEM - 1) / BLOCKS_PER_ITEM;
    const long w_block = K / V * LANES, s_block = K / G * LANES;
    if (num_threads < 1) num_threads = 1;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (long item = 0; item < items; item++) {
        float out[4 * 4 * LANES];
        const long b_first = item * BLOCKS_PER_ITEM;
        for (long m0 = 0; m0 < M;) {
            const int mt = M - m0 >= 4 ? 4 : (M - m0 >= 2 ? 2 : 1);
            const int nt = mt == 4 ? 2 : 4;  /* channel blocks per tile call */
            for (long b0 = b_first; b0 < b_first + BLOCKS_PER_ITEM; b0 += nt) {
                tiles[mt == 4 ? 2 : mt - 1]((const char *)x + m0 * K * x_size, K, w + b0 * w_block, w_block,
                                            scales + b0 * s_block, s_block, G, out);
                for (int r = 0; r < mt; r++) {
                    const float *o = out + r * nt * LANES;
                    const long n0 = b0 * LANES, n1 = n0 + nt * LANES < N ? n0 + nt * LANES : N;
                    if (bf16_out) {
                        uint16_t *yr = (uint16_t *)y + (m0 + r) * y_stride;
                        const uint16_t *bb = (const uint16_t *)bias;
                        for (long n = n0; n < n1; n++) yr[n] = f32_to_bf16(o[n - n0] + (bb ? bf16_to_f32(bb[n]) : 0.f));
                    } else {
                        float *yr = (float *)y + (m0 + r) * y_stride;
                        const float *bb = (const float *)bias;
                        for (long n = n0; n < n1; n++) yr[n] = o[n - n0] + (bb ? bb[n] : 0.f);
                    }
                }
            }
            m0 += mt;
        }
    }
    return 0;
}

static const tile_fn TILES8[3] = {tile8_1x4, tile8_2x4, tile8_4x2};
static const tile_fn TILES4[3] = {tile4_1x4, tile4_2x4, tile4_4x2};

int strata_qlinear_f32(const float *x, long M, long K, const int32_t *w, int bits, const float *scales, int G,
                       long N, const float *bias, float *y, long y_stride, int num_threads)
{
    return qlinear(x, sizeof(float), bits == 8 ? TILES8 : TILES4, M, K, w, bits, scales, G, N, bias, y, y_stride, 0,
                   num_threads);
}

int strata_qlinear_bf16(const uint16_t *x, long M, long K, const int32_t *w, int bits, const float *scales, int G,
                        long N, const uint16_t *bias, uint16_t *y, long y_stride, int num_threads)
{
#if HAVE_BF16_INT4
    if (bits == 4) {  /* x read as it is */
        static const tile_fn tiles[3] = {tile4bf_1x4, tile4bf_2x4, tile4bf_4x2};
        return qlinear(x, sizeof(uint16_t), tiles, M, K, w, bits, scales, G, N, bias, y, y_stride, 1, num_threads);
    }
#endif
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -2;
    for (long i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    const int rc = qlinear(xf, sizeof(float), bits == 8 ? TILES8 : TILES4, M, K, w, bits, scales, G, N, bias, y,
                           y_stride, 1, num_threads);
    free(xf);
    return rc;
}
