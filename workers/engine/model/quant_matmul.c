/* y = x W^T with W kept as GGUF's quantized blocks (float32 activations, CPU).
 *
 * Built and loaded by workers/engine/model/quant_linear.py (the same build
 * cache as paged_decode.c); plain C with GCC vector extensions, OpenMP from
 * torch's libgomp.
 *
 * W is N rows of K weights in blocks of 32; block b of row n holds
 *   w[k] = scale[n, b] * q[k] + zero[n, b]
 * with q either 4-bit (Q4_0: zero = -8 scale; Q4_1: scale d, zero m; Q4_K:
 * each 32-weight sub-block's effective scale and min) or 8-bit signed (Q8_0:
 * zero = 0). These are the file's numbers: scale * q + zero is the float
 * gguf's dequantization gives, so only the order of the sums differs from
 * the float32 path, never the weights.
 *
 * 4-bit blocks keep GGUF's nibble order: byte j (0..15) of a block holds
 * q[j] in its low nibble and q[j + 16] in its high one. A block is expanded
 * to 32 floats in registers once and used for every row of x (M of them: one
 * for a lone decode, hundreds in a prefill), so a weight is read from memory
 * once a call, at 4.5 (or 8.5) bits instead of float32's 32.
 *
 * Work is split over N in chunks of whole output columns; a call too small
 * to pay for a parallel region (a thread wake-up costs more than a small
 * decode matmul) runs on the calling thread alone.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef uint8_t vu8 __attribute__((vector_size(16), aligned(1)));
typedef int8_t vi8 __attribute__((vector_size(16), aligned(1)));
typedef int32_t vi32 __attribute__((vector_size(64)));

#define BLOCK 32
#define ROW_TILE 8              /* rows of x accumulated together: 8 vectors of accumulators */
#define PARALLEL_MIN_WORK (1L << 20) /* weights x rows below which one thread does the call */

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The 32 weights of one block as two float vectors (elements 0..15 and 16..31). */
static inline void expand_q4(const uint8_t *qs, float scale, float zero, vf *lo, vf *hi) {
    vu8 bytes;
    memcpy(&bytes, qs, 16);
    /* Through int32: gcc turns u8 -> float lane by lane, u8 -> i32 -> float into two instructions. */
    *lo = __builtin_convertvector(__builtin_convertvector(bytes & 15, vi32), vf) * scale + zero;
    *hi = __builtin_convertvector(__builtin_convertvector(bytes >> 4, vi32), vf) * scale + zero;
}

static inline void expand_q8(const int8_t *qs, float scale, vf *lo, vf *hi) {
    vi8 a, b;
    memcpy(&a, qs, 16);
    memcpy(&b, qs + 16, 16);
    *lo = __builtin_convertvector(__builtin_convertvector(a, vi32), vf) * scale;
    *hi = __builtin_convertvector(__builtin_convertvector(b, vi32), vf) * scale;
}

/* Columns [n0, n1) of y for rows [m0, m0 + rows) of x, rows <= ROW_TILE. Inlined at call sites
 * with a constant ``rows`` (a full tile, a lone row) so the accumulators live in registers. */
static inline __attribute__((always_inline)) void columns(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t m0, int64_t rows,
                    const uint8_t *qs, const float *scale, const float *zero, int bits, int64_t n0, int64_t n1,
                    int64_t k) {
    const int64_t blocks = k / BLOCK;
    const int64_t row_bytes = bits == 4 ? k / 2 : k;
    for (int64_t n = n0; n < n1; n++) {
        vf acc[ROW_TILE];
        for (int64_t r = 0; r < rows; r++) acc[r] = (vf){0};
        const uint8_t *wq = qs + n * row_bytes;
        const float *ws = scale + n * blocks;
        const float *wz = zero ? zero + n * blocks : 0;
        for (int64_t b = 0; b < blocks; b++) {
            vf lo, hi;
            if (bits == 4)
                expand_q4(wq + b * 16, ws[b], wz[b], &lo, &hi);
            else
                expand_q8((const int8_t *)wq + b * BLOCK, ws[b], &lo, &hi);
            const float *xb = x + m0 * x_stride + b * BLOCK;
            for (int64_t r = 0; r < rows; r++)
                acc[r] += lo * load_vf(xb + r * x_stride) + hi * load_vf(xb + r * x_stride + 16);
        }
        for (int64_t r = 0; r < rows; r++) y[(m0 + r) * y_stride + n] = hsum(acc[r]);
    }
}

/* y (M, N) = x (M, K) W^T; K a multiple of 32; rows of x and y contiguous, strides in floats. */
void quant_matmul(const float *x, int64_t x_stride, float *y, int64_t y_stride, const uint8_t *qs,
                  const float *scale, const float *zero, int64_t bits, int64_t m, int64_t n, int64_t k) {
    const int threads = m * n * k >= PARALLEL_MIN_WORK ? omp_get_max_threads() : 1;
    /* Chunks of 16 columns: many more chunks than threads, and a chunk's weights (16 rows of K)
     * stay in L1/L2 while every row tile of x passes over them. */
    const int64_t chunk = 16;
    const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * chunk, n1 = n0 + chunk < n ? n0 + chunk : n;
        for (int64_t m0 = 0; m0 < m; m0 += ROW_TILE) {
            const int64_t rows = m - m0 < ROW_TILE ? m - m0 : ROW_TILE;
            if (rows == ROW_TILE)
                columns(x, x_stride, y, y_stride, m0, ROW_TILE, qs, scale, zero, (int)bits, n0, n1, k);
            else if (rows == 1)
                columns(x, x_stride, y, y_stride, m0, 1, qs, scale, zero, (int)bits, n0, n1, k);
            else
                columns(x, x_stride, y, y_stride, m0, rows, qs, scale, zero, (int)bits, n0, n1, k);
        }
    }
}

/* out (N, K) float32 = W: for a prefill, where a float matmul over the expanded weights (oneDNN /
 * MKL, blocked for the cache) beats expanding each block in registers for every tile of rows. */
void quant_dequantize(const uint8_t *qs, const float *scale, const float *zero, int64_t bits, int64_t n,
                      int64_t k, float *out) {
    const int64_t blocks = k / BLOCK;
    const int64_t row_bytes = bits == 4 ? k / 2 : k;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < n; row++) {
        for (int64_t b = 0; b < blocks; b++) {
            vf lo, hi;
            if (bits == 4)
                expand_q4(qs + row * row_bytes + b * 16, scale[row * blocks + b], zero[row * blocks + b], &lo, &hi);
            else
                expand_q8((const int8_t *)qs + row * row_bytes + b * BLOCK, scale[row * blocks + b], &lo, &hi);
            memcpy(out + row * k + b * BLOCK, &lo, sizeof lo);
            memcpy(out + row * k + b * BLOCK + 16, &hi, sizeof hi);
        }
    }
}
