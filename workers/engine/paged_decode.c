/* Decode attention that reads the paged KV pool in place (float32, CPU).
 *
 * Built and loaded by workers/engine/native_attention.py; plain C with GCC
 * vector extensions and no torch headers, so it compiles in well under a
 * second, and OpenMP from the libgomp torch has already loaded (same
 * soname), so its threads are torch's.
 *
 * Decode d has one query, row rows[d] of `query` (H heads of D floats), and
 * attends keys [0, context_lens[d]) of its sequence: key position p lives in
 * slot p % BS of block block_tables[d * table_stride + p / BS] of the pool
 * (NB, BS, KVH, D). A work item is one decode (or part of its KV heads when
 * decodes are fewer than threads); items run in parallel. The gather-then-
 * SDPA path this replaces writes the gathered K/V (tens of MB per step) and
 * reads them back; this reads each block once, in order, at close to the
 * machine's memory bandwidth (see attend_heads).
 *
 * Per query head, three passes over its keys, LANES positions (one vector)
 * at a time: scores q . k (the LANES dot products of a run reduced together
 * by a shuffle tree, not one horizontal sum each), exp(score - max) and their
 * sum, then the weighted sum of the values. The caller guarantees D % 16 == 0
 * and BS % 16 == 0 (native_attention.kernel_supports), so D and BS are whole
 * runs at either width.
 *
 * LANES is the target's float vector: 16 (one AVX-512 register), or 8 where
 * the widest is AVX2's 256 bits. A 16-float vector there is two registers,
 * and its cross-register shuffles and spills made the kernel 6x slower than
 * at 8 (2-core EPYC, -mno-avx512f: 2.4 ms vs 0.4 ms for 32 decodes).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef LANES
#if defined(__AVX2__) && !defined(__AVX512F__)
#define LANES 8
#else
#define LANES 16
#endif
#endif
#define MASKED_SCORE (-3.0e38f) /* a padding lane's score: below any real one, finite */

/* aligned(4): loads through these types may be unaligned (rows of the pool are 4-byte aligned) */
typedef float vf __attribute__((vector_size(4 * LANES), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * LANES), aligned(4)));

static inline vf splat(float x) { return (vf){0} + x; }

/* Lane by lane: a where mask is all ones, else b. */
static inline vf blend(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* exp(x) for x <= 0 (scores minus their maximum), ~2 ulp: Cephes' expf
 * polynomial on x = n ln2 + r, |r| <= ln2 / 2, and 2^n built in the exponent
 * bits. Plain vector arithmetic: no libm call per lane. */
static inline vf exp_nonpositive(vf x) {
    x = blend(x < splat(-87.0f), splat(-87.0f), x);
    const vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi); /* toward 0: nearest for x <= 0 */
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((n + 127) << 23); /* n >= -126 since x >= -87 */
}

/* Pairwise lane sums of two vectors: each lane of the result is the sum of the two
 * lanes the masks pick, runs from a then from b (the masks set the run width). Each
 * level halves the runs; after the last, lane s holds the whole sum of vector s. */
#define FOLD(a, b, lo, hi) (__builtin_shuffle((a), (b), (vi)lo) + __builtin_shuffle((a), (b), (vi)hi))
#if LANES == 16
static const vi LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const vi HALVES_LO = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const vi HALVES_HI = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
static const vi QUARTERS_LO = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
static const vi QUARTERS_HI = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
static const vi PAIRS_LO = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
static const vi PAIRS_HI = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
static const vi EVENS = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const vi ODDS = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

