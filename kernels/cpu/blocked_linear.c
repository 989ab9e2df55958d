/* Linear layers over bf16 weights in a blocked layout: y = x W^T (+ bias). bf16 activations on CPUs
 * with AVX512-BF16 (strata_blocked_linear_bf16); fp32 activations on CPUs with AVX2 and FMA
 * (strata_blocked_linear_f32, at the end of this file).
 *
 * oneDNN's packed matmul pays about 20 us a call before any arithmetic (dispatch, primitive
 * lookup) and reads its layout at 15-25 GB/s for one row; a decode step at batch 1 is a few dozen
 * of those calls, each bound by the bytes of weight it reads. This layout makes each thread's
 * share of W one sequential stream, and one instruction (vdpbf16ps) multiplies 16 output channels
 * by a pair of inputs: one row reads W 1.2-1.9x faster than oneDNN does, and from 16 rows to
 * prefill chunks the same loop runs within a few percent of oneDNN (bench/blocked_linear.py, on a
 * Zen 4). Where the CPU has AMX, its tiles take the same layout (strata_amx, below).
 *
 * Layout (kernels/cpu/blocked_linear.py writes it): W's N rows padded to a multiple of 16, as
 * [N/16][K/2][16] 32-bit words; word (b, p, l) holds the bf16 pair W[16b + l, 2p], W[16b + l, 2p+1]
 * (K even). A 64-byte load is 16 channels' next two inputs; vdpbf16ps adds both products to each
 * channel's fp32 sum. Sums start at the bias (fp32) and are rounded to bf16 once, at the store.
 *
 * Work: tiles of up to 4 rows of x by 4 blocks of 16 channels (16 accumulators in registers). A
 * work item is one group of 4 blocks over one chunk of rows; items are numbered group-major, so
 * a thread's contiguous share walks all the rows of a group while the group's slab of W (at most
 * 64 x K x 2 bytes) stays in its L2.
 *
 * SwiGLU (mode GATED_SWIGLU): a fused gate/up weight [gate; up] (N = 2h, h a multiple of 16) may
 * be packed with its blocks interleaved, gate block i then up block i; a tile then holds both
 * halves of 16 channels and writes silu(gate) * up ([M][h]), with the roundings of the
 * element-wise kernel (silu_mul16): one pass over the activations instead of a [M][2h] product
 * written, read back and written again. Mode GATED stores such a weight's product as [gate | up].
 */
#include <stdint.h>
#include <string.h>

#include "strata_math.h"

