/* Causal prefill/extend attention for the CPU path, fp32 and bf16, over the paged cache.
 *
 * torch's path gathers a chunk's cached blocks into a copy and runs SDPA per chunk; its CPU
 * flash attention spends most of a long prefill there. This kernel is flash attention (online
 * softmax, fp32 accumulation, no [L, L] score matrix) that reads K and V through the block table,
 * so plain prefill, prefix-cache hits and chunked prefill are one code path: chunk i has qlen_i
 * new query tokens at absolute positions ctx_i - qlen_i .. ctx_i - 1 (their K/V already stored
 * in the cache), and the query at position p attends to keys 0..p.
 *
 * Two passes, each parallel over OpenMP threads (num_threads passed in):
 * 1. Pack: every (chunk, KV head, block of BN keys) of K and V is copied once out of the cache
 *    into the tile layout the micro-kernels stream (below), BN keys per tile, keys past the
 *    context zeroed. Packing once per call, not per query block, keeps its cost at one copy of
 *    the context whatever the prompt length.
 * 2. Attend: tasks are (chunk, KV head, block of query tokens), dynamic schedule, the costliest
 *    (latest) blocks first since causal tasks are uneven. A task's rows are its tokens x the
 *    query heads of the KV head's group (token-major), so all query heads of a GQA group share
 *    every loaded K/V tile. Per key tile: S = Q K^T for 6 rows x up to 64 keys at a time in 24
 *    AVX-512 accumulators; the softmax of each row in fp32 (running max and sum, exp2 with the
 *    scale and log2(e) folded in); then O = alpha O + P V for 6 rows x 64 dims at a time, the
 *    rescale folded into the accumulators' load. Row groups whose rows all precede the tile
 *    (causally masked) are skipped.
 *
 * Tile layouts. bf16 with AVX512-BF16 (vdpbf16ps sums pairs of products into fp32 lanes):
 *   K [D/2][BN][2]: lanes are 16 keys, each holding the pair (d, d+1); the query pair is
 *   broadcast. V [BN/2][D][2]: lanes are 16 dims, each holding keys (j, j+1); P's pair (j, j+1)
 *   (adjacent in its row) is broadcast. P is rounded to bf16 for the P x V product (its row sum,
 *   the softmax denominator, is kept in fp32 from the unrounded values).
 *   With AMX (head_dim a multiple of 32) the same tiles are the tile unit's B operands, read in
 *   place, and both products take 16 rows at a time (scores_amx, pv_amx): on a 2-core Xeon a
 *   2048-token prompt at L's shape (2 KV heads of 7, head_dim 64) ran 3.1x the vector tiles'
 *   speed, ad hoc, with another process on the machine.
 * fp32 (and bf16 without AVX512-BF16, widened when packed): K [D][BN] (K^T), V [BN][D], fp32 P.
 * With AVX2 and FMA (no AVX-512) the micro-kernels take 6 rows x 16 lanes in two vectors; elsewhere
 * the same passes run as plain C loops of fixed width that the compiler vectorizes.
 *
 * Output rounded once, O / l, to the query's dtype. Layouts: q and out [tokens, num_heads,
 * head_dim] with a token stride (q may be a view into the fused qkv projection); caches
 * [num_blocks, block_size, num_kv_heads, head_dim], contiguous; block_tables [chunks,
 * max_blocks]; query_start_loc [chunks + 1]; context_lens [chunks]. head_dim: a multiple of 16
 * up to 256.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "strata_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define BN 64            /* keys per tile: 4 vectors of 16 scores per row */
#define RT 6             /* rows per micro-tile: 6 x 4 accumulators of the 32 registers */
#define ROWS_TARGET 128  /* rows (tokens x group) per task: the tiles of S, P and O stay in L2 */
#define MAX_HEAD_DIM 256
#define LOG2E 1.4426950408889634f

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define AMX_ROWS 16  /* rows a tile holds: the AMX path's row groups */
#if HAVE_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
/* kernels/cpu/blocked_linear.c: whether the tiles run, and this thread's tile shapes. */
int strata_amx(int on);
void strata_amx_configure(int rows0, int rows1);
#else
#define HAVE_AMX 0
#endif

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])
#define IDENTITY(x) (x)

/* ---- pack: one tile of BN keys of one KV head, keys [kb, kb + n) of a chunk ------------------ */

/* The cache row of key position t (its KV head's head_dim elements). */
#define KEY_ROW(cache, table, t, block_size, row, kvh, D) \
    ((cache) + ((long)(table)[(t) / (block_size)] * (block_size) + (t) % (block_size)) * (row) + (long)(kvh) * (D))

