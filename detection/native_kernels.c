/* sdcguard's per-step CPU kernels: one pass, one call, whatever the number of tensors.
 *
 * Loaded by detection/native.py (compiled on first use, cached per source and CPU). Every
 * result is a function of the input values alone, never of the vector width the compiler
 * picked: the float32 accumulations run in LANES independent lanes combined in a fixed order
 * (compiled with -ffp-contract=off, so no fused multiply-add changes a rounding), and the
 * integer ones are exact. Ranks on different CPUs therefore compute the same bits, which the
 * exact cross-replica comparison of reduced-bucket sums relies on.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

/* Σ x as float64 over float32 sums of consecutive chunks of `chunk` elements (a multiple of
 * LANES; 0: every element added in float64, element i in lane i % LANES): within a chunk, element i goes to lane i % LANES and the lanes are added in order;
 * the tail after the last whole chunk is one float32 sum in index order. With `what` == 3 also
 * the float32 Σ x² (element i in lane i % LANES, over the whole array, lanes then added in
 * order) as its square root, and max |x| exactly (as bit patterns: NaN if any element is NaN).
 * out[0] = Σ, out[1] = ‖x‖₂, out[2] = max |x| (out[1], out[2] untouched when what == 1). */
void sdc_stats_f32(const float *x, int64_t n, int64_t chunk, int32_t what, double *out) {
    double total = 0.0;
    float sq[LANES];
    uint32_t peak[LANES];
    memset(sq, 0, sizeof sq);
    memset(peak, 0, sizeof peak);
    if (chunk <= 0) {
        /* float64 outright: a small bucket, where the pass costs nothing next to the call */
        double wide[LANES];
        memset(wide, 0, sizeof wide);
        for (int64_t i = 0; i < n; i++) wide[i % LANES] += (double)x[i];
        for (int j = 0; j < LANES; j++) total += wide[j];
        chunk = LANES;  /* the norm and the peak below, over whole lanes and the tail */
        if (what != 3) {
            out[0] = total;
            return;
        }
        for (int64_t i = 0; i < n; i++) {
            uint32_t b;
            memcpy(&b, &x[i], sizeof b);
            int j = (int)(i % LANES);
            sq[j] += x[i] * x[i];
            b &= 0x7fffffffu;
            peak[j] = b > peak[j] ? b : peak[j];
        }
        float q = 0.0f;
        uint32_t m = 0;
        for (int j = 0; j < LANES; j++) {
            q += sq[j];
            m = peak[j] > m ? peak[j] : m;
        }
        float mf;
        memcpy(&mf, &m, sizeof mf);
        out[0] = total;
        out[1] = (double)sqrtf(q);
        out[2] = (double)mf;
        return;
    }
    int64_t head = n - n % chunk;
    for (int64_t c = 0; c < head; c += chunk) {
        float acc[LANES];
        memset(acc, 0, sizeof acc);
        for (int64_t k = 0; k < chunk; k += LANES) {
            const float *p = x + c + k;
            uint32_t bits[LANES];
            memcpy(bits, p, sizeof bits);
            if (what == 3) {
                for (int j = 0; j < LANES; j++) {
                    acc[j] += p[j];
                    sq[j] += p[j] * p[j];
                    uint32_t a = bits[j] & 0x7fffffffu;
                    peak[j] = a > peak[j] ? a : peak[j];
                }
            } else {
                for (int j = 0; j < LANES; j++) acc[j] += p[j];
            }
        }
        float s = 0.0f;
        for (int j = 0; j < LANES; j++) s += acc[j];
        total += (double)s;
    }
    float tail = 0.0f;
    for (int64_t i = head; i < n; i++) {
        float v = x[i];
        uint32_t b;
        memcpy(&b, &v, sizeof b);
        tail += v;
        if (what == 3) {
            int j = (int)(i % LANES);
            sq[j] += v * v;
            b &= 0x7fffffffu;
            peak[j] = b > peak[j] ? b : peak[j];
        }
    }
    out[0] = total + (double)tail;
    if (what == 3) {
        float q = 0.0f;
        uint32_t m = 0;
        for (int j = 0; j < LANES; j++) {
            q += sq[j];
            m = peak[j] > m ? peak[j] : m;
        }
        float mf;
        memcpy(&mf, &m, sizeof mf);
        out[1] = (double)sqrtf(q);
        out[2] = (double)mf;
    }
}

/* max over elements of the bits below the sign bit, for one word width: the element is NaN or
 * ±Inf exactly when that is at least the all-ones exponent pattern. */
#define MAX_ABS(NAME, T, MASK)                                                     \
    static T NAME(const T *w, int64_t n) {                                         \
        T acc[LANES];                                                              \
        memset(acc, 0, sizeof acc);                                                \
        int64_t head = n - n % LANES;                                              \
        for (int64_t i = 0; i < head; i += LANES)                                  \
            for (int j = 0; j < LANES; j++) {                                      \
                T a = w[i + j] & (MASK);                                           \
                acc[j] = a > acc[j] ? a : acc[j];                                  \
            }                                                                      \
        T m = 0;                                                                   \
        for (int j = 0; j < LANES; j++) m = acc[j] > m ? acc[j] : m;               \
        for (int64_t i = head; i < n; i++) {                                       \
            T a = w[i] & (MASK);                                                   \
            m = a > m ? a : m;                                                     \
        }                                                                          \
        return m;                                                                  \
    }

MAX_ABS(max_abs16, uint16_t, 0x7fffu)
MAX_ABS(max_abs32, uint32_t, 0x7fffffffu)
MAX_ABS(max_abs64, uint64_t, 0x7fffffffffffffffull)

/* Kinds of floating-point storage: their non-finite exponent patterns. */
enum { KIND_F16 = 0, KIND_BF16 = 1, KIND_F32 = 2, KIND_F64 = 3 };

/* 1 if any element of any of the `count` arrays is NaN or ±Inf, else 0. */
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
 * (detection/fingerprint.py defines both and proves what they catch). */
#define FINGERPRINT(NAME, T)                                                       \
    static void NAME(const T *w, int64_t n, uint64_t o, uint64_t *a, uint64_t *b) { \
        uint64_t sa[8], sb[8];                                                     \
        memset(sa, 0, sizeof sa);                                                  \
        memset(sb, 0, sizeof sb);                                                  \
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