int strata_blocked_linear_available(void)
{
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int strata_blocked_linear_f32_available(void)
{
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define LANES 16
#define NT 4          /* blocks of 16 channels per work item (and per bf16 tile) */
#define ROW_CHUNK 256 /* rows per work item: x's share of a chunk stays in L2/L3 */
/* Threads claim the work a little at a time (schedule(dynamic)), at least this many claims a
 * thread. With a fixed half each, a thread delayed for part of a call (the other core's work, an
 * interrupt, another tenant on a shared machine) held the other at the call's end: timed ad hoc in
 * L's fused decode step at 64 rows on a 2-core Xeon (fp32 path), the first thread to finish waited
 * 36-54 ms of the 296-356 ms a step spent in linear layers, and 4-19 ms with dynamic claims. */
#define CLAIMS_PER_THREAD 8

#if defined(__AVX512BF16__)
#define MT 4          /* rows of x per tile */

enum { PLAIN = 0, GATED = 1, GATED_SWIGLU = 2 };  /* kernels/cpu/blocked_linear.py's modes */

/* y's column of block `block`: in order, or for an interleaved gate/up weight its half's. */
static inline long block_column(long block, long half, int mode) {
    return mode == PLAIN ? block * LANES : (block & 1) * half + (block >> 1) * LANES;
}

/* One row's sums of `blocks` blocks from block b0 on, rounded to bf16 once into its row of y;
 * `valid` channels of the last block are stored. GATED_SWIGLU: blocks come in (gate, up) pairs
 * (b0 and blocks even), and silu(gate) * up is stored. */
static inline __attribute__((always_inline)) void store_row(const __m512 *sums, int blocks, long b0, int valid,
                                                            uint16_t *y_row, long half, int mode)
{
    if (mode == GATED_SWIGLU) {
        for (int b = 0; b + 1 < blocks; b += 2)
            bf16x16_store(y_row + ((b0 + b) >> 1) * LANES, silu_mul16(bf16x16_round(sums[b]), bf16x16_round(sums[b + 1])));
        return;
    }
    for (int b = 0; b < blocks; b++) {
        const __m256i out = bf16x16_narrow(sums[b]);
        uint16_t *dst = y_row + block_column(b0 + b, half, mode);
        if (b < blocks - 1 || valid == LANES) _mm256_storeu_si256((__m256i *)dst, out);
        else _mm256_mask_storeu_epi16(dst, (__mmask16)((1u << valid) - 1), out);
    }
}

/* rows (<= MT) x blocks (<= NT) of y, from block b0 on (y: the tile's first row); `valid`
 * channels of the last block are stored. */
static inline __attribute__((always_inline)) void tile(const int rows, const int blocks, const uint16_t *x,
                                                       long x_stride, long pairs, const uint32_t *w,
                                                       long block_words, const float *bias, int valid,
                                                       uint16_t *y, long y_stride, long b0, long half, int mode)
{
    __m512 acc[MT][NT];
    for (int b = 0; b < blocks; b++) {
        const __m512 start = bias ? _mm512_loadu_ps(bias + b * LANES) : _mm512_setzero_ps();
        for (int m = 0; m < rows; m++) acc[m][b] = start;
    }
    for (long p = 0; p < pairs; p++) {
        __m512bh wv[NT];
        for (int b = 0; b < blocks; b++) wv[b] = (__m512bh)_mm512_loadu_si512(w + b * block_words + p * LANES);
        for (int m = 0; m < rows; m++) {
            uint32_t pair;
            memcpy(&pair, x + m * x_stride + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int b = 0; b < blocks; b++) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv[b], xv);
        }
    }
    for (int m = 0; m < rows; m++) store_row(acc[m], blocks, b0, valid, y + m * y_stride, half, mode);
}

/* Every tile shape, so that each loop above has constant bounds (registers, no spills). */
#define TILE_CASE(R, B) \
    case (R) * 8 + (B): tile(R, B, x, x_stride, pairs, w, block_words, bias, valid, y, y_stride, b0, half, mode); return;
static void tile_dispatch(int rows, int blocks, const uint16_t *x, long x_stride, long pairs, const uint32_t *w,
                          long block_words, const float *bias, int valid, uint16_t *y, long y_stride, long b0,
                          long half, int mode)
{
    switch (rows * 8 + blocks) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
        TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
        TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

/* AMX: tdpbf16ps multiplies a tile of up to 16 rows by 16 pairs of inputs (A: rows of 64 bytes)
 * with a tile of 16 pairs by 16 channels (B: 16 rows of 64 bytes) into 16 x 16 fp32 sums. The
 * layout's block is already B's format: its pairs p..p+15 are 1 KB of consecutive 64-byte rows,
 * so the same weights run here, read in place. One instruction does 256x the multiply-adds of a
 * vdpbf16ps. On a 2-core Xeon with AMX (bench/blocked_linear.py, M's and L's ten shapes) the
 * vector tiles ran 100-210 GFLOP/s from 16 rows on, whatever the row count, 0.08-0.74x oneDNN's
 * bf16 matmul (which runs on AMX); these tiles ran 0.98-1.42x the vector tiles at one row,
 * 2.0-3.8x at 16 rows, 3.5-5.9x at 64 and 4.4-10.5x at 2048: against oneDNN 1.15-1.71x at one
 * row, 0.99-1.55x at 16-64 rows and 0.60-1.38x at 256-2048.
 *
 * A step multiplies two row tiles (32 rows of x) by two blocks (32 channels): tiles 0-3 hold the
 * sums, 4-5 the rows' pairs, 6-7 the blocks' pairs. The sums start at the bias (a tile load with
 * stride 0 repeats its 16 values on every row), as the vector tile's do; they are rounded once,
 * at the store. Calls whose K is not a multiple of 32 (a tile's 16 pairs) take the vector path. */
#define AMX_ROWS 16         /* rows of a tile */
#define AMX_PAIRS 16        /* pairs of inputs a tile multiplies */
#define AMX_CHUNK_BYTES (1L << 20)  /* a chunk of x this large or smaller stays in L2 (amx_linear) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_enabled = -1;  /* -1: not asked yet; the process's permission is asked once */

/* Whether the AMX tiles run the bf16 kernels (this file's and prefill_attention.c's): `on` 1
 * asks for them, 0 turns them off, -1 only asks (the first time). Linux lets a process use the
 * tiles' 8 KB of state only after asking (arch_prctl). */
int strata_amx(int on)
{
    if (on == 0) amx_enabled = 0;
    else if (on == 1 || amx_enabled == -1)
        amx_enabled = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_enabled;
}

struct amx_config {  /* ldtilecfg's 64 bytes, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* This thread's tiles, every row 64 bytes: 0-1 and 4 of rows0 rows, 2-3 and 5 of rows1 (at
 * least 1), 6-7 of 16 (a block's 16 pairs). */
void strata_amx_configure(int rows0, int rows1)
{
    struct amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, AMX_PAIRS, AMX_PAIRS};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(rows[t] ? rows[t] : 1);
        cfg.bytes_per_row[t] = 64;
    }
    /* not _tile_loadconfig: gcc 12's tells the compiler it reads 8 bytes, so the stores of the
     * rows and widths were dropped as dead and ldtilecfg faulted on the stack's garbage */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

/* The product of a step's tiles, rows of `rows` sums in `sums` (row r's block b at r * 32 + 16 b),
 * written to y as the vector tile writes its registers. */
static void amx_store(const float *sums, int rows, int blocks, int valid, uint16_t *y, long y_stride, long b0,
                      long half, int mode)
{
    for (int m = 0; m < rows; m++) {
        const __m512 row[2] = {_mm512_loadu_ps(sums + m * 2 * LANES), _mm512_loadu_ps(sums + m * 2 * LANES + LANES)};
        store_row(row, blocks, b0, valid, y + m * y_stride, half, mode);
    }
}

/* rows0 + rows1 rows (as configured) of x by blocks (1 or 2) of w from block b0 on. */
static void amx_step(int rows0, int rows1, int blocks, const uint16_t *x, long x_stride, long pairs,
                     const uint32_t *w, long block_words, const float *bias, int valid, uint16_t *y, long y_stride,
                     long b0, long half, int mode)
{
    const long xs = x_stride * 2;  /* bytes */
    const uint16_t *x1 = x + AMX_ROWS * x_stride;
    const uint32_t *w1 = w + block_words;
    if (bias) {
        _tile_loadd(0, bias, 0); _tile_loadd(2, bias, 0);
        if (blocks > 1) { _tile_loadd(1, bias + LANES, 0); _tile_loadd(3, bias + LANES, 0); }
    } else {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    }
    for (long p = 0; p < pairs; p += AMX_PAIRS) {
        _tile_loadd(4, x + 2 * p, xs);
        _tile_loadd(6, w + p * LANES, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (blocks > 1) { _tile_loadd(7, w1 + p * LANES, 64); _tile_dpbf16ps(1, 4, 7); }
        if (rows1) {
            _tile_loadd(5, x1 + 2 * p, xs);
            _tile_dpbf16ps(2, 5, 6);
            if (blocks > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float sums[AMX_ROWS][2 * LANES];
    _tile_stored(0, &sums[0][0], sizeof sums[0]);
    if (blocks > 1) _tile_stored(1, &sums[0][LANES], sizeof sums[0]);
    amx_store(&sums[0][0], rows0, blocks, valid, y, y_stride, b0, half, mode);
    if (rows1) {
        _tile_stored(2, &sums[0][0], sizeof sums[0]);
        if (blocks > 1) _tile_stored(3, &sums[0][LANES], sizeof sums[0]);
        amx_store(&sums[0][0], rows1, blocks, valid, y + AMX_ROWS * y_stride, y_stride, b0, half, mode);
    }
}

/* strata_blocked_linear_bf16's work on the tiles: the same items (a group of NT blocks by a chunk
 * of rows), claimed the same way, each walked in steps of 32 rows by 2 blocks. Where a chunk of x
 * fits in half the L2 (K up to 2048), items are numbered chunk-major: a thread's next item reads
 * the chunk of x from its L2 and only the next group's slab of W from memory. Numbered group-major
 * as on the vector tiles, each item read its chunk of x anew (2048 rows of L's gate/up: 152 x 3.6
 * MB); the tiles waited on it. In the engine, ad hoc (two builds alternating in one process, 7
 * rounds' median), a 2048-token prefill ran 1.085x (L) and 1.08x (M) as fast, 16 prompts of 128
 * tokens 1.07x and 1.10x. The vector tiles, bound by their multiply-adds, do not wait on x. */
static void amx_linear(const uint16_t *x, long M, long x_stride, long pairs, const uint32_t *w, long N,
                       long n_blocks, long groups, long chunks, long items, long claim, const float *bias,
                       uint16_t *y, long y_stride, int num_threads, long half, int mode)
{
    const long block_words = pairs * LANES;
    const int chunk_major = ROW_CHUNK * pairs * 4 <= AMX_CHUNK_BYTES;
    #pragma omp parallel num_threads(num_threads) if(items > 1)
    {
        int configured = -1;  /* this thread's tiles' rows (rows0 * 32 + rows1) */
        #pragma omp for schedule(dynamic, claim)
        for (long item = 0; item < items; item++) {
            const long g = chunk_major ? item % groups : item / chunks;
            const long chunk = chunk_major ? item / groups : item % chunks;
            const long g0 = g * NT, g_blocks = n_blocks - g0 < NT ? n_blocks - g0 : NT;
            const long r_end = (chunk + 1) * ROW_CHUNK < M ? (chunk + 1) * ROW_CHUNK : M;
            for (long r = chunk * ROW_CHUNK; r < r_end; r += 2 * AMX_ROWS) {
                const long left = r_end - r;
                const int rows0 = left < AMX_ROWS ? (int)left : AMX_ROWS;
                const int rows1 = left - rows0 < AMX_ROWS ? (int)(left - rows0) : AMX_ROWS;
                if (configured != rows0 * 32 + rows1) {
                    strata_amx_configure(rows0, rows1);
                    configured = rows0 * 32 + rows1;
                }
                for (long b0 = g0; b0 < g0 + g_blocks; b0 += 2) {
                    const int blocks = g0 + g_blocks - b0 < 2 ? 1 : 2;
                    const long last = N - (b0 + blocks - 1) * LANES;
                    amx_step(rows0, rows1, blocks, x + r * x_stride, x_stride, pairs, w + b0 * block_words,
                             block_words, bias ? bias + b0 * LANES : NULL, last < LANES ? (int)last : LANES,
                             y + r * y_stride, y_stride, b0, half, mode);
                }
            }
        }
        if (configured != -1) _tile_release();
    }
}
#else
int strata_amx(int on) { (void)on; return 0; }
void strata_amx_configure(int rows0, int rows1) { (void)rows0; (void)rows1; }
#endif

/* x: [M][K] bf16, rows x_stride apart (K even); w: the blocked layout of an [N][K] weight (for
 * modes GATED and GATED_SWIGLU, gate/up interleaved: N = 2h, h a multiple of 16); bias: fp32 [N
 * padded to 16], in the layout's order, or NULL; y: [M][N] bf16 ([M][N / 2] for GATED_SWIGLU),
 * rows y_stride apart. Returns 0; -1 where this CPU has no AVX512-BF16 (the caller checked
 * _available first); -2 for a mode the weight's shape does not allow. */
int strata_blocked_linear_bf16(const uint16_t *x, long M, long K, long x_stride, const uint32_t *w, long N,
                               const float *bias, uint16_t *y, long y_stride, int num_threads, int mode)
{
#if defined(__AVX512BF16__)
    if (mode != PLAIN && (N % (2 * LANES) || (mode != GATED && mode != GATED_SWIGLU))) return -2;
    const long pairs = K / 2, block_words = pairs * LANES, half = N / 2;
    const long n_blocks = (N + LANES - 1) / LANES, groups = (n_blocks + NT - 1) / NT;
    const long chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK, items = groups * chunks;
    const long claim = items / ((num_threads > 1 ? num_threads : 1) * (long)CLAIMS_PER_THREAD) + 1;
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx_enabled == 1 && pairs % AMX_PAIRS == 0) {
        amx_linear(x, M, x_stride, pairs, w, N, n_blocks, groups, chunks, items, claim, bias, y, y_stride,
                   num_threads, half, mode);
        return 0;
    }
#endif
    #pragma omp parallel for schedule(dynamic, claim) num_threads(num_threads) if(items > 1)
    for (long item = 0; item < items; item++) {
        const long g = item / chunks, chunk = item % chunks;
        const long b0 = g * NT, blocks = n_blocks - b0 < NT ? n_blocks - b0 : NT;
        const long n0 = b0 * LANES, last = N - (b0 + blocks - 1) * LANES;
        const int valid = last < LANES ? (int)last : LANES;
        const long r_end = (chunk + 1) * ROW_CHUNK < M ? (chunk + 1) * ROW_CHUNK : M;
        for (long r = chunk * ROW_CHUNK; r < r_end; r += MT) {
            const int rows = r_end - r < MT ? (int)(r_end - r) : MT;
            tile_dispatch(rows, (int)blocks, x + r * x_stride, x_stride, pairs, w + b0 * block_words, block_words,
                          bias ? bias + n0 : NULL, valid, y + r * y_stride, y_stride, b0, half, mode);
        }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)x_stride; (void)w; (void)N; (void)bias; (void)y; (void)y_stride;
    (void)num_threads; (void)mode;
    return -1;
#endif
}

/* fp32 activations over the same layout (strata_blocked_linear_f32), for CPUs without bf16
 * instructions that run a model in fp32 whose weights are bf16 values (a bf16 checkpoint upcast:
 * the weights lose nothing held as bf16). The products are the fp32 products of the upcast
 * weights, from half the bytes. A pair word w holds W[c, 2p] in its low half and W[c, 2p+1] in
 * its high half, so w << 16 and w & 0xffff0000 are the two fp32 weights.
 *
 * Work: the blocks of 16 channels run in groups (f32_group_blocks), which the threads claim one at
 * a time; a group is walked once per pass of F32_KC inputs (the pass's slice of a tile's rows stays
 * in L1) and F32_MC rows. y holds
 * the sums between passes (fp32 to fp32: exact), so every output is summed from its bias in input
 * order whatever the tile, path or thread count: a row gets the same bits in any batch.
 *
 * Two tiles (AVX2: 16 vector registers):
 * - direct (decode batches, fewer than F32_PANEL_ROWS rows): up to 5 rows by one block, one row
 *   by 4 blocks or two or three rows by 2 (8 or more sums in flight), straight from the pair
 *   words: each pair's words are loaded, shifted for the even input, then loaded again and masked
 *   for the odd one, so that only two registers of weights are live beside at most 12 sums.
 * - panel (prefill chunks): a block's pass of words is first widened to fp32 (16 KB, in L1; once
 *   a pass of rows), then tiles of 6 rows by 16 channels (12 sums, the usual AVX2 sgemm tile) run
 *   over it, each step 2 loads, 6 broadcasts and 12 FMAs. At 64-2048 rows this runs 0.97-1.25x as
 *   fast as oneDNN's fp32 matmul on M's and L's shapes on a Zen 3 (bench/blocked_linear.py --fp32).
 * With AVX-512 (32 registers of 16 lanes) one direct tile of up to 12 rows by 2 blocks takes every
 * call (direct_tile_z). Against oneDNN's 512-bit fp32 matmul it wins at decode batches and loses
 * at prefill chunks, where the engine keeps oneDNN (services/engine/linear.py, SMALL_CALL_ROWS).
 */
#if defined(__AVX2__) && defined(__FMA__)
#include <omp.h>

#define F32_KC 256        /* inputs per pass (even) */
#define F32_MC 120        /* rows per pass over a block: a multiple of both tile heights */
#define F32_PANEL_ROWS 64 /* calls of this many rows or more take the panel tile */
/* Tiles of one or two blocks read one or two streams of weights, which the hardware prefetchers
 * (stopping at every 4 KB page) leave short of the memory's bandwidth: those tiles fetch ahead
 * themselves. In an ad-hoc A/B on Zen 3 (M's and L's shapes) this ran 1.2-1.5x as fast at 4 rows
 * and up to 1.4x at 2, 8 and 16, though one run of three showed nothing; 48 and 64 pairs ran
 * alike, 96 slower; the one-row tile (4 streams, at the memory's bandwidth) lost. */
#define F32_PREFETCH_PAIRS 48
/* Each pass resumes the sums in y. For a wide weight they came back from memory every pass (L's
 * lm_head: 64 rows of sums are 39 MB), each tile waiting on its first loads. Up to F32_MC rows, a
 * thread's blocks run in groups of at most this many bytes of sums, each group's passes before the
 * next group: at 4-64 rows L's lm_head ran 1.14-1.28x as fast (Zen 3, ad-hoc A/B; 128 KB ran
 * alike, 512 KB slower), the other shapes within the noise. */
#define F32_GROUP_Y_BYTES (32 * 1024)
#define DIRECT_ROWS 5
#define PANEL_ROWS 6
/* Every loop over a tile's rows and blocks is unrolled before gcc scalarizes the sums: left to its
 * heuristics, they stayed in memory, a store each step, and the direct tile ran 1.5x slower. */
#define UNROLLED _Pragma("GCC unroll 8")

static inline __attribute__((always_inline)) void direct_tile(const int rows, const int blocks, const float *x,
                                                              long x_stride, const uint32_t *w, long block_words,
                                                              long pairs, const float *bias, int resume, float *y,
                                                              long y_stride)
{
    __m256 acc[6][2]; /* rows * blocks <= 6 */
#define SUM(m, b) acc[(m) * blocks + (b)]
    UNROLLED for (int m = 0; m < rows; m++)
        UNROLLED for (int b = 0; b < blocks; b++) {
            if (resume) {
                SUM(m, b)[0] = _mm256_loadu_ps(y + m * y_stride + b * LANES);
                SUM(m, b)[1] = _mm256_loadu_ps(y + m * y_stride + b * LANES + 8);
            } else if (bias) {
                SUM(m, b)[0] = _mm256_loadu_ps(bias + b * LANES);
                SUM(m, b)[1] = _mm256_loadu_ps(bias + b * LANES + 8);
            } else {
                SUM(m, b)[0] = SUM(m, b)[1] = _mm256_setzero_ps();
            }
        }
    const float *xr[DIRECT_ROWS];
    UNROLLED for (int m = 0; m < rows; m++) xr[m] = x + m * x_stride;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    /* near the pass's last pair, the prefetches run on into the next blocks' words for this pass */
    const long next_tile = blocks * block_words - pairs * LANES;
    #pragma GCC unroll 2
    for (long p = 0; p < pairs; p++)
        UNROLLED for (int b = 0; b < blocks; b++) {
            const __m256i *words = (const __m256i *)(w + b * block_words + p * LANES);
            if (blocks <= 2) /* a pair of a block is one cache line: fetch the one F32_PREFETCH_PAIRS on */
                _mm_prefetch((const char *)((const uint32_t *)words + (p + F32_PREFETCH_PAIRS < pairs ? 0 : next_tile)
                                            + F32_PREFETCH_PAIRS * LANES), _MM_HINT_T0);
            __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(words), 16));
            __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(words + 1), 16));
            UNROLLED for (int m = 0; m < rows; m++) {
                const __m256 xv = _mm256_broadcast_ss(xr[m] + 2 * p);
                SUM(m, b)[0] = _mm256_fmadd_ps(xv, w0, SUM(m, b)[0]);
                SUM(m, b)[1] = _mm256_fmadd_ps(xv, w1, SUM(m, b)[1]);
            }
            w0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(words), high));
            w1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(words + 1), high));
            UNROLLED for (int m = 0; m < rows; m++) {
                const __m256 xv = _mm256_broadcast_ss(xr[m] + 2 * p + 1);
                SUM(m, b)[0] = _mm256_fmadd_ps(xv, w0, SUM(m, b)[0]);
                SUM(m, b)[1] = _mm256_fmadd_ps(xv, w1, SUM(m, b)[1]);
            }
        }
    UNROLLED for (int m = 0; m < rows; m++)
        UNROLLED for (int b = 0; b < blocks; b++) {
            _mm256_storeu_ps(y + m * y_stride + b * LANES, SUM(m, b)[0]);
            _mm256_storeu_ps(y + m * y_stride + b * LANES + 8, SUM(m, b)[1]);
        }
