/* sdcguard's per-step CPU kernels: one pass, one call, whatever the number of tensors.
 *
 * Loaded by detection/native.py (compiled on first use, cached per source and CPU). Written
 * with GCC/Clang vector extensions, whose lanes are part of the program: the compiler maps a
 * 16-lane vector onto whatever the CPU has (one AVX-512 register, two AVX2 ones, four NEON
 * ones) without changing which element goes to which lane or the order lanes are combined in.
 * Every floating-point result is therefore a function of the input values alone, the same on
 * every CPU and build (with -ffp-contract=off, so no fused multiply-add changes a rounding);
 * the integer ones are exact. Ranks on different CPUs compute the same bits, which the exact
 * cross-replica comparison of reduced-bucket sums relies on.
 *
 * Lane order, shared by every reduction here: element i of an array goes to lane i % 16; lanes
 * are combined by the fixed tree (j, j + 8), then (j, j + 4), (j, j + 2), (j, j + 1).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

typedef float v16f __attribute__((vector_size(64)));
typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint64_t v8q __attribute__((vector_size(64)));
typedef float v4f __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));
typedef uint64_t v4q __attribute__((vector_size(32)));

static inline v16f load16f(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The first `n` (< 16) elements of p in lanes 0..n-1, zeros above. */
static inline v16f partial16f(const float *p, int64_t n) {
    float t[LANES] = {0};
    memcpy(t, p, (size_t)n * sizeof(float));
    v16f v;
    memcpy(&v, t, sizeof v);
    return v;
}

static inline float tree16f(v16f a) {
    float t[LANES];
    memcpy(t, &a, sizeof t);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) t[j] = t[j] + t[j + w];
    return t[0];
}

static inline double tree16d(v8d lo, v8d hi) {
    double t[LANES];
    memcpy(t, &lo, sizeof lo);
    memcpy(t + 8, &hi, sizeof hi);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) t[j] = t[j] + t[j + w];
    return t[0];
}

static inline v16u max16u(v16u a, v16u b) {
    v16u m = (v16u)(a > b);
    return (a & m) | (b & ~m);
}

static inline uint32_t hmax16u(v16u a) {
    uint32_t t[LANES], m = 0;
    memcpy(t, &a, sizeof t);
    for (int j = 0; j < LANES; j++) m = t[j] > m ? t[j] : m;
    return m;
}

/* Lane-wise Σ x² and max |x| (as bit patterns below the sign bit) of one block. */
static inline void square_and_peak(v16f v, v16f *sq, v16u *peak) {
    const v16u abs_bits = (v16u){0} + 0x7fffffffu;
    v16u bits;
    memcpy(&bits, &v, sizeof bits);
    *sq += v * v;
    *peak = max16u(bits & abs_bits, *peak);
}

/* out[0] = Σ x as float64; with what == 3 also out[1] = ‖x‖₂ (float32 Σ x² in the lane order,
 * then sqrtf) and out[2] = max |x| (exact; NaN if any element is NaN: a NaN's bit pattern
 * exceeds every other). The sum:
 *   chunk > 0 (a multiple of 16): float32 sums of consecutive chunks of `chunk` elements (each
 *     in the lane order) added one by one in float64, then the tail after the last whole chunk
 *     as one float32 sum in index order;
 *   chunk == 0: every element added in float64, in the lane order. */