/* fp32 tiles (K^T [D][BN], V [BN][D]) from a cache of T, widened. */
#define DEFINE_PACK_F32(NAME, T, LOAD)                                                              \
static void NAME(const T *k_cache, const T *v_cache, const int32_t *table, int kb, int n, int kvh,   \
                 int num_kv_heads, int D, int block_size, void *tile)                                \
{                                                                                                     \
    float *kt = (float *)tile, *vt = kt + (long)BN * D;                                               \
    const long row = (long)num_kv_heads * D;                                                          \
    for (int j = 0; j < BN; j++) {                                                                    \
        if (j < n) {                                                                                  \
            const T *kr = KEY_ROW(k_cache, table, kb + j, block_size, row, kvh, D);                   \
            const T *vr = KEY_ROW(v_cache, table, kb + j, block_size, row, kvh, D);                   \
            for (int d = 0; d < D; d++) kt[(long)d * BN + j] = LOAD(kr, d);                          \
            for (int d = 0; d < D; d++) vt[(long)j * D + d] = LOAD(vr, d);                           \
        } else {  /* past the context: zeros (the cache's slots there may hold anything) */         \
            for (int d = 0; d < D; d++) kt[(long)d * BN + j] = 0.f;                                  \
            memset(vt + (long)j * D, 0, sizeof(float) * (size_t)D);                                   \
        }                                                                                             \
    }                                                                                                 \
}
DEFINE_PACK_F32(pack_f32_from_f32, float, LOAD_F32)
#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
DEFINE_PACK_F32(pack_f32_from_bf16, uint16_t, LOAD_BF16)
#endif

#if HAVE_DPBF16
/* bf16 pair tiles: K [D/2][BN][2] (a transpose of 32-bit words), V [BN/2][D][2] (two keys' rows
 * interleaved). */
static void pack_bf16_pairs(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int kb,
                            int n, int kvh, int num_kv_heads, int D, int block_size, void *tile) {
    uint32_t *kp = (uint32_t *)tile;                   /* [D/2][BN] words */
    uint16_t *vp = (uint16_t *)tile + (long)BN * D;    /* [BN/2][D][2] */
    const long row = (long)num_kv_heads * D;
    const int D2 = D / 2;
    for (int j = 0; j < BN; j++) {
        if (j < n) {
            const uint16_t *kr = KEY_ROW(k_cache, table, kb + j, block_size, row, kvh, D);
            uint32_t w[MAX_HEAD_DIM / 2];
            memcpy(w, kr, sizeof(uint16_t) * (size_t)D);
            for (int d2 = 0; d2 < D2; d2++) kp[(long)d2 * BN + j] = w[d2];
        } else {
            for (int d2 = 0; d2 < D2; d2++) kp[(long)d2 * BN + j] = 0u;
        }
    }
    /* V: 32 dims of keys j and j + 1 at a time, interleaved by one permute. */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int j = 0; j < BN; j += 2) {
        const uint16_t *v0 = j < n ? KEY_ROW(v_cache, table, kb + j, block_size, row, kvh, D) : NULL;
        const uint16_t *v1 = j + 1 < n ? KEY_ROW(v_cache, table, kb + j + 1, block_size, row, kvh, D) : NULL;
        uint16_t *dst = vp + (long)(j / 2) * D * 2;
        for (int d = 0; d < D; d += 32) {
            const __mmask32 m = D - d >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (D - d)) - 1);
            const __m512i a = v0 ? _mm512_maskz_loadu_epi16(m, v0 + d) : _mm512_setzero_si512();
            const __m512i b = v1 ? _mm512_maskz_loadu_epi16(m, v1 + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, lo, b));
            if (D - d > 16) _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}
#endif

/* ---- micro-kernels -------------------------------------------------------------------------- */

#if defined(__AVX512F__)
/* 2^x for x <= 0 (-inf and below -126: 0): Cephes' exp2f polynomial and vscalefps. */
static inline __m512 exp2_neg(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(exp2_poly16(f), n));
}

/* S[r][j] (raw dot products) for RT rows of q ([RT][D]) against NV * 16 keys of a K^T tile. NV is
 * a constant in each inlined copy, so the RT x NV sums stay in registers. */
static inline __attribute__((always_inline)) void scores_f32_nv(const float *q, int D, const float *kt,
                                                               float *s, const int NV) {
    __m512 acc[RT][4];
    _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 kv[4];
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) kv[v] = _mm512_loadu_ps(kt + (long)d * BN + 16 * v);
        _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
            const __m512 qb = _mm512_set1_ps(q[(long)r * D + d]);
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(qb, kv[v], acc[r][v]);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) _mm512_storeu_ps(s + (long)r * BN + 16 * v, acc[r][v]);
}

/* O[r][d0 .. d0 + 16 NV) = alpha[r] O[r][..] + sum_j P[r][j] V[j][..] over nk keys, RT rows. */
static inline __attribute__((always_inline)) void pv_f32_nv(const float *p, const float *vt, int D, int nk,
                                                           float *o, const float *alpha, const int NV) {
    __m512 acc[RT][4];
    _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
            acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + (long)r * D + 16 * v), a);
    }
    for (int j = 0; j < nk; j++) {
        __m512 vv[4];
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) vv[v] = _mm512_loadu_ps(vt + (long)j * D + 16 * v);
        _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
            const __m512 pb = _mm512_set1_ps(p[(long)r * BN + j]);
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(pb, vv[v], acc[r][v]);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + (long)r * D + 16 * v, acc[r][v]);
}
#endif