/* Lane s of the result: the sum of the lanes of products[s]. */
static inline vf sum_each(const vf products[LANES]) {
    vf halves[8], quarters[4], pairs[2];
    for (int i = 0; i < 8; ++i) halves[i] = FOLD(products[2 * i], products[2 * i + 1], HALVES_LO, HALVES_HI);
    for (int i = 0; i < 4; ++i) quarters[i] = FOLD(halves[2 * i], halves[2 * i + 1], QUARTERS_LO, QUARTERS_HI);
    for (int i = 0; i < 2; ++i) pairs[i] = FOLD(quarters[2 * i], quarters[2 * i + 1], PAIRS_LO, PAIRS_HI);
    return FOLD(pairs[0], pairs[1], EVENS, ODDS);
}
#elif LANES == 8
static const vi LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7};
static const vi HALVES_LO = {0, 1, 2, 3, 8, 9, 10, 11};
static const vi HALVES_HI = {4, 5, 6, 7, 12, 13, 14, 15};
static const vi PAIRS_LO = {0, 1, 4, 5, 8, 9, 12, 13};
static const vi PAIRS_HI = {2, 3, 6, 7, 10, 11, 14, 15};
static const vi EVENS = {0, 2, 4, 6, 8, 10, 12, 14};
static const vi ODDS = {1, 3, 5, 7, 9, 11, 13, 15};

static inline vf sum_each(const vf products[LANES]) {
    vf halves[4], pairs[2];
    for (int i = 0; i < 4; ++i) halves[i] = FOLD(products[2 * i], products[2 * i + 1], HALVES_LO, HALVES_HI);
    for (int i = 0; i < 2; ++i) pairs[i] = FOLD(halves[2 * i], halves[2 * i + 1], PAIRS_LO, PAIRS_HI);
    return FOLD(pairs[0], pairs[1], EVENS, ODDS);
}
#else
#error "LANES must be 8 or 16"
#endif

static inline vi lane_below(int64_t count) {
    return LANE_INDEX < (int32_t)count; /* all ones where lane < count */
}

/* Softmax weights in place: exp(score - max) of one head's scores (padded to
 * whole runs of LANES; padding lanes hold MASKED_SCORE and get weight 0).
 * Returns 1 / their sum. */
static inline float softmax_weights(float *scores, int64_t num_runs, vf max) {
    float top = max[0];
    for (int i = 1; i < LANES; ++i) top = max[i] > top ? max[i] : top;
    vf sums = splat(0.0f);
    for (int64_t run = 0; run < num_runs; ++run) {
        vf *weights = (vf *)(scores + run * LANES);
        *weights = blend(*weights > splat(MASKED_SCORE), exp_nonpositive(*weights - top), splat(0.0f));
        sums += *weights;
    }
    float total = 0.0f;
    for (int i = 0; i < LANES; ++i) total += sums[i];
    return 1.0f / total;
}

/* KV heads [kv_first, kv_last) of one decode: every query head they serve.
 * The passes walk the keys in position order with the heads innermost, so a
 * block's rows (all KV heads side by side) are read once and in order; per
 * head, one run of LANES dot products is reduced at a time. Inlined with a
 * constant head_dim for the common sizes (the switch below), where the
 * chunk loops unroll. Scratch: (heads, padded length) scores, one vector of
 * running maxima per head, then (heads, head_dim) accumulators. */