#if defined(__AVX512F__)
void sdc_stats_f32(const float *x, int64_t n, int64_t chunk, int32_t what, double *out) {
    v16f sq = {0};
    v16u peak = {0};
    const int full = what == 3;
    double total = 0.0;
    int64_t whole = n - n % LANES;
    if (chunk <= 0) {
        v8d lo = {0}, hi = {0};
        for (int64_t i = 0; i < n; i += LANES) {
            v16f v = i < whole ? load16f(x + i) : partial16f(x + i, n - i);
            v8f a, b;
            memcpy(&a, &v, sizeof a);
            memcpy(&b, (const char *)&v + sizeof a, sizeof b);
            lo += __builtin_convertvector(a, v8d);
            hi += __builtin_convertvector(b, v8d);
            if (full) square_and_peak(v, &sq, &peak);
        }
        total = tree16d(lo, hi);
    } else {
        int64_t head = n - n % chunk;
        for (int64_t c = 0; c < head; c += chunk) {
            v16f acc = {0};
            for (int64_t k = 0; k < chunk; k += LANES) {
                v16f v = load16f(x + c + k);
                acc += v;
                if (full) square_and_peak(v, &sq, &peak);
            }
            total += (double)tree16f(acc);
        }
        float tail = 0.0f;
        for (int64_t i = head; i < n; i++) tail += x[i];
        total += (double)tail;
        if (full)
            for (int64_t i = head; i < n; i += LANES) {
                v16f v = i < whole ? load16f(x + i) : partial16f(x + i, n - i);
                square_and_peak(v, &sq, &peak);
            }
    }
    out[0] = total;
    if (full) {
        uint32_t m = hmax16u(peak);
        float mf;
        memcpy(&mf, &m, sizeof mf);
        out[1] = (double)sqrtf(tree16f(sq));
        out[2] = (double)mf;
    }
}
#else
/* The same function on a CPU without 64-byte vectors (AVX2, NEON): a 16-lane vector is a type
 * GCC keeps in memory there, every operation a round trip through the stack (a bucket's sum ran
 * eight times slower than torch's). Here the 16 float lanes are two 8-lane halves (lanes 0-7
 * and 8-15) and the 16 float64 lanes four quarters, each lane fed the same elements in the same
 * order and the lanes combined by the same tree: the same bits as above, on every CPU. */
typedef int32_t v8i __attribute__((vector_size(32)));

/* Lanes 0-7 and 8-15 of the 16 elements at p, of which the first n (zeros above). */
static inline void load_halves(const float *p, int64_t n, v8f *lo, v8f *hi) {
    float t[LANES] = {0};
    const float *from = p;
    if (n < LANES) {
        memcpy(t, p, (size_t)n * sizeof(float));
        from = t;
    }
    memcpy(lo, from, sizeof *lo);
    memcpy(hi, from + 8, sizeof *hi);
}

/* tree16f of the 16 lanes held as two halves: (j, j + 8) is lo + hi. */
static inline float tree_halves(v8f lo, v8f hi) {
    v8f s = lo + hi;
    float t[8];
    memcpy(t, &s, sizeof t);
    for (int w = 4; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) t[j] = t[j] + t[j + w];
    return t[0];
}

/* Each lane of an 8-lane half added, in float64, to its two quarters' accumulators. */
static inline void widen_into(v8f v, v4d *a, v4d *b) {
    v4f x, y;
    memcpy(&x, &v, sizeof x);
    memcpy(&y, (const char *)&v + sizeof x, sizeof y);
    *a += __builtin_convertvector(x, v4d);
    *b += __builtin_convertvector(y, v4d);
}

/* tree16d of the 16 float64 lanes held as quarters (lanes 0-3, 4-7, 8-11, 12-15). */
static inline double tree_quarters(v4d q0, v4d q1, v4d q2, v4d q3) {
    v4d s = (q0 + q2) + (q1 + q3); /* (j, j + 8), then (j, j + 4) */
    double t[4];
    memcpy(t, &s, sizeof t);
    t[0] = t[0] + t[2];
    t[1] = t[1] + t[3];
    return t[0] + t[1];
}

static inline void peak_into(v8f v, v8i *peak) {
    const v8i abs_bits = (v8i){0} + 0x7fffffff; /* non-negative: a signed max orders them */
    v8i bits;
    memcpy(&bits, &v, sizeof bits);
    bits &= abs_bits;
    v8i m = (v8i)(bits > *peak);
    *peak = (bits & m) | (*peak & ~m);
}

static inline void square_and_peak_halves(v8f lo, v8f hi, v8f *sq_lo, v8f *sq_hi, v8i *peak) {
    *sq_lo += lo * lo;
    *sq_hi += hi * hi;
    peak_into(lo, peak);
    peak_into(hi, peak);
}