#if HAVE_DPBF16
/* As scores_f32_nv over bf16 pairs: q rows [RT][D] bf16, K tile [D/2][BN][2]. */
static inline __attribute__((always_inline)) void scores_bf16_nv(const uint16_t *q, int D, const uint16_t *kp,
                                                                float *s, const int NV) {
    __m512 acc[RT][4];
    _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < D / 2; d2++) {
        __m512bh kv[4];
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
            kv[v] = (__m512bh)_mm512_loadu_si512(kp + ((long)d2 * BN + 16 * v) * 2);
        _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
            int32_t pair;
            memcpy(&pair, q + (long)r * D + 2 * d2, sizeof pair);
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qb, kv[v]);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) _mm512_storeu_ps(s + (long)r * BN + 16 * v, acc[r][v]);
}

/* As pv_f32_nv over bf16 pairs: P rows [RT][BN] bf16, V tile [BN/2][D][2]; nk rounded up to even
 * (P is zero past each row's keys, the tile past the context). */
static inline __attribute__((always_inline)) void pv_bf16_nv(const uint16_t *p, const uint16_t *vp, int D, int nk,
                                                            float *o, const float *alpha, const int NV) {
    __m512 acc[RT][4];
    _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
            acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + (long)r * D + 16 * v), a);
    }
    for (int j2 = 0; j2 < (nk + 1) / 2; j2++) {
        __m512bh vv[4];
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
            vv[v] = (__m512bh)_mm512_loadu_si512(vp + ((long)j2 * D + 16 * v) * 2);
        _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
            int32_t pair;
            memcpy(&pair, p + (long)r * BN + 2 * j2, sizeof pair);
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pb, vv[v]);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + (long)r * D + 16 * v, acc[r][v]);
}
#endif

#if HAVE_AMX
/* The same two products on AMX tiles, 16 rows at a time (tiles configured as 16 rows of 64 bytes,
 * strata_amx_configure(16, 16)), head_dim a multiple of 32. The pair tiles are already the B
 * operand's format: 16 keys (or dims) of 16 pairs are 16 rows of 64 bytes, BN (or D) words apart.
 * S: tiles 0-3 the scores of 4 x 16 keys, 4 the queries' next 32 dims, 5-7 the keys'. */
static void scores_amx(const void *qv, int D, const void *kv, float *s, int nk)
{
    const uint16_t *q = (const uint16_t *)qv, *kp = (const uint16_t *)kv;
    const int nv = (nk + 15) / 16;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int d = 0; d < D; d += 32) {
        const uint16_t *k = kp + (long)d * BN;  /* pair d / 2's row: BN words */
        _tile_loadd(4, q + d, D * 2);
        _tile_loadd(5, k, BN * 4);
        _tile_dpbf16ps(0, 4, 5);
        if (nv > 1) { _tile_loadd(6, k + 32, BN * 4); _tile_dpbf16ps(1, 4, 6); }
        if (nv > 2) { _tile_loadd(7, k + 64, BN * 4); _tile_dpbf16ps(2, 4, 7); }
        if (nv > 3) { _tile_loadd(5, k + 96, BN * 4); _tile_dpbf16ps(3, 4, 5); }
    }
    _tile_stored(0, s, BN * 4);
    if (nv > 1) _tile_stored(1, s + 16, BN * 4);
    if (nv > 2) _tile_stored(2, s + 32, BN * 4);
    if (nv > 3) _tile_stored(3, s + 48, BN * 4);
}

/* O = alpha O + P V for 16 rows: P [16][BN] bf16 (zero past each row's keys, up to nk rounded up
 * to 32), V [BN/2][D][2]. Tiles 0-3 the sums of 4 x 16 dims, 4-5 P's two halves of 32 keys, 6-7
 * V's. O is scaled in memory first, where a row's max moved. */
static void pv_amx(const void *pv, const void *vv, int D, int nk, float *o, const float *alpha)
{
    const uint16_t *p = (const uint16_t *)pv, *vp = (const uint16_t *)vv;
    for (int r = 0; r < AMX_ROWS; r++)
        if (alpha[r] != 1.f) {
            const __m512 a = _mm512_set1_ps(alpha[r]);
            for (int d = 0; d < D; d += 16)
                _mm512_storeu_ps(o + (long)r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + (long)r * D + d), a));
        }
    const int halves = nk > 32 ? 2 : 1;
    _tile_loadd(4, p, BN * 2);
    if (halves > 1) _tile_loadd(5, p + 32, BN * 2);
    const uint16_t *v1 = vp + 16L * D * 2;  /* keys 32-63: pair row 16 */
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int nt = D - d0 >= 64 ? 4 : (D - d0) / 16;  /* 2 (D a multiple of 32) or 4 */
        float *od = o + d0;
        const uint16_t *v0 = vp + (long)d0 * 2;
