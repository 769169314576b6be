/* Stepahead's CPU kernels for weight-quantized linear layers (worker_svc/cpu_kernels.py builds and
 * loads this file).
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ nothing else: the caller adds any bias), with w kept in
 * blocks of 32 inputs:
 *   - Q4: 4-bit codes 0..15 and a float scale and minimum a block: w = code * scale + minimum
 *     (a GGUF's Q4_1 block; Q4_0's is minimum = -8 * scale).
 *   - Q8: signed 8-bit codes and a float scale a block: w = code * scale (a GGUF's Q8_0).
 * laid out for eight outputs at a time (below; cpu_kernels.py packs them).
 * x is float32. Each block of 32 of a row is written as two 8-bit codes an input over a scale
 * d = max |x| / 127: x = d * (q + r / 254) to within d / 508 (15 bits of its largest value), and the
 * products are taken on integers (AVX2), two for each input. One 8-bit code alone (llama.cpp's
 * Q8_1 activations) moves smollm2's greedy answers; the weights stay in memory at 4 or 8 bits, and
 * at a decode step's few rows the time is mostly the time to read them.
 *
 * Threads: OpenMP, the `threads` given (the caller passes torch's own count, and torch's libgomp
 * is the one loaded, so the kernels share torch's pool of helper threads).
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define ROW_TILE 2 /* activation rows taken together over each group of weights */
#define ROW_CHUNK 64 /* activation rows per pass over the weights (kept in cache) */
#define FINE 254 /* the second part of an activation's code: its rounding error in steps of 1 / FINE */

/* 4 x 8 int32 (each within -127..127) to 32 int8 in order: packs interleave the 128-bit lanes,
 * so the result is permuted back */
static inline __m256i pack_codes(const __m256i i32[4]) {
    const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    return _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* One row of k floats in two 8-bit codes a block over its scale d = max |x| / 127: x = d (q + r / FINE)
 * within d / (2 FINE); step[b] = d / FINE, the unit of FINE q + r; and the block's exact sum s (for
 * the Q4 minimum). */
static void quantize_row(const float *x, int64_t k, int8_t *q, int8_t *r, float *step, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f), finer = _mm256_set1_ps((float)FINE);
    const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t b = 0; b < k / BLOCK; b++) {
        const float *xb = x + b * BLOCK;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            sum = _mm256_add_ps(sum, v[j]);
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float maxabs = _mm_cvtss_f32(m);
        const __m256 inv = _mm256_set1_ps(maxabs > 0.0f ? 127.0f / maxabs : 0.0f);
        __m256i coarse[4], rest[4];
        for (int j = 0; j < 4; j++) {
            const __m256 scaled = _mm256_mul_ps(v[j], inv);
            const __m256 rounded = _mm256_round_ps(scaled, rounding);
            coarse[j] = _mm256_cvtps_epi32(rounded);
            rest[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(scaled, rounded), finer), rounding));
        }
        _mm256_storeu_si256((__m256i *)(q + b * BLOCK), pack_codes(coarse));
        _mm256_storeu_si256((__m256i *)(r + b * BLOCK), pack_codes(rest));
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        step[b] = maxabs / 127.0f / (float)FINE;
        s[b] = _mm_cvtss_f32(t);
    }
}

/* The weights are laid out for eight outputs at a time (a group), so that one 256-bit register
 * holds four inputs of each of the eight (4 bytes a row) and a product lands each output's sum in
 * its own lane: no horizontal sums, and a block's scaling is one multiply for the eight.
 * Q4: [group][block][128 bytes]: bytes 32t .. 32t + 31 hold, for row i at 32t + 4i + q, the code of
 *     input 4t + q in the low nibble and of input 16 + 4t + q in the high one (t, q in 0..3).
 * Q8: [group][block][256 bytes]: bytes 32t + 4i + q hold row i's code of input 4t + q (t in 0..7).
 * Scales and minima: [group][block][8 rows]. A last group past n holds zeros. */
#define GROUP 8

/* Keeps an accumulator in its register: left free, GCC reassociates a block's integer sums into
 * trees whose partial products spill to the stack (about a tenth slower). */
#define PIN(v) __asm__("" : "+x"(v))

static inline __m256i broadcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm256_set1_epi32(v);
}

/* The activations of a tile of rows: their codes, each block's step and sum. */
struct rows {
    const int8_t *q, *r;
    const float *step, *sum;
    int64_t k, blocks;
};