void sdc_stats_f32(const float *x, int64_t n, int64_t chunk, int32_t what, double *out) {
    v8f sq_lo = {0}, sq_hi = {0}, lo, hi;
    v8i peak = {0};
    const int full = what == 3;
    double total = 0.0;
    if (chunk <= 0) {
        v4d q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
        for (int64_t i = 0; i < n; i += LANES) {
            load_halves(x + i, n - i, &lo, &hi);
            widen_into(lo, &q0, &q1);
            widen_into(hi, &q2, &q3);
            if (full) square_and_peak_halves(lo, hi, &sq_lo, &sq_hi, &peak);
        }
        total = tree_quarters(q0, q1, q2, q3);
    } else {
        int64_t head = n - n % chunk;
        for (int64_t c = 0; c < head; c += chunk) {
            v8f acc_lo = {0}, acc_hi = {0};
            for (int64_t k = 0; k < chunk; k += LANES) {
                load_halves(x + c + k, LANES, &lo, &hi);
                acc_lo += lo;
                acc_hi += hi;
                if (full) square_and_peak_halves(lo, hi, &sq_lo, &sq_hi, &peak);
            }
            total += (double)tree_halves(acc_lo, acc_hi);
        }
        float tail = 0.0f;
        for (int64_t i = head; i < n; i++) tail += x[i];
        total += (double)tail;
        if (full)
            for (int64_t i = head; i < n; i += LANES) {
                load_halves(x + i, n - i, &lo, &hi);
                square_and_peak_halves(lo, hi, &sq_lo, &sq_hi, &peak);
            }
    }
    out[0] = total;
    if (full) {
        int32_t t[8], m = 0;
        memcpy(t, &peak, sizeof t);
        for (int j = 0; j < 8; j++) m = t[j] > m ? t[j] : m;
        float mf;
        memcpy(&mf, &m, sizeof mf);
        out[1] = (double)sqrtf(tree_halves(sq_lo, sq_hi));
        out[2] = (double)mf;
    }
}
#endif

/* Integer vectors of the CPU's own width. An integer maximum is the same whatever the lanes,
 * so these kernels need not keep the 16-lane order the float sums keep; and a vector wider
 * than the CPU's registers is what GCC lowers worst (on an AVX2 CPU a 64-byte integer compare
 * and blend ran ten times slower than the same loop over 32-byte vectors). */
#if defined(__AVX512F__)
#define INT_VECTOR_BYTES 64
#elif defined(__AVX2__)
#define INT_VECTOR_BYTES 32
#else
#define INT_VECTOR_BYTES 16
#endif
typedef int16_t vs16 __attribute__((vector_size(INT_VECTOR_BYTES)));
typedef int32_t vs32 __attribute__((vector_size(INT_VECTOR_BYTES)));
typedef int64_t vs64 __attribute__((vector_size(INT_VECTOR_BYTES)));

/* max over elements of the bits below the sign bit, for one word width: the element is NaN or
 * ±Inf exactly when that is at least the all-ones exponent pattern. The masked words are
 * non-negative as signed integers, so the signed comparison the CPU has (AVX2 has no unsigned
 * one) orders them as the unsigned one would. */
#define MAX_ABS(NAME, T, S, V, MASK)                                               \
    static T NAME(const T *w, int64_t n) {                                         \
        const int k = (int)(sizeof(V) / sizeof(S));                                \
        V acc = {0};                                                               \
        const V mask = (V){0} + (S)(MASK);                                         \
        int64_t head = n - n % k;                                                  \
        for (int64_t i = 0; i < head; i += k) {                                    \
            V v;                                                                   \
            memcpy(&v, w + i, sizeof v);                                           \
            v &= mask;                                                             \
            V m = (V)(v > acc);                                                    \
            acc = (v & m) | (acc & ~m);                                            \
        }                                                                          \
        S t[sizeof(V) / sizeof(S)], r = 0;                                         \
        memcpy(t, &acc, sizeof t);                                                 \
        for (int j = 0; j < k; j++) r = t[j] > r ? t[j] : r;                       \
        for (int64_t i = head; i < n; i++) {                                       \
            S a = (S)(w[i] & (MASK));                                              \
            r = a > r ? a : r;                                                     \
        }                                                                          \
        return (T)r;                                                               \
    }

MAX_ABS(max_abs16, uint16_t, int16_t, vs16, 0x7fffu)
MAX_ABS(max_abs32, uint32_t, int32_t, vs32, 0x7fffffffu)
MAX_ABS(max_abs64, uint64_t, int64_t, vs64, 0x7fffffffffffffffull)