#define PV_TILE(T, B)                                                                    \
        _tile_loadd(T, od + 16 * (T), D * 4);                                              \
        _tile_loadd(B, v0 + 32 * (T), D * 4);                                              \
        _tile_dpbf16ps(T, 4, B);                                                           \
        if (halves > 1) { _tile_loadd(B, v1 + (long)d0 * 2 + 32 * (T), D * 4); _tile_dpbf16ps(T, 5, B); } \
        _tile_stored(T, od + 16 * (T), D * 4);
        PV_TILE(0, 6)
        PV_TILE(1, 7)
        if (nt > 2) { PV_TILE(2, 6) PV_TILE(3, 7) }
#undef PV_TILE
    }
}

static int amx_runs(int D) { return D % 32 == 0 && strata_amx(-1) == 1; }
static void tiles_begin(int amx) { if (amx) strata_amx_configure(AMX_ROWS, AMX_ROWS); }
static void tiles_end(int amx) { if (amx) _tile_release(); }
#else
static int amx_runs(int D) { (void)D; return 0; }
static void tiles_begin(int amx) { (void)amx; }
static void tiles_end(int amx) { (void)amx; }
#endif

/* Dispatch to a constant NV (1..4), and over head_dim in chunks of 64 dims for P x V. The tile
 * pointers are void: each engine reads its own layout. */
#if defined(__AVX512F__)
#define DEFINE_ENGINE(E, QT, PT)                                                                    \
static void scores_##E(const void *q, int D, const void *kt, float *s, int nk) {                     \
    switch ((nk + 15) / 16) {                                                                         \
    case 1: scores_##E##_nv((const QT *)q, D, (const QT *)kt, s, 1); break;                           \
    case 2: scores_##E##_nv((const QT *)q, D, (const QT *)kt, s, 2); break;                           \
    case 3: scores_##E##_nv((const QT *)q, D, (const QT *)kt, s, 3); break;                           \
    default: scores_##E##_nv((const QT *)q, D, (const QT *)kt, s, 4); break;                          \
    }                                                                                                 \
}                                                                                                     \
static void pv_##E(const void *p, const void *vt, int D, int nk, float *o, const float *alpha) {     \
    int d0 = 0;                                                                                       \
    for (; d0 + 64 <= D; d0 += 64)                                                                    \
        pv_##E##_nv((const PT *)p, (const QT *)vt + (HAVE_PAIRS_##E ? 2 : 1) * d0, D, nk, o + d0, alpha, 4); \
    const QT *vt0 = (const QT *)vt + (HAVE_PAIRS_##E ? 2 : 1) * d0;                                  \
    switch ((D - d0) / 16) {                                                                          \
    case 1: pv_##E##_nv((const PT *)p, vt0, D, nk, o + d0, alpha, 1); break;                          \
    case 2: pv_##E##_nv((const PT *)p, vt0, D, nk, o + d0, alpha, 2); break;                          \
    case 3: pv_##E##_nv((const PT *)p, vt0, D, nk, o + d0, alpha, 3); break;                          \
    default: break;                                                                                   \
    }                                                                                                 \
}
#define HAVE_PAIRS_f32 0
#define HAVE_PAIRS_bf16 1
DEFINE_ENGINE(f32, float, float)
#if HAVE_DPBF16
DEFINE_ENGINE(bf16, uint16_t, uint16_t)
#endif
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (16 registers): the same tiles, 6 rows x 16 lanes (two vectors) at a time: 12 sums, two
 * loads and six broadcasts a step, the usual AVX2 sgemm tile. The plain loops below kept one row
 * a time, so the P x V sums waited on each other (two chains of FMAs) and the scores on loads. */