#undef SUM
}

/* panel: [inputs][16] fp32, one block's weights for this pass */
static inline __attribute__((always_inline)) void panel_tile(const int rows, const float *x, long x_stride,
                                                             const float *panel, long inputs, const float *bias,
                                                             int resume, float *y, long y_stride)
{
    __m256 acc[PANEL_ROWS][2];
    for (int m = 0; m < rows; m++)
        for (int h = 0; h < 2; h++) {
            if (resume) acc[m][h] = _mm256_loadu_ps(y + m * y_stride + 8 * h);
            else if (bias) acc[m][h] = _mm256_loadu_ps(bias + 8 * h);
            else acc[m][h] = _mm256_setzero_ps();
        }
    #pragma GCC unroll 4
    for (long k = 0; k < inputs; k++) {
        const __m256 w0 = _mm256_load_ps(panel + k * LANES), w1 = _mm256_load_ps(panel + k * LANES + 8);
        for (int m = 0; m < rows; m++) {
            const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + k);
            acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) {
        _mm256_storeu_ps(y + m * y_stride, acc[m][0]);
        _mm256_storeu_ps(y + m * y_stride + 8, acc[m][1]);
    }
}

/* One block's words for `pairs` pairs -> panel [2 * pairs][16] fp32. */
static void widen(const uint32_t *w, long pairs, float *panel)
{
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (long p = 0; p < pairs; p++)
        for (int h = 0; h < 2; h++) {
            const __m256i words = _mm256_loadu_si256((const __m256i *)(w + p * LANES + 8 * h));
            _mm256_store_si256((__m256i *)(panel + 2 * p * LANES + 8 * h), _mm256_slli_epi32(words, 16));
            _mm256_store_si256((__m256i *)(panel + (2 * p + 1) * LANES + 8 * h), _mm256_and_si256(words, high));
        }
}