/* Kinds of floating-point storage: their non-finite exponent patterns. */
enum { KIND_F16 = 0, KIND_BF16 = 1, KIND_F32 = 2, KIND_F64 = 3 };

/* 1 if any element of any of the `count` arrays is NaN or ±Inf, 0 if none, -1 for a kind it
 * has no code for. */
int32_t sdc_nonfinite(int64_t count, const void *const *ptrs, const int64_t *numels,
                      const int32_t *kinds) {
    for (int64_t t = 0; t < count; t++) {
        int bad = 0;
        switch (kinds[t]) {
        case KIND_F16: bad = max_abs16((const uint16_t *)ptrs[t], numels[t]) >= 0x7c00u; break;
        case KIND_BF16: bad = max_abs16((const uint16_t *)ptrs[t], numels[t]) >= 0x7f80u; break;
        case KIND_F32: bad = max_abs32((const uint32_t *)ptrs[t], numels[t]) >= 0x7f800000u; break;
        case KIND_F64:
            bad = max_abs64((const uint64_t *)ptrs[t], numels[t]) >= 0x7ff0000000000000ull;
            break;
        default: return -1;
        }
        if (bad) return 1;
    }
    return 0;
}

static inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A += Σ w_i, B += Σ (splitmix64(o + i) | 1)·w_i (mod 2^64) over one array of unsigned words
 * (detection/fingerprint.py defines both and proves what they catch): integer sums, so any
 * order gives the same bits. Written as eight scalar lanes, which the compiler vectorises (on
 * AVX-512 with native 64-bit multiplies) faster than the same loop in vector types. */
#define FINGERPRINT(NAME, T)                                                   \
    static void NAME(const T *w, int64_t n, uint64_t o, uint64_t *a, uint64_t *b) { \
        uint64_t sa[8] = {0}, sb[8] = {0};                                         \
        int64_t head = n - n % 8;                                                  \
        for (int64_t i = 0; i < head; i += 8)                                      \
            for (int j = 0; j < 8; j++) {                                          \
                uint64_t v = (uint64_t)w[i + j];                                   \
                sa[j] += v;                                                        \
                sb[j] += (splitmix64(o + (uint64_t)(i + j)) | 1ull) * v;           \
            }                                                                      \
        for (int j = 0; j < 8; j++) {                                              \
            *a += sa[j];                                                           \
            *b += sb[j];                                                           \
        }                                                                          \
        for (int64_t i = head; i < n; i++) {                                       \
            uint64_t v = (uint64_t)w[i];                                           \
            *a += v;                                                               \
            *b += (splitmix64(o + (uint64_t)i) | 1ull) * v;                        \
        }                                                                          \
    }

FINGERPRINT(fingerprint8, uint8_t)
FINGERPRINT(fingerprint16, uint16_t)
FINGERPRINT(fingerprint32, uint32_t)
FINGERPRINT(fingerprint64, uint64_t)

/* out[0], out[1] = the fingerprint (A, B) of `count` arrays of `sizes[t]`-byte words, each
 * placed at global offset offsets[t]. Returns 0, or -1 for a word size it has no kernel for. */
int32_t sdc_fingerprint(int64_t count, const void *const *ptrs, const int64_t *numels,
                        const int32_t *sizes, const int64_t *offsets, int64_t *out) {
    uint64_t a = 0, b = 0;
    for (int64_t t = 0; t < count; t++) {
        uint64_t o = (uint64_t)offsets[t];
        switch (sizes[t]) {
        case 1: fingerprint8((const uint8_t *)ptrs[t], numels[t], o, &a, &b); break;
        case 2: fingerprint16((const uint16_t *)ptrs[t], numels[t], o, &a, &b); break;
        case 4: fingerprint32((const uint32_t *)ptrs[t], numels[t], o, &a, &b); break;
        case 8: fingerprint64((const uint64_t *)ptrs[t], numels[t], o, &a, &b); break;
        default: return -1;
        }
    }
    memcpy(&out[0], &a, sizeof a);
    memcpy(&out[1], &b, sizeof b);
    return 0;
}