/* Outputs 8g .. 8g + 7 of `count` rows (a constant where this is inlined, so the accumulators
 * stay in registers). */
static inline __attribute__((always_inline)) void q4_group(const uint8_t *wq, const float *wd, const float *wm,
                                                           struct rows x, const int count,
                                                           float out[ROW_TILE][GROUP]) {
    const __m256i ones = _mm256_set1_epi16(1), finer = _mm256_set1_epi16(FINE), low = _mm256_set1_epi8(0x0F);
    __m256 acc[ROW_TILE], low_acc[ROW_TILE]; /* the minima's terms apart: two chains of sums, not one */
    for (int r = 0; r < count; r++) acc[r] = low_acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.blocks; b++) {
        __m256i coarse[ROW_TILE], rest[ROW_TILE];
        for (int r = 0; r < count; r++) coarse[r] = rest[r] = _mm256_setzero_si256();
        const uint8_t *w = wq + b * 128;
        for (int t = 0; t < 4; t++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * t));
            const __m256i lo = _mm256_and_si256(v, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int r = 0; r < count; r++) {
                const int64_t at = r * x.k + b * BLOCK + 4 * t;
                /* at most 8 x 2 x 15 x 127 = 30480 a lane: int16 holds a block's sum */
                coarse[r] = _mm256_add_epi16(coarse[r], _mm256_maddubs_epi16(lo, broadcast4(x.q + at)));
                PIN(coarse[r]);
                coarse[r] = _mm256_add_epi16(coarse[r], _mm256_maddubs_epi16(hi, broadcast4(x.q + at + 16)));
                PIN(coarse[r]);
                rest[r] = _mm256_add_epi16(rest[r], _mm256_maddubs_epi16(lo, broadcast4(x.r + at)));
                PIN(rest[r]);
                rest[r] = _mm256_add_epi16(rest[r], _mm256_maddubs_epi16(hi, broadcast4(x.r + at + 16)));
                PIN(rest[r]);
            }
        }
        const __m256 scale = _mm256_loadu_ps(wd + b * GROUP), minimum = _mm256_loadu_ps(wm + b * GROUP);
        for (int r = 0; r < count; r++) {
            /* FINE * coarse + rest, in int32: at most 254 x 2 x 30480, far from overflow */
            const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(coarse[r], finer), _mm256_madd_epi16(rest[r], ones));
            const __m256 step = _mm256_set1_ps(x.step[r * x.blocks + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, step), _mm256_cvtepi32_ps(sum), acc[r]);
            low_acc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(x.sum[r * x.blocks + b]), low_acc[r]);
        }
    }
    for (int r = 0; r < count; r++) _mm256_storeu_ps(out[r], _mm256_add_ps(acc[r], low_acc[r]));
}

static inline __attribute__((always_inline)) void q8_group(const int8_t *wq, const float *wd, struct rows x,
                                                           const int count, float out[ROW_TILE][GROUP]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 finer = _mm256_set1_ps((float)FINE);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < count; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.blocks; b++) {
        __m256i coarse[ROW_TILE], rest[ROW_TILE];
        for (int r = 0; r < count; r++) coarse[r] = rest[r] = _mm256_setzero_si256();
        const int8_t *w = wq + b * 256;
        for (int t = 0; t < 8; t++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * t));
            const __m256i magnitude = _mm256_sign_epi8(v, v);
            for (int r = 0; r < count; r++) {
                const int64_t at = r * x.k + b * BLOCK + 4 * t;
                /* |w| * (x with w's sign): maddubs wants its first operand unsigned */
                const __m256i xc = _mm256_sign_epi8(broadcast4(x.q + at), v), xf = _mm256_sign_epi8(broadcast4(x.r + at), v);
                coarse[r] = _mm256_add_epi32(coarse[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xc), ones));
                PIN(coarse[r]);
                rest[r] = _mm256_add_epi32(rest[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xf), ones));
                PIN(rest[r]);
            }
        }
        const __m256 scale = _mm256_loadu_ps(wd + b * GROUP);
        for (int r = 0; r < count; r++) {
            const __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(coarse[r]), finer, _mm256_cvtepi32_ps(rest[r]));
            const __m256 step = _mm256_set1_ps(x.step[r * x.blocks + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, step), sum, acc[r]);
        }
    }
    for (int r = 0; r < count; r++) _mm256_storeu_ps(out[r], acc[r]);
}

