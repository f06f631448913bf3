/* y[M][N] = x[M][K] @ W^T for weights stored as 4-bit blocks (swarm/models/backends/cpu/int4.py), float32 in and out.

   W[n][k] = d * q + m for the block of 32 holding k, rounded as transformers widens a GGUF Q4_1 block: the
   product d * q, then the sum. The kernel widens with one fused multiply-add, which rounds the same: d is a
   float16 value (11 significant bits) and q < 16 (4 bits), so d * q is exact in float32 and the sum is the only
   rounding either way (and one step fewer per 8 weights). Every other step is compiled with -ffp-contract=off. Each weight is thus bit for bit the
   float32 weight it stands for; only the order of the sums over k differs from F.linear.

   A packed row of K weights: K/2 bytes of nibbles (byte j of a block holds q[j] low and q[j + 16] high), then
   K/32 float32 scales d, then K/32 float32 minimums m. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 32
#define FUSED_ROWS 8
/* Packed rows ahead of the one in use whose bytes are fetched into the cache meanwhile: without it, inputs of
   several rows leave the core waiting on memory (docs/benchmarks.md). */
#define PREFETCH_AHEAD 2
#define MAX_HEAD_DIM 512 /* decode_layer's rotary scratch; int4.py's MAX_HEAD_DIM */
#define LINE_FLOATS 16   /* floats in a 64-byte cache line */

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
        w[i] = _mm256_fmadd_ps(q, scale, least); /* d * q is exact: one rounding, as in d * q + m (see top) */
    }
}

static inline float total(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* packed row n of N (each `stride` bytes), once the one PREFETCH_AHEAD rows on is on its way into the cache */
static inline const uint8_t *packed_row(const uint8_t *packed, long n, long N, long stride) {
    const uint8_t *row = packed + n * stride;
    if (n + PREFETCH_AHEAD < N)
        for (long o = 0; o < stride; o += 64)
            _mm_prefetch((const char *)(row + PREFETCH_AHEAD * stride + o), _MM_HINT_T0);
    return row;
}

/* `rows` (1 to FUSED_ROWS, a constant once inlined) input rows: each block is widened in registers and used by
   every row at once; a row has several accumulators when few rows leave registers free, so that consecutive
   multiply-adds do not wait on each other. */
static inline __attribute__((always_inline)) void fused_rows(const float *x, const int rows, long K,
                                                             const uint8_t *packed, long N, float *y) {
    const int accs = rows == 1 ? 4 : rows <= 4 ? 2 : 1;
    long blocks = K / BLOCK, stride = K / 2 + 2 * blocks * (long)sizeof(float);
    for (long n = 0; n < N; n++) {
        const uint8_t *row = packed_row(packed, n, N, stride);
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

#ifdef __AVX512F__
/* fused_rows for AVX-512 (int4.py compiles it where torch finds AVX-512): a block's 16 possible weights,
   d * q + m for q = 0 .. 15, are one multiply-add of a register, and its 32 weights are two permutes of that
   table by their nibbles, instead of four int-to-float conversions and four multiply-adds (each weight is
   the same float32 as widen's). Faster for up to TABLE_ROWS rows; past them, where the inputs' loads bind,
   fused_rows stays faster (docs/benchmarks.md). */
#define TABLE_ROWS 6
static inline __attribute__((always_inline)) void table_rows(const float *x, const int rows, long K,
                                                             const uint8_t *packed, long N, float *y) {
    const int accs = rows <= 2 ? 2 : 1; /* two chains a row while few rows leave the adder waiting */
    long blocks = K / BLOCK, stride = K / 2 + 2 * blocks * (long)sizeof(float);
    const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (long n = 0; n < N; n++) {
        const uint8_t *row = packed_row(packed, n, N, stride);
        const float *d = (const float *)(row + K / 2), *m = d + blocks;
        __m512 acc[TABLE_ROWS][2];
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (long b = 0; b < blocks; b++) {
            /* permutexvar reads the low 4 bits of each 32-bit index: byte j's low nibble as it is, the high
               one shifted down (q[j] and q[j + 16]) */
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b * (BLOCK / 2))));
            __m512 table = _mm512_fmadd_ps(levels, _mm512_set1_ps(d[b]), _mm512_set1_ps(m[b]));
            __m512 low = _mm512_permutexvar_ps(bytes, table);
            __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
                const float *xr = x + r * K + b * BLOCK;
                acc[r][0] = _mm512_fmadd_ps(low, _mm512_loadu_ps(xr), acc[r][0]);
                acc[r][accs - 1] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xr + 16), acc[r][accs - 1]);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
            y[r * N + n] = _mm512_reduce_add_ps(accs == 2 ? _mm512_add_ps(acc[r][0], acc[r][1]) : acc[r][0]);
    }
}
#endif