static inline __attribute__((always_inline)) void attend_heads(
    const float *q, float *o, float *scores, int64_t padded,
    const float *key_cache, const float *value_cache, const int64_t *table, int64_t length,
    int64_t kv_first, int64_t kv_last, int64_t group,
    const int64_t head_dim, int64_t block_size, int64_t slot_stride, float scale) {
    const int64_t chunks = head_dim / LANES, num_runs = padded / LANES;
    const int64_t first_head = kv_first * group, num_heads = (kv_last - kv_first) * group;
    vf *maxes = (vf *)(scores + num_heads * padded);
    vf *acc = maxes + num_heads;  /* (heads, chunks) */
    for (int64_t h = 0; h < num_heads; ++h) maxes[h] = splat(MASKED_SCORE);

    for (int64_t run = 0; run < num_runs; ++run) {
        const int64_t first = run * LANES;
        const float *rows = key_cache + (table[first / block_size] * block_size + first % block_size) * slot_stride;
        const vi valid = lane_below(length - first);
        for (int64_t h = 0; h < num_heads; ++h) {
            const int64_t head = first_head + h;
            const float *qh = q + head * head_dim, *keys = rows + head / group * head_dim;
            vf products[LANES];
            for (int s = 0; s < LANES; ++s) { /* padding slots of the last block hold finite values: masked */
                const float *k = keys + s * slot_stride;
                vf sum = *(const vf *)qh * *(const vf *)k;
                for (int64_t c = 1; c < chunks; ++c) sum += *(const vf *)(qh + c * LANES) * *(const vf *)(k + c * LANES);
                products[s] = sum;
            }
            const vf dots = blend(valid, sum_each(products) * scale, splat(MASKED_SCORE));
            *(vf *)(scores + h * padded + first) = dots;
            maxes[h] = blend(dots > maxes[h], dots, maxes[h]);
        }
    }
    float inverse[num_heads];
    for (int64_t h = 0; h < num_heads; ++h) inverse[h] = softmax_weights(scores + h * padded, num_runs, maxes[h]);

    for (int64_t i = 0; i < num_heads * chunks; ++i) acc[i] = splat(0.0f);
    for (int64_t first = 0; first < length; first += block_size) {
        const float *block = value_cache + table[first / block_size] * block_size * slot_stride;
        const int64_t count = length - first < block_size ? length - first : block_size;
        for (int64_t s = 0; s < count; ++s) {
            const float *row = block + s * slot_stride;
            for (int64_t h = 0; h < num_heads; ++h) {
                const int64_t head = first_head + h;
                const float *v = row + head / group * head_dim;
                const float weight = scores[h * padded + first + s];
                for (int64_t c = 0; c < chunks; ++c) acc[h * chunks + c] += weight * *(const vf *)(v + c * LANES);
            }
        }
    }
    for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t c = 0; c < chunks; ++c)
            *(vf *)(o + (first_head + h) * head_dim + c * LANES) = acc[h * chunks + c] * inverse[h];
}

/* Returns 0, or 1 when a work item's scratch could not be allocated. */
int paged_decode_attention(
    const float *query, int64_t query_row_stride,
    float *out, int64_t out_row_stride,
    const int64_t *rows,
    const float *key_cache, const float *value_cache,
    const int64_t *block_tables, int64_t table_stride,
    const int64_t *context_lens,
    int64_t num_decodes, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim; /* floats between consecutive positions */
    /* A work item is a decode's KV heads, split in parts only when there are too few
     * decodes to keep every thread busy: a part reads its rows' share of each block. */
    const int64_t wanted = (4 * omp_get_max_threads() + num_decodes - 1) / num_decodes;
    const int64_t parts = wanted < 1 ? 1 : wanted > num_kv_heads ? num_kv_heads : wanted;
    const int64_t num_items = num_decodes * parts;
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
        const int64_t decode = item / parts, part = item % parts;
        const int64_t kv_first = part * num_kv_heads / parts, kv_last = (part + 1) * num_kv_heads / parts;
        const int64_t length = context_lens[decode];
        const int64_t padded = (length + LANES - 1) / LANES * LANES;
        const int64_t heads = (kv_last - kv_first) * group;
        const size_t floats = (size_t)(heads * padded + heads * LANES + heads * head_dim);
        float *scratch = aligned_alloc(4 * LANES, sizeof(float) * floats); /* every part a multiple of LANES */
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float *q = query + rows[decode] * query_row_stride;
        float *o = out + rows[decode] * out_row_stride;
#define ATTEND(D) attend_heads(q, o, scratch, padded, key_cache, value_cache, block_tables + decode * table_stride, \
                               length, kv_first, kv_last, group, D, block_size, slot_stride, scale)
        switch (head_dim) {
        case 32: ATTEND(32); break;
        case 64: ATTEND(64); break;
        case 128: ATTEND(128); break;
        default: ATTEND(head_dim); break;
        }
#undef ATTEND
        free(scratch);
    }
    return failed;
}