static struct rows tile_at(struct rows x, int64_t row) {
    return (struct rows){x.q + row * x.k, x.r + row * x.k, x.step + row * x.blocks, x.sum + row * x.blocks, x.k,
                         x.blocks};
}

/* out[m, n] for a Q4 (kind 4) or Q8 (kind 8) weight of n outputs and k inputs, laid out as above;
 * wm is NULL for Q8. Returns 0, or -1 where the scratch for the quantized activations cannot be had. */
int stepahead_linear(int kind, const float *x, int64_t m, int64_t k, const void *wq, const float *wd,
                     const float *wm, int64_t n, float *out, int threads) {
    const int64_t blocks = k / BLOCK, groups = (n + GROUP - 1) / GROUP;
    int8_t *xq = (int8_t *)malloc((size_t)(2 * m * k)), *xr = xq + m * k;
    float *xd = (float *)malloc(sizeof(float) * (size_t)(m * blocks));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m * blocks));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return -1;
    }
    const struct rows all = {xq, xr, xd, xs, k, blocks};
    const int64_t group_bytes = (kind == 4 ? 128 : 256) * blocks;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (m * n * k > 1 << 16)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            quantize_row(x + r * k, k, xq + r * k, xr + r * k, xd + r * blocks, xs + r * blocks);
        }
        for (int64_t m0 = 0; m0 < m; m0 += ROW_CHUNK) {
            const int64_t rows = m - m0 < ROW_CHUNK ? m - m0 : ROW_CHUNK;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *w = (const uint8_t *)wq + g * group_bytes;
                const float *gd = wd + g * blocks * GROUP, *gm = kind == 4 ? wm + g * blocks * GROUP : NULL;
                const int64_t outputs = n - g * GROUP < GROUP ? n - g * GROUP : GROUP;
                for (int64_t r = 0; r < rows; r += ROW_TILE) {
                    const int64_t count = rows - r < ROW_TILE ? rows - r : ROW_TILE;
                    const struct rows at = tile_at(all, m0 + r);
                    float tile[ROW_TILE][GROUP];
                    /* a whole tile with its count a constant, else its rows one at a time */
                    if (kind == 4 && count == ROW_TILE) {
                        q4_group(w, gd, gm, at, ROW_TILE, tile);
                    } else if (kind == 4) {
                        for (int64_t i = 0; i < count; i++) q4_group(w, gd, gm, tile_at(at, i), 1, tile + i);
                    } else if (count == ROW_TILE) {
                        q8_group((const int8_t *)w, gd, at, ROW_TILE, tile);
                    } else {
                        for (int64_t i = 0; i < count; i++) q8_group((const int8_t *)w, gd, tile_at(at, i), 1, tile + i);
                    }
                    for (int64_t i = 0; i < count; i++) {
                        memcpy(out + (m0 + r + i) * n + g * GROUP, tile[i], sizeof(float) * (size_t)outputs);
                    }
                }
            }
        }
    }
    free(xq), free(xd), free(xs);
    return 0;
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* RMSNorm of `rows` rows of n floats: out = x / sqrt(mean(x^2) + eps) * weight. */
void stepahead_rms_norm(const float *x, const float *weight, int64_t rows, int64_t n, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        __m256 squares = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            squares = _mm256_fmadd_ps(v, v, squares);
        }
        float total = hsum(squares);
        for (int64_t j = i; j < n; j++) total += xr[j] * xr[j];
        const float inv = 1.0f / sqrtf(total / (float)n + eps);
        const __m256 scale = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), scale);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
        }
        for (; i < n; i++) o[i] = xr[i] * inv * weight[i];
    }
}