#ifdef __AVX512F__
#define few_rows table_rows /* calls of up to TABLE_ROWS rows */
#else
#define few_rows fused_rows
#endif

static void fused(const float *x, long rows, long K, const uint8_t *packed, long N, float *y) {
    switch (rows) {
    case 1: few_rows(x, 1, K, packed, N, y); break;
    case 2: few_rows(x, 2, K, packed, N, y); break;
    case 3: few_rows(x, 3, K, packed, N, y); break;
    case 4: few_rows(x, 4, K, packed, N, y); break;
    case 5: few_rows(x, 5, K, packed, N, y); break;
    case 6: few_rows(x, 6, K, packed, N, y); break;
    case 7: fused_rows(x, 7, K, packed, N, y); break;
    default: fused_rows(x, 8, K, packed, N, y); break;
    }
}

/* Inputs of more rows go FUSED_ROWS at a time: each pass reads the weights once more, which a prefill's many
   rows would rather not (swarm.models.backends.cpu.matmul times the forms and keeps F.linear where it is faster). Each
   packed row is multiplied by all of a pass's inputs, so a pass's inputs should stay in the L1 data cache: wide
   ones (an MLP's down projection, 1536 columns: 6 KB a row) go at most L1_INPUT_BYTES a pass, unless the pass
   would leave one or two rows over. */
#define L1_INPUT_BYTES 24576
void int4_matmul(const float *x, long M, long K, const uint8_t *packed, long N, float *y) {
    long pass = K > 0 ? L1_INPUT_BYTES / (K * (long)sizeof(float)) : FUSED_ROWS;
    pass = pass < 1 ? 1 : pass > FUSED_ROWS ? FUSED_ROWS : pass;
    if (M <= pass + 2 && M <= FUSED_ROWS) pass = M;
    for (long r = 0; r < M; r += pass)
        fused(x + r * K, M - r < pass ? M - r : pass, K, packed, N, y + r * N);
}

/* ---- one decoder layer for decode steps (one token per session), all in one call --------------------------

   What swarm.models.backends.generic runs for a Llama-family layer, written out for rows of one token each, so that a
   decode step pays no interpreter or dispatch cost per operation (on a CPU those cost more than the layer's
   products for one row). Each step rounds as torch does it (products,
   then sums; -ffp-contract=off), except the sums of a norm and of attention, which are taken in another order
   (as the products are), and exp (exp8, or libm's for the last few of a row). */

