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

/* max over elements of the bits below the sign bit, for one word width: the element is NaN or
 * ±Inf exactly when that is at least the all-ones exponent pattern. */
#define MAX_ABS(NAME, T, V, MASK)                                                  \
    static T NAME(const T *w, int64_t n) {                                         \
        const int k = (int)(sizeof(V) / sizeof(T));                                \
        V acc = {0};                                                               \
        const V mask = (V){0} + (MASK);                                            \
        int64_t head = n - n % k;                                                  \
        for (int64_t i = 0; i < head; i += k) {                                    \
            V v;                                                                   \
            memcpy(&v, w + i, sizeof v);                                           \
            v &= mask;                                                             \
            V m = (V)(v > acc);                                                    \
            acc = (v & m) | (acc & ~m);                                            \
        }                                                                          \
        T t[sizeof(V) / sizeof(T)], r = 0;                                         \
        memcpy(t, &acc, sizeof t);                                                 \
        for (int j = 0; j < k; j++) r = t[j] > r ? t[j] : r;                       \
        for (int64_t i = head; i < n; i++) {                                       \
            T a = w[i] & (MASK);                                                   \
            r = a > r ? a : r;                                                     \
        }                                                                          \
        return r;                                                                  \
    }

typedef uint16_t v32h __attribute__((vector_size(64)));
MAX_ABS(max_abs16, uint16_t, v32h, (uint16_t)0x7fffu)
MAX_ABS(max_abs32, uint32_t, v16u, 0x7fffffffu)
MAX_ABS(max_abs64, uint64_t, v8q, 0x7fffffffffffffffull)

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