static void scores_f32(const void *qv, int D, const void *ktv, float *s, int nk) {
    const float *q = (const float *)qv, *kt = (const float *)ktv;
    for (int j0 = 0; j0 < nk; j0 += 16) {  /* keys past nk: not read by the softmax */
        __m256 acc[RT][2];
        _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m256 k0 = _mm256_loadu_ps(kt + (long)d * BN + j0), k1 = _mm256_loadu_ps(kt + (long)d * BN + j0 + 8);
            _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
                const __m256 qb = _mm256_broadcast_ss(q + (long)r * D + d);
                acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
            }
        }
        _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
            _mm256_storeu_ps(s + (long)r * BN + j0, acc[r][0]);
            _mm256_storeu_ps(s + (long)r * BN + j0 + 8, acc[r][1]);
        }
    }
}
static void pv_f32(const void *pv, const void *vtv, int D, int nk, float *o, const float *alpha) {
    const float *p = (const float *)pv, *vt = (const float *)vtv;
    for (int d0 = 0; d0 < D; d0 += 16) {  /* head_dim is a multiple of 16 */
        __m256 acc[RT][2];
        _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
            const __m256 a = _mm256_broadcast_ss(alpha + r);
            acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + (long)r * D + d0), a);
            acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + (long)r * D + d0 + 8), a);
        }
        for (int j = 0; j < nk; j++) {
            const __m256 v0 = _mm256_loadu_ps(vt + (long)j * D + d0), v1 = _mm256_loadu_ps(vt + (long)j * D + d0 + 8);
            _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
                const __m256 pb = _mm256_broadcast_ss(p + (long)r * BN + j);
                acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
            }
        }
        _Pragma("GCC unroll 6") for (int r = 0; r < RT; r++) {
            _mm256_storeu_ps(o + (long)r * D + d0, acc[r][0]);
            _mm256_storeu_ps(o + (long)r * D + d0 + 8, acc[r][1]);
        }
    }
}
#else
/* Plain C (no AVX-512, no AVX2): the same tiles, in loops of fixed width over contiguous data so
 * that the compiler keeps them in vector registers. Scores: one row x BN keys (padded keys are
 * zero in the tile, so all BN are computed). P x V: one row x 16 dims at a time. */
static void scores_f32(const void *qv, int D, const void *ktv, float *s, int nk) {
    const float *q = (const float *)qv, *kt = (const float *)ktv;
    (void)nk;
    for (int r = 0; r < RT; r++) {
        float acc[BN] = {0.f};
        for (int d = 0; d < D; d++) {
            const float qd = q[(long)r * D + d];
            const float *krow = kt + (long)d * BN;
            for (int j = 0; j < BN; j++) acc[j] += qd * krow[j];
        }
        memcpy(s + (long)r * BN, acc, sizeof acc);
    }
}
static void pv_f32(const void *pv, const void *vtv, int D, int nk, float *o, const float *alpha) {
    const float *p = (const float *)pv, *vt = (const float *)vtv;
    for (int r = 0; r < RT; r++) {
        float *orow = o + (long)r * D;
        const float *prow = p + (long)r * BN;
        for (int d0 = 0; d0 < D; d0 += 16) {  /* head_dim is a multiple of 16 */
            float acc[16];
            for (int d = 0; d < 16; d++) acc[d] = orow[d0 + d] * alpha[r];
            for (int j = 0; j < nk; j++) {
                const float pj = prow[j];
                const float *vrow = vt + (long)j * D + d0;
                for (int d = 0; d < 16; d++) acc[d] += pj * vrow[d];
            }
            memcpy(orow + d0, acc, sizeof acc);
        }
    }
}
#endif

/* One row's online-softmax step over a tile: scores s[0..nvalid) (raw; c = scale * log2 e), the
 * rest masked. Updates m (running max, log2 units) and l (running sum: L_LANES partial sums, added
 * up at the end, so no horizontal sum per tile); writes P[0..width) (zeros past nvalid) in fp32
 * or bf16 and returns alpha, the factor for the row's previous O (1 without an exp when the max
 * holds, as it mostly does after the first tiles). */
#if defined(__AVX512F__)
#define L_LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define L_LANES 8
#define AVX2_SOFTMAX 1
/* 2^x for x <= 0 (-inf and below -126: 0), eight at a time: exp2_neg with 2^n built in the
 * exponent bits (n + 127 is 1..127 after the clamp). */
static inline __m256 exp2_neg8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-126.f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(keep, _mm256_mul_ps(exp2_poly8(_mm256_sub_ps(x, n)), _mm256_castsi256_ps(e)));
}
/* Lanes j0 + i < nvalid of a row: all ones, the rest zero. */
static inline __m256 valid8(int j0, int nvalid) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nvalid - j0), lane));
}
#else
#define L_LANES 1
#endif
static inline float softmax_row(const float *s, int nvalid, int width, float c, float *m, float *l,
                                void *p, int p_bf16) {
    float mx = -INFINITY;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < nvalid; j += 16) {
        const __mmask16 k = nvalid - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nvalid - j)) - 1);
        vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, s + j));
    }
    mx = _mm512_reduce_max_ps(vmax);
#elif defined(AVX2_SOFTMAX)
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 vmax = ninf;
    for (int j = 0; j < nvalid; j += 8)  /* s holds BN scores a row: a whole vector is in bounds */
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + j), valid8(j, nvalid)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    for (int j = 0; j < nvalid; j++) mx = s[j] > mx ? s[j] : mx;
#endif
    float alpha = 1.f, m_new = *m;
    if (mx * c > *m) {
        m_new = mx * c;
        alpha = strata_expf((*m - m_new) * 0.6931471805599453f);  /* m = -inf: 0 */
    }
