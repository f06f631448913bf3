/* y[M][N] = x[M][K] @ W^T for weights stored as 4-bit blocks (swarm/models/int4.py), float32 in and out.

   W[n][k] = d * q + m for the block of 32 holding k, rounded as transformers widens a GGUF Q4_1 block: the
   product d * q, then the sum (compiled with -ffp-contract=off, so never one fused step). Each weight is thus
   bit for bit the float32 weight it stands for; only the order of the sums over k differs from F.linear.

   A packed row of K weights: K/2 bytes of nibbles (byte j of a block holds q[j] low and q[j + 16] high), then
   K/32 float32 scales d, then K/32 float32 minimums m. */

#include <immintrin.h>
#include <stdint.h>

#define BLOCK 32
#define FUSED_ROWS 8

/* the 32 weights of one block, widened to float32 */
static inline void widen(const uint8_t *nibbles, float d, float m, __m256 w[4]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)nibbles);
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i low = _mm_and_si128(bytes, mask);
    __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    __m256 scale = _mm256_set1_ps(d), least = _mm256_set1_ps(m);
    __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int i = 0; i < 4; i++) {
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        w[i] = _mm256_add_ps(_mm256_mul_ps(q, scale), least);
    }
}

static inline float total(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* `rows` (1 to FUSED_ROWS, a constant once inlined) input rows: each block is widened in registers and used by
   every row at once; a row has several accumulators when few rows leave registers free, so that consecutive
   multiply-adds do not wait on each other. */
static inline __attribute__((always_inline)) void fused_rows(const float *x, const int rows, long K,
                                                             const uint8_t *packed, long N, float *y) {
    const int accs = rows == 1 ? 4 : rows <= 4 ? 2 : 1;
    long blocks = K / BLOCK, stride = K / 2 + 2 * blocks * (long)sizeof(float);
    for (long n = 0; n < N; n++) {
        const uint8_t *row = packed + n * stride;
        const float *d = (const float *)(row + K / 2), *m = d + blocks;
        __m256 acc[FUSED_ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int a = 0; a < accs; a++) acc[r][a] = _mm256_setzero_ps();
        for (long b = 0; b < blocks; b++) {
            __m256 w[4];
            widen(row + b * (BLOCK / 2), d[b], m[b], w);
            for (int r = 0; r < rows; r++) {
                const float *xr = x + r * K + b * BLOCK;
                for (int i = 0; i < 4; i++)
                    acc[r][i % accs] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % accs]);
            }
        }
        for (int r = 0; r < rows; r++) {
            __m256 sum = acc[r][0];
            for (int a = 1; a < accs; a++) sum = _mm256_add_ps(sum, acc[r][a]);
            y[r * N + n] = total(sum);
        }
    }
}

static void fused(const float *x, long rows, long K, const uint8_t *packed, long N, float *y) {
    switch (rows) {
    case 1: fused_rows(x, 1, K, packed, N, y); break;
    case 2: fused_rows(x, 2, K, packed, N, y); break;
    case 3: fused_rows(x, 3, K, packed, N, y); break;
    case 4: fused_rows(x, 4, K, packed, N, y); break;
    case 5: fused_rows(x, 5, K, packed, N, y); break;
    case 6: fused_rows(x, 6, K, packed, N, y); break;
    case 7: fused_rows(x, 7, K, packed, N, y); break;
    default: fused_rows(x, 8, K, packed, N, y); break;
    }
}

/* Inputs of more rows go FUSED_ROWS at a time: each pass reads the weights once more, which a prefill's many
   rows would rather not (swarm.models.matmul times the forms and keeps F.linear where it is faster). */
void int4_matmul(const float *x, long M, long K, const uint8_t *packed, long N, float *y) {
    for (long r = 0; r < M; r += FUSED_ROWS)
        fused(x + r * K, M - r < FUSED_ROWS ? M - r : FUSED_ROWS, K, packed, N, y + r * N);
}