/* e^x for 8 floats (Cephes' expf: 2^n times a polynomial on |r| <= ln 2 / 2; within a few ulp of libm's, as
   torch's own vectorised exp is), for inputs clamped to +-88.376 (results of ~1e-38 to ~3e38) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                             _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

/* out = weight * (h * (1 / sqrt(mean(h^2) + eps))), transformers' RMSNorm in float32 */
static void rms_norm(const float *h, long n, const float *weight, float eps, float *out) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(h + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float squares = total(acc);
    for (; i < n; i++) squares += h[i] * h[i];
    float scale = 1.0f / sqrtf(squares / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = weight[i] * (h[i] * scale);
}

/* x * cos + rotate_half(x) * sin for one head, rotate_half(x) = (-x[half:], x[:half]) */
static void rope(float *x, long dim, const float *cos, const float *sin) {
    long half = dim / 2;
    float rotated[MAX_HEAD_DIM];
    for (long i = 0; i < half; i++) rotated[i] = -x[i + half];
    for (long i = half; i < dim; i++) rotated[i] = x[i - half];
    for (long i = 0; i < dim; i++) x[i] = x[i] * cos[i] + rotated[i] * sin[i];
}

static float dot(const float *a, const float *b, long n) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    float sum = total(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* softmax(q . K^T * scale) V over `length` keys of one kv head: [dim] into out */
/* q . k for 8 keys one after another, dim a multiple of 8: each key's sums in a register, then added across */
static inline __m256 dots8(const float *q, const float *keys, long dim) {
    __m256 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
    for (long i = 0; i < dim; i += 8) {
        __m256 qi = _mm256_loadu_ps(q + i);
        for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(keys + k * dim + i), acc[k]);
    }
    __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 low = _mm256_hadd_ps(s01, s23), high = _mm256_hadd_ps(s45, s67);  /* per 128-bit half */
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

/* A kv head's cache in blocks: token j's row is at base + (table[j / block] * block + j % block) * dim (the
   pool's blocks of that kv head one after another, block rows each). A contiguous cache is one block. */
typedef struct {
    const float *base;
    const int64_t *table;
    long block;
} paged;

static inline const float *paged_block(paged c, long j0, long dim) { return c.base + c.table[j0 / c.block] * c.block * dim; }

/* out[8 * lanes] = sum over j of p[j] * values[j] (each row's elements from `offset`), the sums over j in order
   for each element (as a plain loop adds them) in registers: written to memory and read back for every key
   instead, they would hold decode attention to the store and load ports. The results are bit for bit the same.
   `lanes` is a constant once inlined, so the sums stay in registers. */
static inline __attribute__((always_inline)) void weigh_lanes(const float *p, paged values, long offset, long length,
                                                              long dim, const int lanes, float *out) {
    __m256 acc[8];
    for (int c = 0; c < lanes; c++) acc[c] = _mm256_setzero_ps();
    for (long j0 = 0; j0 < length; j0 += values.block) {
        const float *rows = paged_block(values, j0, dim) + offset;
        long n = length - j0 < values.block ? length - j0 : values.block;
        for (long j = 0; j < n; j++) {
            __m256 pj = _mm256_set1_ps(p[j0 + j]);
            const float *v = rows + j * dim;
            for (int c = 0; c < lanes; c++)
                acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(pj, _mm256_loadu_ps(v + 8 * c)));
        }
    }
    for (int c = 0; c < lanes; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

/* out[dim] = sum over j of p[j] * values[j]: 64 elements at a time, then 8, then one */
static void weigh_values(const float *p, paged values, long length, long dim, float *out) {
    long i = 0;
    for (; i + 64 <= dim; i += 64) weigh_lanes(p, values, i, length, dim, 8, out + i);
    for (; i + 8 <= dim; i += 8) weigh_lanes(p, values, i, length, dim, 1, out + i);
    for (; i < dim; i++) {
        float o = 0.0f;
        for (long j0 = 0; j0 < length; j0 += values.block) {
            const float *rows = paged_block(values, j0, dim);
            long n = length - j0 < values.block ? length - j0 : values.block;
            for (long j = 0; j < n; j++) o += p[j0 + j] * rows[j * dim + i];
        }
        out[i] = o;
    }
}

/* softmax(q . K^T * scale) V over `length` keys of one kv head, for the `group` query heads that share it
   (q and out [group][dim]; scores [group][length]): each key is read once for the whole group, the values once
   per head of it (from the core's caches after the first: a kv head's values at 1024 tokens are 256 KB). */
static void attend(const float *q, long group, paged keys, paged values, long length, long dim,
                   float scale, float *scores, float *out) {
    long j;
    /* 8 keys at a time within a block (a block's rows are a multiple of 8, or it is the only one), then one */
    for (long j0 = 0; j0 < length; j0 += keys.block) {
        const float *rows = paged_block(keys, j0, dim);
        long n = length - j0 < keys.block ? length - j0 : keys.block;
        j = 0;
        if (dim % 8 == 0)
            for (; j + 8 <= n; j += 8)
                for (long h = 0; h < group; h++)
                    _mm256_storeu_ps(scores + h * length + j0 + j,
                                     _mm256_mul_ps(dots8(q + h * dim, rows + j * dim, dim), _mm256_set1_ps(scale)));
        for (; j < n; j++)
            for (long h = 0; h < group; h++)
                scores[h * length + j0 + j] = dot(q + h * dim, rows + j * dim, dim) * scale;
    }
    float sums[group];
    for (long h = 0; h < group; h++) {
        float *row = scores + h * length, most = -INFINITY;
        for (j = 0; j < length; j++) most = row[j] > most ? row[j] : most;
        __m256 partial = _mm256_setzero_ps(), top = _mm256_set1_ps(most);
        for (j = 0; j + 8 <= length; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), top));
            _mm256_storeu_ps(row + j, e);
            partial = _mm256_add_ps(partial, e);
        }
        sums[h] = total(partial);
        for (; j < length; j++) {
            row[j] = expf(row[j] - most);
            sums[h] += row[j];
        }
    }
    for (long h = 0; h < group; h++) {  /* the weights, each rounded once as score / sum */
        float *row = scores + h * length;
        __m256 sum = _mm256_set1_ps(sums[h]);
        for (j = 0; j + 8 <= length; j += 8) _mm256_storeu_ps(row + j, _mm256_div_ps(_mm256_loadu_ps(row + j), sum));
        for (; j < length; j++) row[j] = row[j] / sums[h];
        weigh_values(row, values, length, dim, out + h * dim);
    }
}