#if defined(__AVX512F__)
    const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_mul_ps(_mm512_loadu_ps(l), _mm512_set1_ps(alpha));
    for (int j = 0; j < width; j += 32) {
        __m512 e[2];
        for (int h = 0; h < 2; h++) {
            const int left = nvalid - j - 16 * h;
            const __mmask16 k = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            e[h] = _mm512_maskz_mov_ps(k, exp2_neg(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j + 16 * h), vc, vm)));
            vsum = _mm512_add_ps(vsum, e[h]);
        }
        if (p_bf16) {
#if HAVE_DPBF16
            _mm512_storeu_si512((uint16_t *)p + j, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
#endif
        } else {
            _mm512_storeu_ps((float *)p + j, e[0]);
            _mm512_storeu_ps((float *)p + j + 16, e[1]);
        }
    }
    _mm512_storeu_ps(l, vsum);
#elif defined(AVX2_SOFTMAX)
    const __m256 vc = _mm256_set1_ps(c), vm = _mm256_set1_ps(m_new);
    __m256 vsum = _mm256_mul_ps(_mm256_loadu_ps(l), _mm256_set1_ps(alpha));
    (void)p_bf16;  /* P is fp32 here */
    for (int j = 0; j < width; j += 8) {
        const __m256 e = _mm256_and_ps(valid8(j, nvalid), exp2_neg8(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), vc, vm)));
        vsum = _mm256_add_ps(vsum, e);
        _mm256_storeu_ps((float *)p + j, e);
    }
    _mm256_storeu_ps(l, vsum);
#else
    float *pf = (float *)p, sum = 0.f;
    (void)p_bf16;
    for (int j = 0; j < width; j++) {
        const float e = j < nvalid ? strata_expf((s[j] * c - m_new) * 0.6931471805599453f) : 0.f;
        pf[j] = e;
        sum += e;
    }
    *l = *l * alpha + sum;
#endif
    *m = m_new;
    return alpha;
}

/* ---- driver --------------------------------------------------------------------------------- */

typedef struct { int chunk, kvh, t0, t1; long cost; } task_t;

static int by_cost_desc(const void *a, const void *b) {
    const long ca = ((const task_t *)a)->cost, cb = ((const task_t *)b)->cost;
    return ca < cb ? 1 : ca > cb ? -1 : 0;
}

static void *alloc64(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 64) == 0 ? p : NULL;
}

/* T: the model's dtype; PACK: the engine's packer from a cache of T; QE: the engine's element
 * (Q rows, tiles); P_BF16: whether P is bf16; WIDEN_Q: T -> QE for the query rows; AMX: whether
 * SCORES16 and PV16 (16 rows at a time on AMX tiles) may take the products, where amx_runs. */
