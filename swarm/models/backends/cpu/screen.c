/* The end of Int8InputScreen's step (swarm/models/backends/cpu/argmax.py): one pass over the vocabulary per input row, and a
second that lists the rows kept.

After fbgemm's int8 product, torch took about as long again for the rest: the loud dimensions through
fbgemm's 8-bit embedding bag, the error bounds, their lowest top and the rows kept, a dozen passes over [N, V]
float32 and as many operator calls. Here, per block of the vocabulary while it is in the L1 cache:

    y_j     = screened_j + sum_l x_l (scale_l b_lj + offset_l)                 (the loud dimensions' rows)
    bound_j = k0 p0_j + k1 p1_j + k2 p2_j + c + 2^-20 |y_j|                    (argmax.py's bound, k and c widened)
    floor   = max_j (y_j - bound_j)

and then the rows with y_j + bound_j >= floor are listed. The sums are of the terms argmax.py bounds: the loud
part is summed on its own from zero, then added (as fbgemm's embedding bag does), and the bound's terms are all
>= 0, so their widening by 2^-10 outweighs the rounding of their sums in any order.

A row with a value or bound that is not finite keeps nothing (count 0): the caller computes it densely. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define SPAN 512 /* vocabulary entries per block: the loud part's sums, 2 KB, stay in L1 */

/* sums[0, m) += x (s b + o), eight at a time, the rest one by one */
static void add_loud(float *sums, const uint8_t *b, long m, float s, float o, float x) {
    const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o), vx = _mm256_set1_ps(x);
    long j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + j)));
        const __m256 w = _mm256_add_ps(_mm256_mul_ps(vs, _mm256_cvtepi32_ps(bytes)), vo);
        _mm256_storeu_ps(sums + j, _mm256_add_ps(_mm256_loadu_ps(sums + j), _mm256_mul_ps(vx, w)));
    }
    for (; j < m; j++) sums[j] += x * (s * (float)b[j] + o);
}

void screen_finish(float *y, long rows, long vocab, const uint8_t *by_dimension, long stride,
                   const float *scale, const float *offset, const int64_t *loud, const float *loud_values,
                   long louds, const float *per_row, const float *coefficients, const float *constant,
                   float *bound, long cap, int64_t *kept, int64_t *counts) {
    float sums[SPAN];
    const __m256 zero = _mm256_setzero_ps(), tiny = _mm256_set1_ps(0x1p-20f);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (long n = 0; n < rows; n++) {
        float *yn = y + n * vocab, *bn = bound + n * vocab;
        const int64_t *dims = loud + n * louds;
        const float *xs = loud_values + n * louds;
        const float k0 = coefficients[3 * n], k1 = coefficients[3 * n + 1], k2 = coefficients[3 * n + 2];
        const float c = constant[n];
        const __m256 v0 = _mm256_set1_ps(k0), v1 = _mm256_set1_ps(k1), v2 = _mm256_set1_ps(k2);
        const __m256 vc = _mm256_set1_ps(c);
        __m256 lows = _mm256_set1_ps(-INFINITY), odd = zero;
        float floor = -INFINITY, check = 0.0f;
        for (long start = 0; start < vocab; start += SPAN) {
            const long m = vocab - start < SPAN ? vocab - start : SPAN;
            for (long j = 0; j < m; j++) sums[j] = 0.0f;
            for (long l = 0; l < louds; l++)
                add_loud(sums, by_dimension + dims[l] * stride + start, m, scale[dims[l]], offset[dims[l]], xs[l]);
            float *yb = yn + start, *bb = bn + start;
            const float *p0 = per_row + start, *p1 = per_row + vocab + start, *p2 = per_row + 2 * vocab + start;
            long j = 0;
            for (; j + 8 <= m; j += 8) {
                const __m256 v = _mm256_add_ps(_mm256_loadu_ps(yb + j), _mm256_loadu_ps(sums + j));
                __m256 e = _mm256_add_ps(_mm256_mul_ps(v0, _mm256_loadu_ps(p0 + j)),
                                         _mm256_mul_ps(v1, _mm256_loadu_ps(p1 + j)));
                e = _mm256_add_ps(_mm256_add_ps(e, _mm256_mul_ps(v2, _mm256_loadu_ps(p2 + j))), vc);
                e = _mm256_add_ps(e, _mm256_mul_ps(_mm256_and_ps(v, magnitude), tiny));
                _mm256_storeu_ps(yb + j, v);
                _mm256_storeu_ps(bb + j, e);
                lows = _mm256_max_ps(_mm256_sub_ps(v, e), lows);
                /* 0 where both are finite, NaN once either is infinite or NaN */
                odd = _mm256_add_ps(odd, _mm256_add_ps(_mm256_mul_ps(v, zero), _mm256_mul_ps(e, zero)));
            }
            for (; j < m; j++) {
                const float v = yb[j] + sums[j];
                const float e = k0 * p0[j] + k1 * p1[j] + k2 * p2[j] + c + fabsf(v) * 0x1p-20f;
                yb[j] = v;
                bb[j] = e;
                floor = v - e > floor ? v - e : floor;
                check += v * 0.0f + e * 0.0f;
            }
        }
        float lanes[8], odds[8];
        _mm256_storeu_ps(lanes, lows);
        _mm256_storeu_ps(odds, odd);
        for (int i = 0; i < 8; i++) {
            floor = lanes[i] > floor ? lanes[i] : floor;
            check += odds[i];
        }
        long count = 0;
        if (!isnan(check) && isfinite(floor)) {
            const __m256 top = _mm256_set1_ps(floor);
            long j = 0;
            for (; j + 8 <= vocab; j += 8) {
                const __m256 high = _mm256_add_ps(_mm256_loadu_ps(yn + j), _mm256_loadu_ps(bn + j));
                int mask = _mm256_movemask_ps(_mm256_cmp_ps(high, top, _CMP_GE_OQ));
                while (mask) {
                    const int i = __builtin_ctz(mask);
                    if (count < cap) kept[n * cap + count] = j + i;
                    count++;
                    mask &= mask - 1;
                }
            }
            for (; j < vocab; j++) {
                if (yn[j] + bn[j] >= floor) {
                    if (count < cap) kept[n * cap + count] = j;
                    count++;
                }
            }
        }
        counts[n] = count;
    }
}

/* out[i] = x . W[rows[i]] (all V rows where rows is NULL), each the float32 sum of float32 products in one fixed
   order: DOT_LANES running sums over k = lane (mod DOT_LANES), then those added from the first to the last.
   Compiled with -ffp-contract=off and no reassociation, so a logit is the same bits on every x86 CPU and
   whichever other rows are computed with it: the greedy head's exact logits (swarm/models/backends/cpu/argmax.py). */
#define DOT_LANES 16
void dot_rows(const float *x, long K, const float *W, const int64_t *rows, long count, float *out) {
    for (long i = 0; i < count; i++) {
        const float *w = W + (rows ? rows[i] : i) * K;
        float lanes[DOT_LANES] = {0};
        long k = 0;
        for (; k + DOT_LANES <= K; k += DOT_LANES)
            for (int l = 0; l < DOT_LANES; l++) lanes[l] += x[k + l] * w[k + l];
        for (int l = 0; k < K; k++, l++) lanes[l] += x[k] * w[k];
        float sum = 0.0f;
        for (int l = 0; l < DOT_LANES; l++) sum += lanes[l];
        out[i] = sum;
    }
}