/* h [rows, hidden] += the layer's attention and MLP, each row one new token of a session. Rows are taken in
   order, each cached before the next attends, so consecutive rows of one session (one cache, lengths counting
   up) attend causally to each other.
   Packed weights as int4_matmul takes them: q|k|v one after another, o, gate|up one after another, down.
   cos, sin [rows, head_dim]: each row's rotary angles. keys[r], values[r]: row r's cache of this layer, a pool
   [kv_heads, pools[r], blocks[r], head_dim] of pools[r] blocks of blocks[r] tokens, of which its session holds
   tables[r] in order; its first lengths[r] tokens are cached, and this token goes after them.
   Returns 0, or -1 if scratch memory could not be had (h is then unchanged). */
int decode_layer(float *h, long rows, long hidden, const float *norm_in, const float *norm_post, float eps,
                 const uint8_t *qkv, const uint8_t *o, const uint8_t *gate_up, const uint8_t *down,
                 long intermediate, long heads, long kv_heads, long head_dim, float scale, const float *cos,
                 const float *sin, float *const *keys, float *const *values, const int64_t *const *tables,
                 const long *blocks, const long *pools, const long *lengths) {
    long q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
    long longest = 0;
    for (long r = 0; r < rows; r++) longest = lengths[r] + 1 > longest ? lengths[r] + 1 : longest;
    if (head_dim > MAX_HEAD_DIM) return -1;
    /* Each part of the scratch starts on a cache line: the products' inputs are read a register at a time,
       and a 64-byte read across two lines costs two. */
    long sizes[7] = {rows * hidden, rows * qkv_width, rows * q_width, rows * 2 * intermediate, rows * intermediate,
                     rows * hidden, heads / kv_heads * longest}, starts[7];
    long floats = 0;
    for (int i = 0; i < 7; i++) {
        starts[i] = floats;
        floats += (sizes[i] + LINE_FLOATS - 1) / LINE_FLOATS * LINE_FLOATS;
    }
    float *scratch = aligned_alloc(LINE_FLOATS * sizeof(float), (floats ? floats : LINE_FLOATS) * sizeof(float));
    if (!scratch) return -1;
    float *part[7];
    for (int i = 0; i < 7; i++) part[i] = scratch + starts[i];
    float *x = part[0], *projected = part[1], *attended = part[2], *gated = part[3], *act = part[4];
    float *back = part[5], *scores = part[6];
    long group = heads / kv_heads;

    for (long r = 0; r < rows; r++) rms_norm(h + r * hidden, hidden, norm_in, eps, x + r * hidden);
    int4_matmul(x, rows, hidden, qkv, qkv_width, projected);
    for (long r = 0; r < rows; r++) {
        float *q = projected + r * qkv_width, *k = q + q_width, *v = k + kv_width;
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (long head = 0; head < heads; head++) rope(q + head * head_dim, head_dim, c, s);
        long at = lengths[r], block = blocks[r], head_floats = pools[r] * block * head_dim;
        long row = (tables[r][at / block] * block + at % block) * head_dim;  /* within a kv head's pool */
        for (long kv = 0; kv < kv_heads; kv++) {
            rope(k + kv * head_dim, head_dim, c, s);
            float *kc = keys[r] + kv * head_floats + row, *vc = values[r] + kv * head_floats + row;
            for (long i = 0; i < head_dim; i++) {
                kc[i] = k[kv * head_dim + i];
                vc[i] = v[kv * head_dim + i];
            }
        }
        for (long kv = 0; kv < kv_heads; kv++) {  /* query heads kv * group .. (kv + 1) * group - 1 share it */
            paged kh = {keys[r] + kv * head_floats, tables[r], block}, vh = {values[r] + kv * head_floats, tables[r], block};
            attend(q + kv * group * head_dim, group, kh, vh, at + 1, head_dim, scale, scores,
                   attended + r * q_width + kv * group * head_dim);
        }
    }
    int4_matmul(attended, rows, q_width, o, hidden, back);
    for (long i = 0; i < rows * hidden; i++) h[i] = h[i] + back[i];

    for (long r = 0; r < rows; r++) rms_norm(h + r * hidden, hidden, norm_post, eps, x + r * hidden);
    int4_matmul(x, rows, hidden, gate_up, 2 * intermediate, gated);
    for (long r = 0; r < rows; r++) {
        const float *gate = gated + r * 2 * intermediate, *up = gate + intermediate;
        float *out = act + r * intermediate;
        long i = 0;
        for (; i + 8 <= intermediate; i += 8) {  /* silu(gate) * up, silu(g) = g / (1 + e^-g) */
            __m256 g = _mm256_loadu_ps(gate + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
        for (; i < intermediate; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    int4_matmul(act, rows, intermediate, down, hidden, back);
    for (long i = 0; i < rows * hidden; i++) h[i] = h[i] + back[i];
    free(scratch);
    return 0;
}

/* decode_layer for `layers` consecutive layers in one call: a decode call of a peer's whole range pays no
   interpreter cost between its layers. Per layer its weights, norms and eps (arrays of `layers`); per layer and
   row its cache (arrays of layers * rows, each layer's rows together). Returns 0, or -1 as decode_layer does
   (h then holds the layers before the one that failed). */
int decode_layers(float *h, long rows, long hidden, long layers, const float *const *norm_in,
                  const float *const *norm_post, const float *eps, const uint8_t *const *qkv,
                  const uint8_t *const *o, const uint8_t *const *gate_up, const uint8_t *const *down,
                  long intermediate, long heads, long kv_heads, long head_dim, float scale, const float *cos,
                  const float *sin, float *const *keys, float *const *values, const int64_t *const *tables,
                  const long *blocks, const long *pools, const long *lengths) {
    for (long l = 0; l < layers; l++) {
        long at = l * rows;
        int failed = decode_layer(h, rows, hidden, norm_in[l], norm_post[l], eps[l], qkv[l], o[l], gate_up[l],
                                  down[l], intermediate, heads, kv_heads, head_dim, scale, cos, sin, keys + at,
                                  values + at, tables + at, blocks + at, pools + at, lengths + at);
        if (failed) return failed;
    }
    return 0;
}

/* W[N][K] widened to float32 into out (the weights exactly as transformers widens them, see the top): for the
   products of inputs of more rows than int4_matmul serves best, through a scratch buffer the caller reuses. */
void int4_widen(const uint8_t *packed, long N, long K, float *out) {
    const long stride = K / 2 + 8 * (K / BLOCK), blocks = K / BLOCK;
    for (long n = 0; n < N; n++) {
        const uint8_t *row = packed + n * stride;
        const float *d = (const float *)(row + K / 2), *m = d + blocks;
        float *o = out + n * K;
        for (long b = 0; b < blocks; b++) {
            __m256 w[4];
            widen(row + b * (BLOCK / 2), d[b], m[b], w);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + b * BLOCK + 8 * i, w[i]);
        }
    }
}