/* e^x for x <= 0 (Cody-Waite reduction and a degree-6 polynomial, within 2 ulp; below -87 it is 0) */
static inline __m256 exp_negative(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float total = hsum(acc);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* o += p * v over n floats */
static inline void axpy(float p, const float *v, float *o, int64_t n) {
    const __m256 scale = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
    for (; i < n; i++) o[i] += p * v[i];
}

/* One query token a row over the KV pool: for row b and head h, softmax(q . k / sqrt(d)) . v over
 * the keys at slots[b, j] where valid[b, j] (its context and window); head h reads KV head
 * h / (heads / kv_heads). q [rows, heads, d]; pools [slots, kv_heads, d]; out [rows, heads, d].
 * Scratch for the scores: `scores` [threads, keys]. */
void stepahead_decode_attention(const float *q, const float *k_pool, const float *v_pool, const int64_t *slots,
                                const uint8_t *valid, int64_t rows, int64_t keys, int64_t heads, int64_t kv_heads,
                                int64_t d, float scale, float *out, float *scores, int threads) {
    const int64_t group = heads / kv_heads;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * keys * d > 1 << 16)
    for (int64_t task = 0; task < rows * heads; task++) {
        const int64_t b = task / heads, h = task % heads, kvh = h / group;
        float *s = scores + (int64_t)omp_get_thread_num() * keys;
        const float *qh = q + task * d;
        float top = -INFINITY;
        for (int64_t j = 0; j < keys; j++) {
            s[j] = valid[b * keys + j] ? dot(qh, k_pool + (slots[b * keys + j] * kv_heads + kvh) * d, d) * scale
                                       : -INFINITY;
            if (s[j] > top) top = s[j];
        }
        /* the weights e^(s - top), eight at a time; a key out of the context weighs 0 */
        const __m256 highest = _mm256_set1_ps(top), none = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= keys; j += 8) {
            const __m256 v = _mm256_loadu_ps(s + j);
            const __m256 out_of_context = _mm256_cmp_ps(v, none, _CMP_EQ_OQ);
            _mm256_storeu_ps(s + j, _mm256_andnot_ps(out_of_context, exp_negative(_mm256_sub_ps(v, highest))));
        }
        for (; j < keys; j++) s[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - top);
        float *o = out + task * d;
        for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
        float total = 0.0f;
        for (j = 0; j < keys; j++) {
            if (s[j] == 0.0f) continue;
            total += s[j];
            axpy(s[j], v_pool + (slots[b * keys + j] * kv_heads + kvh) * d, o, d);
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t i = 0; i < d; i++) o[i] *= inv;
    }
}

/* The rotation of a fused q/k/v projection's q and k heads, written where attention reads them:
 * qkv [tokens, (heads + 2 kv_heads) d] (q heads, then k, then v); cos, sin [tokens, d] with sin
 * signed (-sin, sin) a head wide, so that a head x turns to x cos + roll(x, d / 2) sin (the
 * rotate_half convention). q goes to q_out [tokens, heads, d]; k and v to the pools
 * [slots, kv_heads, d] at slots[t]. */
void stepahead_rope_store(const float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                          const float *cos, const float *sin, const int64_t *slots, float *q_out, float *k_pool,
                          float *v_pool) {
    const int64_t half = d / 2, width = (heads + 2 * kv_heads) * d;
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = qkv + t * width, *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const float *x = row + h * d;
            float *o = h < heads ? q_out + (t * heads + h) * d : k_pool + (slots[t] * kv_heads + h - heads) * d;
            for (int64_t i = 0; i < half; i++) o[i] = x[i] * c[i] + x[i + half] * s[i];
            for (int64_t i = half; i < d; i++) o[i] = x[i] * c[i] + x[i - half] * s[i];
        }
        memcpy(v_pool + slots[t] * kv_heads * d, row + (heads + kv_heads) * d, sizeof(float) * (size_t)(kv_heads * d));
    }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i] of a fused gate/up projection's [rows, 2 n] */
void stepahead_silu_mul(const float *gate_up, int64_t rows, int64_t n, float *out, int threads) {
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n > 1 << 14)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= n; i += 8) {
            /* silu(x) = x / (1 + e^-x), with e^-|x| for either sign: x >= 0 gives 1 / (1 + e^-x),
             * x < 0 gives e^x / (1 + e^x) */
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp_negative(_mm256_or_ps(x, sign));
            const __m256 positive = _mm256_div_ps(one, _mm256_add_ps(one, e));
            const __m256 negative = _mm256_div_ps(e, _mm256_add_ps(one, e));
            const __m256 sigmoid = _mm256_blendv_ps(positive, negative, x);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), _mm256_loadu_ps(u + i)));
        }
        for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* A linear layer's weight as stepahead_linear takes it, and its bias (NULL: none). */
struct stepahead_weight {
    int64_t kind, n, k;
    const void *codes;
    const float *scale, *minimum, *bias;
};

/* A llama decoder layer whose q/k/v and gate/up projections are each fused (q, k, v and gate, up
 * stacked in that order) and whose weights are all on these kernels. */