#define DEFINE_KERNEL(NAME, T, QE, PACK, SCORES, PV, P_BF16, TO_QE, NARROW, AMX, SCORES16, PV16)     \
int NAME(const T *q, long q_stride, const T *k_cache, const T *v_cache, const int32_t *block_tables,  \
         int max_blocks, const int32_t *query_start_loc, const int32_t *context_lens, T *out,         \
         long out_stride, int batch, int num_heads, int num_kv_heads, int head_dim, int block_size,   \
         float scale, int num_threads)                                                                 \
{                                                                                                       \
    const int D = head_dim;                                                                             \
    if (batch < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || D <= 0 || D % 16 != 0      \
        || D > MAX_HEAD_DIM || block_size <= 0 || !(scale > 0.f)) return -1;                           \
    for (int b = 0; b < batch; b++) {                                                                   \
        const int qlen = query_start_loc[b + 1] - query_start_loc[b];                                  \
        if (qlen < 0 || qlen > context_lens[b] || (long)(context_lens[b] + block_size - 1) / block_size > max_blocks) \
            return -1;                                                                                  \
    }                                                                                                   \
    if (num_threads < 1) num_threads = 1;                                                               \
    const int group = num_heads / num_kv_heads;                                                         \
    const int amx = AMX && amx_runs(D), ru = amx ? AMX_ROWS : RT;  /* rows a product takes */          \
    /* Tokens per task: about ROWS_TARGET rows, a multiple of ru rows where cheap; smaller while  \
     * the tasks would not keep every thread busy. */                                                 \
    int bq = (ROWS_TARGET + group - 1) / group;                                                         \
    long total_q = 0;                                                                                   \
    for (int b = 0; b < batch; b++) total_q += query_start_loc[b + 1] - query_start_loc[b];            \
    while (bq > 4 && (long)num_kv_heads * ((total_q + bq - 1) / bq) < 4L * num_threads) bq = (bq + 1) / 2; \
    { int g = group, r = ru; while (r) { int t = g % r; g = r; r = t; }                               \
      const int step = ru / g; bq = (bq + step - 1) / step * step; }                                   \
    const int mpad = (bq * group + ru - 1) / ru * ru;                                                   \
    /* Tiles: per chunk, per KV head, ceil(ctx / BN) tiles of K then V, 2 * BN * D elements. */     \
    long *tile0 = (long *)malloc(sizeof(long) * ((size_t)batch + 1));                                   \
    if (!tile0) return -2;                                                                              \
    tile0[0] = 0;                                                                                       \
    long ntasks = 0;                                                                                    \
    for (int b = 0; b < batch; b++) {                                                                   \
        const int qlen = query_start_loc[b + 1] - query_start_loc[b];                                  \
        tile0[b + 1] = tile0[b] + (qlen > 0 ? (long)num_kv_heads * ((context_lens[b] + BN - 1) / BN) : 0); \
        ntasks += (long)num_kv_heads * ((qlen + bq - 1) / bq);                                          \
    }                                                                                                   \
    const long tile_elems = 2L * BN * D;                                                                \
    QE *tiles = (QE *)alloc64(sizeof(QE) * (size_t)(tile0[batch] * tile_elems));                      \
    task_t *tasks = (task_t *)malloc(sizeof(task_t) * (size_t)(ntasks > 0 ? ntasks : 1));              \
    if (!tiles || !tasks) { free(tiles); free(tasks); free(tile0); return -2; }                        \
    long nt = 0;                                                                                        \
    for (int b = 0; b < batch; b++) {                                                                   \
        const int qlen = query_start_loc[b + 1] - query_start_loc[b], first = context_lens[b] - qlen;  \
        for (int t0 = 0; t0 < qlen; t0 += bq)                                                           \
            for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                             \
                const int t1 = t0 + bq < qlen ? t0 + bq : qlen;                                         \
                tasks[nt++] = (task_t){b, kvh, t0, t1, (long)(t1 - t0) * (first + t1 + BN)};          \
            }                                                                                           \
    }                                                                                                   \
    qsort(tasks, (size_t)nt, sizeof(task_t), by_cost_desc);  /* longest first: dynamic balances */   \
    const float c = scale * LOG2E;                                                                      \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads(num_threads)")                                                   \
    {                                                                                                   \
        /* 1. Pack every tile once. */                                                                 \
        _Pragma("omp for schedule(dynamic, 4)")                                                        \
        for (long i = 0; i < tile0[batch]; i++) {                                                      \
            int b = 0;                                                                                  \
            while (tile0[b + 1] <= i) b++;                                                             \
            const int per_head = (context_lens[b] + BN - 1) / BN;                                      \
            const int kvh = (int)((i - tile0[b]) / per_head), kb = (int)((i - tile0[b]) % per_head) * BN; \
            const int n = context_lens[b] - kb < BN ? context_lens[b] - kb : BN;                       \
            PACK(k_cache, v_cache, block_tables + (long)b * max_blocks, kb, n, kvh, num_kv_heads, D,   \
                 block_size, tiles + i * tile_elems);                                                   \
        }                                                                                               \
        /* 2. Attend. Scratch per thread: Q rows, S, P, O, and per row m, l, alpha, position. */     \
        QE *qbuf = (QE *)alloc64(sizeof(QE) * (size_t)mpad * D);                                        \
        float *sbuf = (float *)alloc64(sizeof(float) * (size_t)mpad * BN);                             \
        QE *pbuf = (QE *)alloc64(sizeof(QE) * (size_t)mpad * BN);                                       \
        float *obuf = (float *)alloc64(sizeof(float) * (size_t)mpad * D);                              \
        float *rowf = (float *)alloc64(sizeof(float) * (2 + L_LANES) * (size_t)mpad);                  \
        int *pos = (int *)alloc64(sizeof(int) * (size_t)mpad);                                          \
        if (!qbuf || !sbuf || !pbuf || !obuf || !rowf || !pos) {                                        \
            _Pragma("omp atomic write") failed = 1;                                                     \
        }                                                                                               \
        tiles_begin(amx);                                                                               \
        _Pragma("omp for schedule(dynamic, 1)")                                                        \
        for (long ti = 0; ti < nt; ti++) {                                                             \
            if (!qbuf || !sbuf || !pbuf || !obuf || !rowf || !pos) continue;                           \
            const task_t tk = tasks[ti];                                                                \
            const int b = tk.chunk, qs = query_start_loc[b], ctx = context_lens[b];                    \
            const int first = ctx - (query_start_loc[b + 1] - qs);                                     \
            const int rows = (tk.t1 - tk.t0) * group, maxpos = first + tk.t1 - 1;                     \
            float *m = rowf, *alpha = rowf + mpad, *l = rowf + 2 * mpad;  /* l: L_LANES per row */     \
            for (int r = 0; r < mpad; r++) {                                                            \
                QE *qr = qbuf + (long)r * D;                                                            \
                if (r < rows) {                                                                          \
                    const int tt = r / group, h = tk.kvh * group + r % group;                          \
                    const T *src = q + (long)(qs + tk.t0 + tt) * q_stride + (long)h * D;               \
                    for (int d = 0; d < D; d++) qr[d] = TO_QE(src[d]);                                  \
                    pos[r] = first + tk.t0 + tt;                                                        \
                } else {  /* padding rows: zero queries, never written out */                          \
                    memset(qr, 0, sizeof(QE) * (size_t)D);                                              \
                    pos[r] = maxpos;                                                                    \
                }                                                                                       \
                m[r] = -INFINITY;                                                                       \
                for (int i = 0; i < L_LANES; i++) l[(long)r * L_LANES + i] = 0.f;                     \
            }                                                                                           \
            memset(obuf, 0, sizeof(float) * (size_t)mpad * D);                                          \
            const QE *ktiles = tiles + (tile0[b] + (long)tk.kvh * ((ctx + BN - 1) / BN)) * tile_elems;  \
            for (int kb = 0; kb <= maxpos; kb += BN) {                                                 \
                const QE *kt = ktiles + (long)(kb / BN) * tile_elems, *vt = kt + (long)BN * D;         \
                const int nk = maxpos - kb + 1 < BN ? maxpos - kb + 1 : BN;                            \
                const int width = (nk + 31) / 32 * 32;                                                  \
                /* Rows before tt_lo precede the tile entirely (their positions < kb): skip. */       \
                const int tt_lo = kb - (first + tk.t0) > 0 ? kb - (first + tk.t0) : 0;                 \
                const int r0 = tt_lo * group / ru * ru;                                                 \
                for (int r = r0; r < mpad; r += ru)                                                     \
                    (amx ? SCORES16 : SCORES)(qbuf + (long)r * D, D, kt, sbuf + (long)r * BN, nk);      \
                for (int r = r0; r < mpad; r++) {                                                       \
                    const int nvalid = pos[r] - kb + 1 < nk ? pos[r] - kb + 1 : nk;                    \
                    if (nvalid <= 0) {  /* masked row in a live row group: P = 0, O unchanged */       \
                        memset(pbuf + (long)r * BN, 0, sizeof(QE) * (size_t)width);                     \
                        alpha[r] = 1.f;                                                                 \
                    } else                                                                              \
                        alpha[r] = softmax_row(sbuf + (long)r * BN, nvalid, width, c, m + r,            \
                                               l + (long)r * L_LANES,                                   \
                                               pbuf + (long)r * BN, P_BF16);                            \
                }                                                                                       \
                for (int r = r0; r < mpad; r += ru)                                                     \
                    (amx ? PV16 : PV)(pbuf + (long)r * BN, vt, D, nk, obuf + (long)r * D, alpha + r);  \
            }                                                                                           \
            for (int r = 0; r < rows; r++) {                                                            \
                const int tt = r / group, h = tk.kvh * group + r % group;                              \
                T *dst = out + (long)(qs + tk.t0 + tt) * out_stride + (long)h * D;                     \
                float sum = 0.f;                                                                        \
                for (int i = 0; i < L_LANES; i++) sum += l[(long)r * L_LANES + i];                      \
                const float inv = sum > 0.f ? 1.f / sum : 0.f;                                          \
                const float *orow = obuf + (long)r * D;                                                 \
                for (int d = 0; d < D; d++) dst[d] = NARROW(orow[d] * inv);                             \
            }                                                                                           \
        }                                                                                               \
        tiles_end(amx);                                                                                 \
        free(qbuf); free(sbuf); free(pbuf); free(obuf); free(rowf); free(pos);                         \
    }                                                                                                   \
    free(tiles);                                                                                        \
    free(tasks);                                                                                        \
    free(tile0);                                                                                        \
    return failed ? -2 : 0;                                                                             \
}

DEFINE_KERNEL(strata_prefill_attention_f32, float, float, pack_f32_from_f32, scores_f32, pv_f32, 0,
              IDENTITY, IDENTITY, 0, scores_f32, pv_f32)
#if HAVE_AMX
DEFINE_KERNEL(strata_prefill_attention_bf16, uint16_t, uint16_t, pack_bf16_pairs, scores_bf16, pv_bf16, 1,
              IDENTITY, f32_to_bf16, 1, scores_amx, pv_amx)
#elif HAVE_DPBF16
DEFINE_KERNEL(strata_prefill_attention_bf16, uint16_t, uint16_t, pack_bf16_pairs, scores_bf16, pv_bf16, 1,
              IDENTITY, f32_to_bf16, 0, scores_bf16, pv_bf16)
#else  /* no vdpbf16ps: widen to the fp32 engine when packing */
DEFINE_KERNEL(strata_prefill_attention_bf16, uint16_t, float, pack_f32_from_bf16, scores_f32, pv_f32, 0,
              bf16_to_f32, f32_to_bf16, 0, scores_f32, pv_f32)
#endif