#if defined(__AVX512F__)
/* AVX-512: a block's 16 sums in one register. Up to Z_ROWS rows by two blocks (one row by four)
 * hold 24 sums; a pair's weights are widened once into four registers and each row's two inputs
 * broadcast once, so the shifts and masks are 4 of every 52 instructions and no fp32 panel is
 * needed. Each sum adds its inputs in order, as the AVX2 tiles do: the same bits. */
#define Z_ROWS 12
/* unrolled fully (12 rows): at gcc's default 8 the sums stayed in memory and 32 rows ran 2x slower */
#define Z_UNROLLED _Pragma("GCC unroll 16")
static inline __attribute__((always_inline)) void direct_tile_z(const int rows, const int blocks, const float *x,
                                                                long x_stride, const uint32_t *w, long block_words,
                                                                long pairs, const float *bias, int resume, float *y,
                                                                long y_stride)
{
    __m512 acc[Z_ROWS * 2]; /* rows * blocks <= 24 */
#define SUM(m, b) acc[(m) * blocks + (b)]
    Z_UNROLLED for (int m = 0; m < rows; m++)
        Z_UNROLLED for (int b = 0; b < blocks; b++)
            SUM(m, b) = resume ? _mm512_loadu_ps(y + m * y_stride + b * LANES)
                        : bias ? _mm512_loadu_ps(bias + b * LANES) : _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    const long next_tile = blocks * block_words - pairs * LANES;
    for (long p = 0; p < pairs; p++) {
        __m512 w0[4], w1[4];
        Z_UNROLLED for (int b = 0; b < blocks; b++) {
            const uint32_t *words = w + b * block_words + p * LANES;
            if (blocks <= 2)
                _mm_prefetch((const char *)(words + (p + F32_PREFETCH_PAIRS < pairs ? 0 : next_tile)
                                            + F32_PREFETCH_PAIRS * LANES), _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512(words);
            w0[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            w1[b] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        Z_UNROLLED for (int m = 0; m < rows; m++) {
            const __m512 even = _mm512_set1_ps(x[m * x_stride + 2 * p]);
            const __m512 odd = _mm512_set1_ps(x[m * x_stride + 2 * p + 1]);
            Z_UNROLLED for (int b = 0; b < blocks; b++) SUM(m, b) = _mm512_fmadd_ps(even, w0[b], SUM(m, b));
            Z_UNROLLED for (int b = 0; b < blocks; b++) SUM(m, b) = _mm512_fmadd_ps(odd, w1[b], SUM(m, b));
        }
    }
    Z_UNROLLED for (int m = 0; m < rows; m++)
        Z_UNROLLED for (int b = 0; b < blocks; b++) _mm512_storeu_ps(y + m * y_stride + b * LANES, SUM(m, b));
#undef SUM
}

#define Z_CASE(R, B) \
    case (R) * 8 + (B): direct_tile_z(R, B, x, x_stride, w, block_words, inputs / 2, bias, resume, y, y_stride); return;
static void tile_dispatch_f32(const float *panel, int rows, int blocks, const float *x, long x_stride,
                              const uint32_t *w, long block_words, long inputs, const float *bias, int resume,
                              float *y, long y_stride)
{
    (void)panel;
    switch (rows * 8 + blocks) {
        Z_CASE(1, 1) Z_CASE(1, 2) Z_CASE(1, 3) Z_CASE(1, 4)
        Z_CASE(2, 1) Z_CASE(3, 1) Z_CASE(4, 1) Z_CASE(5, 1) Z_CASE(6, 1) Z_CASE(7, 1) Z_CASE(8, 1)
        Z_CASE(9, 1) Z_CASE(10, 1) Z_CASE(11, 1) Z_CASE(12, 1)
        Z_CASE(2, 2) Z_CASE(3, 2) Z_CASE(4, 2) Z_CASE(5, 2) Z_CASE(6, 2) Z_CASE(7, 2) Z_CASE(8, 2)
        Z_CASE(9, 2) Z_CASE(10, 2) Z_CASE(11, 2) Z_CASE(12, 2)
    }
}
#define TILE_MAX_SUMS (Z_ROWS * 2)
#else
/* Every tile shape, so that each loop above has constant bounds (registers, no spills). */
#define DIRECT_CASE(R, B) \
    case (R) * 8 + (B): direct_tile(R, B, x, x_stride, w, block_words, inputs / 2, bias, resume, y, y_stride); return;
#define PANEL_CASE(R) \
    case 64 + (R) * 8 + 1: panel_tile(R, x, x_stride, panel, inputs, bias, resume, y, y_stride); return;
static void tile_dispatch_f32(const float *panel, int rows, int blocks, const float *x, long x_stride,
                              const uint32_t *w, long block_words, long inputs, const float *bias, int resume,
                              float *y, long y_stride)
{
    switch ((panel ? 64 : 0) + rows * 8 + blocks) {
        DIRECT_CASE(1, 1) DIRECT_CASE(1, 2) DIRECT_CASE(1, 3) DIRECT_CASE(1, 4)
        DIRECT_CASE(2, 1) DIRECT_CASE(2, 2) DIRECT_CASE(3, 1) DIRECT_CASE(3, 2) DIRECT_CASE(4, 1) DIRECT_CASE(5, 1)
        PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6)
    }
}
#define TILE_MAX_SUMS (PANEL_ROWS * 4)
#endif

/* A tile whose last block is N's partial one runs on a scratch copy of its outputs (whole blocks)
 * and stores the `valid` channels of that block back. */
static void tile_f32(const float *panel, int rows, int blocks, const float *x, long x_stride, const uint32_t *w,
                     long block_words, long inputs, const float *bias, int resume, float *y, long y_stride,
                     int valid)
{
    if (valid == LANES) {
        tile_dispatch_f32(panel, rows, blocks, x, x_stride, w, block_words, inputs, bias, resume, y, y_stride);
        return;
    }
    float scratch[TILE_MAX_SUMS * LANES];
    const long width = (long)blocks * LANES, used = width - LANES + valid;
    for (int m = 0; m < rows && resume; m++) memcpy(scratch + m * width, y + m * y_stride, (size_t)used * sizeof *y);
    tile_dispatch_f32(panel, rows, blocks, x, x_stride, w, block_words, inputs, bias, resume, scratch, width);
    for (int m = 0; m < rows; m++) memcpy(y + m * y_stride, scratch + m * width, (size_t)used * sizeof *y);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Blocks a group of a decode batch (up to F32_MC rows): as many as keep F32_GROUP_Y_BYTES of sums
 * in cache between passes, and few enough that each thread has CLAIMS_PER_THREAD of them; whole
 * tiles, or an even split of a small weight. */
static long f32_group_blocks(long M, long n_blocks, long tile_blocks, long threads)
{
    long group = F32_GROUP_Y_BYTES / (M * LANES * (long)sizeof(float));
    const long share = n_blocks / (threads * CLAIMS_PER_THREAD);
    if (group > share) group = share;
    if (group >= tile_blocks) return group / tile_blocks * tile_blocks;
    const long even = (n_blocks + threads - 1) / threads;
    return even < tile_blocks ? even : tile_blocks;
}

/* Blocks [j_begin, j_end) over all of x: pass by pass of F32_KC inputs, F32_MC rows at a time. */
static inline void f32_blocks(long j_begin, long j_end, const float *x, long M, long K, long x_stride,
                              const uint32_t *w, long block_words, long N, const float *bias, float *y,
                              long y_stride, int tile_blocks, int tile_rows, float *panel)
{
    for (long k0 = 0; k0 < K; k0 += F32_KC) {
        const long inputs = K - k0 < F32_KC ? K - k0 : F32_KC;
        for (long i0 = 0; i0 < M; i0 += F32_MC) {
            const long i_end = i0 + F32_MC < M ? i0 + F32_MC : M;
            for (long j = j_begin; j < j_end; j += tile_blocks) {
                const int blocks = j_end - j < tile_blocks ? (int)(j_end - j) : tile_blocks;
                const uint32_t *wj = w + j * block_words + k0 / 2 * LANES;
                const long last = N - (j + blocks - 1) * LANES;
                if (panel) widen(wj, inputs / 2, panel);
                /* the pass's rows in as few tiles as tile_rows allows, of near-equal heights: a thin
                 * last tile (16 rows as 5+5+5+1) has too few sums to keep the FMA units busy */
                const long tiles = (i_end - i0 + tile_rows - 1) / tile_rows;
                for (long t_i = 0, i = i0; t_i < tiles; t_i++) {
                    const long i_next = i0 + (i_end - i0) * (t_i + 1) / tiles;
                    tile_f32(panel, (int)(i_next - i), blocks, x + i * x_stride + k0, x_stride, wj, block_words,
                             inputs, bias ? bias + j * LANES : NULL, k0 > 0, y + i * y_stride + j * LANES,
                             y_stride, last < LANES ? (int)last : LANES);
                    i = i_next;
                }
            }
        }
    }
}
#endif

/* x: [M][K] fp32, rows x_stride apart (K even); w: the blocked layout of an [N][K] weight (mode
 * PLAIN); bias: fp32 [N padded to 16] or NULL; y: [M][N] fp32, rows y_stride apart. Returns 0;
 * -1 where this CPU has no AVX2 and FMA (the caller checked _f32_available first). */
int strata_blocked_linear_f32(const float *x, long M, long K, long x_stride, const uint32_t *w, long N,
                              const float *bias, float *y, long y_stride, int num_threads)
{
#if defined(__AVX2__) && defined(__FMA__)
    if (M <= 0) return 0;
    const long block_words = K / 2 * LANES, n_blocks = (N + LANES - 1) / LANES;
#if defined(__AVX512F__)
    const int panel = 0;
    const int tile_blocks = M == 1 ? 4 : 2, tile_rows = Z_ROWS;
#else
    const int panel = M >= F32_PANEL_ROWS;
    /* one row runs over 4 blocks and two or three over 2, so that 8 to 12 sums are in flight: with
     * fewer, each sum's chain of FMAs waits on the last (2 and 3 rows ran 1.2-1.3x slower) */
    const int tile_blocks = M == 1 ? 4 : M <= 3 ? 2 : 1;
    const int tile_rows = panel ? PANEL_ROWS : DIRECT_ROWS; /* the most a tile takes: passes split evenly */
#endif
    /* A prefill chunk (more than F32_MC rows) splits the blocks in halves: each pass's slice of x
     * serves all of a thread's blocks from cache. In claimed groups x came back from memory for
     * each group: over M's and L's shapes at 1024-2048 rows 0.87-0.95x as fast, L's down projection
     * 0.69-0.77x (ad hoc, AVX-512). A decode batch's groups are claimed in turn. */
    const int split = M > F32_MC;
    const long group = split ? 0 : f32_group_blocks(M, n_blocks, tile_blocks, num_threads > 1 ? num_threads : 1);
    #pragma omp parallel num_threads(num_threads) if(split ? n_blocks > 1 : group < n_blocks)
    {
        float panel_buf[F32_KC * LANES] __attribute__((aligned(32)));
        float *panel_arg = panel ? panel_buf : NULL;
        if (split) {
            const long t = omp_get_thread_num(), threads = omp_get_num_threads();
            f32_blocks(n_blocks * t / threads, n_blocks * (t + 1) / threads, x, M, K, x_stride, w, block_words, N,
                       bias, y, y_stride, tile_blocks, tile_rows, panel_arg);
        } else {
            #pragma omp for schedule(dynamic, 1) nowait
            for (long g = 0; g < n_blocks; g += group)
                f32_blocks(g, g + group < n_blocks ? g + group : n_blocks, x, M, K, x_stride, w, block_words, N,
                           bias, y, y_stride, tile_blocks, tile_rows, panel_arg);
        }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)x_stride; (void)w; (void)N; (void)bias; (void)y; (void)y_stride;
    (void)num_threads;
    return -1;
#endif
}