struct stepahead_layer {
    const float *input_norm, *post_norm;
    double eps, scale; /* the norms' epsilon, attention's scale (1 / sqrt(d)) */
    int64_t heads, kv_heads, d;
    struct stepahead_weight qkv, o, gate_up, down;
};

static int linear_with_bias(const struct stepahead_weight *w, const float *x, int64_t rows, float *out, int threads) {
    if (stepahead_linear((int)w->kind, x, rows, w->k, w->codes, w->scale, w->minimum, w->n, out, threads) != 0) return -1;
    if (w->bias) {
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t j = 0; j < w->n; j++) out[r * w->n + j] += w->bias[j];
        }
    }
    return 0;
}

static void add_into(float *x, const float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) x[i] += y[i];
}

/* One decoder layer over `rows` decode rows, one token each (token i row i's), in place on the
 * residual stream x [rows, hidden]: x += o(attention(rope(qkv(norm(x))))), then
 * x += down(silu(gate) * up(norm(x))), with the rows' k and v written to the pools at out_slots and
 * attention over kv_slots where valid [rows, keys], as the separate kernels above compute them
 * (the same arithmetic in the same order: the layer's Python path gives the same bits). cos, sin:
 * [rows, d]. Returns 0, or -1 where scratch cannot be had. */
static int decode_layer(const struct stepahead_layer *layer, float *x, int64_t rows, const float *cos, const float *sin,
                        const int64_t *out_slots, const int64_t *kv_slots, const uint8_t *valid, int64_t keys,
                        float *k_pool, float *v_pool, int threads) {
    const int64_t hidden = layer->o.n, intermediate = layer->down.k, qd = layer->heads * layer->d;
    if (threads < 1) threads = 1;
    const int64_t sizes[] = {rows * hidden, rows * layer->qkv.n, rows * qd, rows * qd, rows * hidden,
                             rows * layer->gate_up.n, rows * intermediate, (int64_t)threads * keys};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) total += sizes[i];
    float *scratch = (float *)malloc(sizeof(float) * (size_t)total);
    if (!scratch) return -1;
    float *normed = scratch, *qkv = normed + sizes[0], *q = qkv + sizes[1], *attended = q + sizes[2];
    float *projected = attended + sizes[3], *gate_up = projected + sizes[4], *act = gate_up + sizes[5];
    float *scores = act + sizes[6];
    int rc = 0;
    stepahead_rms_norm(x, layer->input_norm, rows, hidden, (float)layer->eps, normed);
    rc |= linear_with_bias(&layer->qkv, normed, rows, qkv, threads);
    stepahead_rope_store(qkv, rows, layer->heads, layer->kv_heads, layer->d, cos, sin, out_slots, q, k_pool, v_pool);
    stepahead_decode_attention(q, k_pool, v_pool, kv_slots, valid, rows, keys, layer->heads, layer->kv_heads, layer->d,
                               (float)layer->scale, attended, scores, threads);
    rc |= linear_with_bias(&layer->o, attended, rows, projected, threads);
    add_into(x, projected, rows * hidden);
    stepahead_rms_norm(x, layer->post_norm, rows, hidden, (float)layer->eps, normed);
    rc |= linear_with_bias(&layer->gate_up, normed, rows, gate_up, threads);
    stepahead_silu_mul(gate_up, rows, intermediate, act, threads);
    rc |= linear_with_bias(&layer->down, act, rows, projected, threads);
    add_into(x, projected, rows * hidden);
    free(scratch);
    return rc == 0 ? 0 : -1;
}

/* All `count` layers of a model in turn (each as decode_layer), in one call: the caller
 * gives up its interpreter lock once a step rather than once a layer. The pools of layer i start
 * at k_pools + i * pool_stride (and v_pools). */
int stepahead_decode_layers(const struct stepahead_layer *layers, int64_t count, float *x, int64_t rows,
                            const float *cos, const float *sin, const int64_t *out_slots, const int64_t *kv_slots,
                            const uint8_t *valid, int64_t keys, float *k_pools, float *v_pools, int64_t pool_stride,
                            int threads) {
    for (int64_t i = 0; i < count; i++) {
        if (decode_layer(layers + i, x, rows, cos, sin, out_slots, kv_slots, valid, keys, k_pools + i * pool_stride,
                         v_pools + i * pool_stride, threads) != 0) {
            return -1;
        }
    }
    return 0;
}