/* ---- ABFT of nn.Linear and the affine normalisations (detection/abft_layers.py): the
 * checksums' passes fused, one read of each operand instead of two or three. Nothing here is
 * compared across ranks, so the lane order only has to be as accurate as torch's reductions
 * (float32 lanes for the row reductions; the column and channel sums in float64). */

/* The vector these passes use: the CPU's own width (16 lanes with AVX-512, 8 elsewhere, where
 * a 64-byte vector is kept in memory: see sdc_stats_f32). These sums need not be the same bits
 * on every CPU. */
#if defined(__AVX512F__)
#define ALANES 16
typedef v16f vrow;
static inline vrow load_row(const float *p) { return load16f(p); }
static inline vrow partial_row(const float *p, int64_t n) { return partial16f(p, n); }
static inline float tree_row(vrow a) { return tree16f(a); }
#else
#define ALANES 8
typedef v8f vrow;
static inline vrow load_row(const float *p) {
    vrow v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vrow partial_row(const float *p, int64_t n) {
    float t[ALANES] = {0};
    memcpy(t, p, (size_t)n * sizeof(float));
    vrow v;
    memcpy(&v, t, sizeof v);
    return v;
}

static inline float tree_row(vrow a) {
    float t[ALANES];
    memcpy(t, &a, sizeof t);
    for (int w = ALANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) t[j] = t[j] + t[j + w];
    return t[0];
}
#endif

/* Σ_l a_l·b_l and Σ_l a_l² of one row of k floats: float32 lanes, two accumulators each
 * (blocks alternate), so the additions do not wait on one another. */
static inline void dot_and_square(const float *a, const float *b, int64_t k, float *dot,
                                  float *sq) {
    vrow d0 = {0}, d1 = {0}, s0 = {0}, s1 = {0};
    int64_t l = 0;
    for (; l + 2 * ALANES <= k; l += 2 * ALANES) {
        vrow a0 = load_row(a + l), b0 = load_row(b + l);
        vrow a1 = load_row(a + l + ALANES), b1 = load_row(b + l + ALANES);
        d0 += a0 * b0;
        s0 += a0 * a0;
        d1 += a1 * b1;
        s1 += a1 * a1;
    }
    for (; l < k; l += ALANES) {
        int64_t m = k - l < ALANES ? k - l : ALANES;
        vrow va = m == ALANES ? load_row(a + l) : partial_row(a + l, m);
        vrow vb = m == ALANES ? load_row(b + l) : partial_row(b + l, m);
        d0 += va * vb;
        s0 += va * va;
    }
    *dot = tree_row(d0 + d1);
    *sq = tree_row(s0 + s1);
}

/* Σ_j a_j of one row of n floats (float32 lanes, four accumulators); with sq, also Σ_j a_j². */
static inline float row_sum(const float *a, int64_t n, float *sq) {
    vrow c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, s0 = {0}, s1 = {0};
    int64_t j = 0;
    for (; j + 4 * ALANES <= n; j += 4 * ALANES) {
        vrow v0 = load_row(a + j), v1 = load_row(a + j + ALANES);
        vrow v2 = load_row(a + j + 2 * ALANES), v3 = load_row(a + j + 3 * ALANES);
        c0 += v0;
        c1 += v1;
        c2 += v2;
        c3 += v3;
        if (sq) {
            s0 += v0 * v0 + v2 * v2;
            s1 += v1 * v1 + v3 * v3;
        }
    }
    for (; j < n; j += ALANES) {
        int64_t m = n - j < ALANES ? n - j : ALANES;
        vrow v = m == ALANES ? load_row(a + j) : partial_row(a + j, m);
        c0 += v;
        if (sq) s0 += v * v;
    }
    if (sq) *sq = tree_row(s0 + s1);
    return tree_row((c0 + c1) + (c2 + c3));
}

/* The forward row checksum of y = x Wᵀ + b over `rows` rows (x: rows x k, y: rows x n; sums:
 * sdc_col_sums_f32's k + 3 floats [W.sum(0), ‖W‖_F, Σ b, Σ |b|]): residual_i = Σ_j y_ij −
 * x_i · W.sum(0) − Σ b and ‖x_i‖₂, in one pass over x and y. out[0] = max_i |residual_i| /
 * (‖x_i‖₂·‖W‖_F·c_bound + Σ|b|·c + tiny) (NaN when any ratio is NaN, as torch's amax),
 * out[1] = ‖x‖_F. The scalars stay in memory the caller's tensors share: nothing is read
 * back to Python between the two kernels. */
void sdc_linear_forward_f32(const float *x, const float *y, const float *sums, int64_t rows,
                            int64_t k, int64_t n, float c_bound, float c, float tiny,
                            float *out) {
    const float cb = sums[k] * c_bound, b_sum = sums[k + 1], ba = sums[k + 2] * c + tiny;
    float peak = 0.0f;
    int nan = 0;
    double frob = 0.0;
    for (int64_t i = 0; i < rows; i++) {
        float dot, sq;
        dot_and_square(x + i * k, sums, k, &dot, &sq);
        float residual = row_sum(y + i * n, n, NULL) - dot - b_sum;
        float ratio = fabsf(residual) / (sqrtf(sq) * cb + ba);
        if (ratio != ratio)
            nan = 1;
        else if (ratio > peak)
            peak = ratio;
        frob += (double)sq;
    }
    out[0] = nan ? NAN : peak;
    out[1] = (float)sqrt(frob);
}

/* The weight-gradient checksum's read of the output gradient d (rows x n): r_i = Σ_j d_ij
 * (float32) and *norm = ‖d‖_F (its square summed in float64 over rows), one pass. */
void sdc_row_sums_f32(const float *d, int64_t rows, int64_t n, float *r, float *norm) {
    double total = 0.0;
    for (int64_t i = 0; i < rows; i++) {
        float sq;
        r[i] = row_sum(d + i * n, n, &sq);
        total += (double)sq;
    }
    *norm = (float)sqrt(total);
}

/* Once per step, the weight's part of the forward checksum (w: rows x k, bias: rows floats or
 * NULL): out = [col_l = Σ_i w_il (accumulated in float64 in `acc`, k doubles the caller
 * provides, then rounded), ‖w‖_F, Σ b, Σ |b|] (k + 3 floats; float64 sums), one pass. */
void sdc_col_sums_f32(const float *w, int64_t rows, int64_t k, const float *bias, double *acc,
                      float *out) {
    double total = 0.0;
    int64_t whole = k - k % 8;
    memset(acc, 0, (size_t)k * sizeof(double));
    for (int64_t i = 0; i < rows; i++) {
        const float *row = w + i * k;
        v4d s_lo = {0}, s_hi = {0}; /* columns l..l+3 and l+4..l+7 of each block of 8 */
        for (int64_t l = 0; l < whole; l += 8) {
            v4f x, y;
            memcpy(&x, row + l, sizeof x);
            memcpy(&y, row + l + 4, sizeof y);
            v4d a, b;
            memcpy(&a, acc + l, sizeof a);
            memcpy(&b, acc + l + 4, sizeof b);
            v4d xd = __builtin_convertvector(x, v4d), yd = __builtin_convertvector(y, v4d);
            a += xd;
            b += yd;
            s_lo += xd * xd;
            s_hi += yd * yd;
            memcpy(acc + l, &a, sizeof a);
            memcpy(acc + l + 4, &b, sizeof b);
        }
        double t[8];
        memcpy(t, &s_lo, sizeof s_lo);
        memcpy(t + 4, &s_hi, sizeof s_hi);
        for (int j = 0; j < 8; j++) total += t[j];
        for (int64_t l = whole; l < k; l++) {
            acc[l] += (double)row[l];
            total += (double)row[l] * (double)row[l];
        }
    }
    for (int64_t l = 0; l < k; l++) out[l] = (float)acc[l];
    double b_sum = 0.0, b_abs = 0.0;
    if (bias)
        for (int64_t i = 0; i < rows; i++) {
            b_sum += (double)bias[i];
            b_abs += fabs((double)bias[i]);
        }
    out[k] = (float)sqrt(total);
    out[k + 1] = (float)b_sum;
    out[k + 2] = (float)b_abs;
}

/* The affine normalisation's gradient checksums (NormCheck) over `rows` rows of `width`
 * channels, one pass over the output gradient d and the recomputed x̂: out = [Σ d·x̂,
 * Σ |d·x̂| + Σ |d|, Σ d, Σ |d|] per channel (4 x width floats: the weight's expectation and
 * its magnitude, then the bias's), accumulated in float64. Column blocks of 4 down every row:
 * the four accumulators stay in registers (32-byte vectors, which every x86 CPU with AVX
 * has; per channel the sums are the same whatever the block). */
void sdc_norm_grad_f32(const float *d, const float *xh, int64_t rows, int64_t width,
                       float *out) {
    const v4q abs_bits = (v4q){0} + 0x7fffffffffffffffull;
    int64_t whole = width - width % 4;
    for (int64_t l = 0; l < whole; l += 4) { /* four channels a block: 32-byte vectors */
        v4d a = {0}, b = {0}, c = {0}, e = {0};
        for (int64_t i = 0; i < rows; i++) {
            v4f fd, fx;
            memcpy(&fd, d + i * width + l, sizeof fd);
            memcpy(&fx, xh + i * width + l, sizeof fx);
            v4d vd = __builtin_convertvector(fd, v4d), vx = __builtin_convertvector(fx, v4d);
            v4d p = vd * vx, ad = (v4d)((v4q)vd & abs_bits);
            a += p;
            b += (v4d)((v4q)p & abs_bits) + ad;
            c += vd;
            e += ad;
        }
        v4f fa = __builtin_convertvector(a, v4f), fb = __builtin_convertvector(b, v4f);
        v4f fc = __builtin_convertvector(c, v4f), fe = __builtin_convertvector(e, v4f);
        memcpy(out + l, &fa, sizeof fa);
        memcpy(out + width + l, &fb, sizeof fb);
        memcpy(out + 2 * width + l, &fc, sizeof fc);
        memcpy(out + 3 * width + l, &fe, sizeof fe);
    }
    for (int64_t l = whole; l < width; l++) {
        double a = 0, b = 0, c = 0, e = 0;
        for (int64_t i = 0; i < rows; i++) {
            double vd = (double)d[i * width + l], p = vd * (double)xh[i * width + l];
            a += p;
            b += fabs(p) + fabs(vd);
            c += vd;
            e += fabs(vd);
        }
        out[l] = (float)a;
        out[width + l] = (float)b;
        out[2 * width + l] = (float)c;
        out[3 * width + l] = (float)e;
    }
}

/* A decision row carried in a float32 gradient all-reduce (detection/carry.py): joined[0:n] =
 * buf / world (true division, as torch.div and DDP's own hook round it), then a (world x words
 * x 4) slab of zeros but for this rank's slot, where chunk j of word w is bits 16j..16j+15 of
 * row[w] as a float (an integer below 2^16, exact). One pass, no temporaries. */
void sdc_carry_join_f32(const float *buf, int64_t n, int64_t world, const int64_t *row,
                        int64_t words, int64_t rank, float *joined) {
    const float divisor = (float)world;
    for (int64_t i = 0; i < n; i++) joined[i] = buf[i] / divisor;
    float *slab = joined + n;
    memset(slab, 0, (size_t)(world * words * 4) * sizeof(float));
    float *own = slab + rank * words * 4;
    for (int64_t w = 0; w < words; w++) {
        uint64_t word = (uint64_t)row[w];
        for (int j = 0; j < 4; j++) own[w * 4 + j] = (float)((word >> (16 * j)) & 0xffffu);
    }
}

/* The reduced slab back into words: table[r][w] = Σ_j chunk << 16j (the chunks' bits do not
 * overlap; the top one wraps into the sign as two's complement). Returns -1 when a chunk is
 * not an integer in [0, 2^16) (the slab did not come through the all-reduce as sent), else 0. */
int32_t sdc_carry_table_f32(const float *slab, int64_t world, int64_t words, int64_t *table) {
    for (int64_t i = 0; i < world * words; i++) {
        uint64_t word = 0;
        for (int j = 0; j < 4; j++) {
            float c = slab[i * 4 + j];
            if (!(c >= 0.0f && c < 65536.0f) || c != (float)(uint32_t)c) return -1;
            word |= (uint64_t)(uint32_t)c << (16 * j);
        }
        table[i] = (int64_t)word;
    }
    return 0;
}
