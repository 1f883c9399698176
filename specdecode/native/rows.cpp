// Batch-invariant row kernels for a bfloat16 decoder: y = x·Wᵀ (+ bias), RMSNorm, SiLU-gated
// products and attention over a KV cache, for any number of rows M.
//
// Batch invariance. Every output row is computed by the same sequence of floating-point
// operations whatever M is, whichever thread computes it and whatever other rows a call holds: a
// k-token verify rounds exactly as k one-token steps do, so greedy speculative output equals plain
// greedy output bit for bit (paper §2.3 promises the same distribution; this makes it the same
// numbers). Concretely:
//   - linear: y[m, n] is one accumulator over k in a fixed order (16 fp32 lanes, k mod 16 … per
//     lane, then a fixed horizontal sum); rows are only grouped to reuse each loaded weight vector,
//     never split or merged; threads split N, never K.
//   - attention: a query row's keys are the cache slots its mask allows, taken in slot order and
//     numbered 0, 1, … among themselves, so padding slots and other rows change nothing; the
//     softmax's sum runs in lanes by that number.
//   - elementwise work (exp) runs one vector function for every element (tails go through a
//     padded buffer), so an element's value never depends on where it sits in a call.
//
// Memory. The linear kernel streams each weight from memory once per call: four weight rows at a
// time, each 32-element slice multiplied into up to five activation rows in registers; a verify's
// further rows find those four weight rows in cache. A 9-row product then costs about one row's
// memory traffic plus its arithmetic. Weights stay in torch's [N, K] row-major bfloat16 layout: no
// repacked copy.
//
// Instruction sets, chosen when this file is compiled for the machine (specdecode/native/build.py):
// AVX-512 BF16 (vdpbf16ps), AVX2 + FMA (bfloat16 widened to fp32 exactly), and portable C++.
// Each gives its own (deterministic) rounding; invariance holds within one.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SD_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define SD_ISA 1
#else
#define SD_ISA 0
#endif

typedef uint16_t bf16;

// How far ahead (elements) the weight stream is requested, into the outer caches. Measured on an
// AVX-512 BF16 Zen 4 (2 cores; sweeps of the default target's 3.09 GB of weights): 1 KiB ahead
// into L1 left a 9-row product at 1.7 one-row products, 32 KiB ahead into L2/L3 at 1.05-1.5
// (docs/results/native_kernels_zen4.md; the machine's bandwidth varies from run to run).
#ifndef SD_PREFETCH
#define SD_PREFETCH 16384
#endif
#ifndef SD_HINT
#define SD_HINT _MM_HINT_T2
#endif

static inline float bf16_to_f32(bf16 h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

static inline bf16 f32_to_bf16(float f) {  // round to nearest even, as torch does; NaN stays NaN
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<bf16>(bits >> 16);
}

// ---------------------------------------------------------------------------------------------
// exp: one formula per instruction set, applied to whole vectors (Cody-Waite reduction, degree-6
// polynomial, ≤ 2 ulp on [-87, 88]; below -87 it is 0, as the softmax and SiLU need).
#if SD_ISA == 2
typedef __m512 vfloat;
static const int VL = 16;
static inline vfloat vexp(vfloat x) {
    const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), y);
}
static inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
static inline vfloat vset(float v) { return _mm512_set1_ps(v); }
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
#elif SD_ISA == 1
typedef __m256 vfloat;
static const int VL = 8;
static inline vfloat vexp(vfloat x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}
static inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
static inline vfloat vset(float v) { return _mm256_set1_ps(v); }
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
#else
static const int VL = 1;
#endif

static float scalar_exp(float x) {  // the portable build's exp (the vector builds never call it)
    if (x < -87.0f) return 0.0f;
    x = std::min(x, 88.0f);
    float n = std::nearbyint(x * 1.44269504088896341f);
    float r = std::fma(-n, 0.693359375f, x);
    r = std::fma(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    p = std::fma(p, r * r, r + 1.0f);
    return std::ldexp(p, static_cast<int>(n));
}

// exp of n floats in place; every element goes through the same vector code
static void exp_inplace(float* v, int64_t n) {
#if SD_ISA >= 1
    int64_t i = 0;
    for (; i + VL <= n; i += VL) vstore(v + i, vexp(vload(v + i)));
    if (i < n) {
        float buf[VL] = {0};
        std::memcpy(buf, v + i, (n - i) * sizeof(float));
        vstore(buf, vexp(vload(buf)));
        std::memcpy(v + i, buf, (n - i) * sizeof(float));
    }
#else
    for (int64_t i = 0; i < n; ++i) v[i] = scalar_exp(v[i]);
#endif
}

// ---------------------------------------------------------------------------------------------
// Dot products of bfloat16 vectors: the per-(row, output) accumulation the linear kernel and
// attention's scores share. acc lanes hold k ≡ lane (mod lane count) partial sums.
#if SD_ISA == 2
static inline float hsum(__m512 v) {  // fixed order: halves, then quarters, …
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
static inline __m512bh load_bh(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512bh load_bh_tail(const bf16* p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((n >= 32) ? ~0u : ((1u << n) - 1u)), p);
}
#elif SD_ISA == 1
static inline float hsum(__m256 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
static inline __m256 load8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 load8_tail(const bf16* p, int64_t n) {
    bf16 buf[8] = {0};
    std::memcpy(buf, p, std::min<int64_t>(n, 8) * sizeof(bf16));
    return load8(buf);
}
#endif

// y[m0 + i, n0 + j] for i < MG rows and j < NT outputs, reading each weight slice once for all rows
template <int MG, int NT>
static void tile(const bf16* x, int64_t ldx, const bf16* w, int64_t K, const float* bias, int64_t m0, int64_t n0,
                 void* y, int64_t ldy, bool out_f32) {
    float sums[MG][NT];
#if SD_ISA == 2
    __m512 acc[MG][NT];
    for (int i = 0; i < MG; ++i)
        for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[NT];
        for (int j = 0; j < NT; ++j) {
            // the weights stream from memory once: ask for them ahead of the arithmetic
            _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + j) * K + k + SD_PREFETCH), SD_HINT);
            wv[j] = load_bh(w + (n0 + j) * K + k);
        }
        for (int i = 0; i < MG; ++i) {
            __m512bh xv = load_bh(x + (m0 + i) * ldx + k);
            for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (k < K) {
        __m512bh wv[NT];
        for (int j = 0; j < NT; ++j) wv[j] = load_bh_tail(w + (n0 + j) * K + k, K - k);
        for (int i = 0; i < MG; ++i) {
            __m512bh xv = load_bh_tail(x + (m0 + i) * ldx + k, K - k);
            for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MG; ++i)
        for (int j = 0; j < NT; ++j) sums[i][j] = hsum(acc[i][j]);
#elif SD_ISA == 1
    __m256 acc[MG][NT];
    for (int i = 0; i < MG; ++i)
        for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NT];
        for (int j = 0; j < NT; ++j) {
            if ((k & 31) == 0)  // one request per 64-byte line
                _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + j) * K + k + SD_PREFETCH), SD_HINT);
            wv[j] = load8(w + (n0 + j) * K + k);
        }
        for (int i = 0; i < MG; ++i) {
            __m256 xv = load8(x + (m0 + i) * ldx + k);
            for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < K) {
        __m256 wv[NT];
        for (int j = 0; j < NT; ++j) wv[j] = load8_tail(w + (n0 + j) * K + k, K - k);
        for (int i = 0; i < MG; ++i) {
            __m256 xv = load8_tail(x + (m0 + i) * ldx + k, K - k);
            for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MG; ++i)
        for (int j = 0; j < NT; ++j) sums[i][j] = hsum(acc[i][j]);
#else
    float acc[MG][NT][8];
    std::memset(acc, 0, sizeof(acc));
    for (int64_t k = 0; k < K; ++k)
        for (int i = 0; i < MG; ++i) {
            float xv = bf16_to_f32(x[(m0 + i) * ldx + k]);
            for (int j = 0; j < NT; ++j) acc[i][j][k & 7] = std::fma(xv, bf16_to_f32(w[(n0 + j) * K + k]), acc[i][j][k & 7]);
        }
    for (int i = 0; i < MG; ++i)
        for (int j = 0; j < NT; ++j) {
            float* a = acc[i][j];
            sums[i][j] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        }
#endif
    for (int i = 0; i < MG; ++i)
        for (int j = 0; j < NT; ++j) {
            float v = sums[i][j] + (bias ? bias[n0 + j] : 0.0f);
            if (out_f32)
                static_cast<float*>(y)[(m0 + i) * ldy + n0 + j] = v;
            else
                static_cast<bf16*>(y)[(m0 + i) * ldy + n0 + j] = f32_to_bf16(v);
        }
}

// Rows per tile: the accumulators (rows × NT vectors), NT weight slices and one activation slice
// fit the register file (32 zmm; 16 ymm for AVX2). A verify's rows go through a few such tiles
// per four weight rows; the later tiles find those rows in cache.
#if SD_ISA == 1
static const int TILE_ROWS = 2;
#else
static const int TILE_ROWS = 5;
#endif

#define SD_TILE_CASE(G) case G: tile<G, NT>(x, ldx, w, K, bias, m, n0, y, ldy, out_f32); break;

// all M rows against weight rows n0 … n0 + NT − 1, TILE_ROWS rows at a time
template <int NT>
static void rows_of(const bf16* x, int64_t ldx, int64_t M, const bf16* w, int64_t K, const float* bias, int64_t n0,
                    void* y, int64_t ldy, bool out_f32) {
    for (int64_t m = 0; m < M;) {
        const int g = static_cast<int>(std::min<int64_t>(M - m, TILE_ROWS));
        switch (g) {
            SD_TILE_CASE(1) SD_TILE_CASE(2)
#if SD_ISA != 1
            SD_TILE_CASE(3) SD_TILE_CASE(4) SD_TILE_CASE(5)
#endif
            default: break;
        }
        m += g;
    }
}

static const int NT = 4;       // weight rows a tile streams together (a thread's unit of work)
// Up to this many rows, a thread streams one weight row at a time instead: on a Zen 5 (2 cores)
// the target's bfloat16 products took 63 ms for one row against 73 with NT = 4 (a single stream
// per core reads memory faster), alike at 5 rows, and 108 against 85 at 9 (each activation slice
// loaded once per weight row)
static const int64_t FEW_ROWS = 4;
static const int64_t MB = 64;  // rows per pass over the weights (a wide prompt read keeps them in cache)

// ---------------------------------------------------------------------------------------------
// 4-bit products for a draft model (its numbers are free: the verifier needs only the q it
// sampled from, paper §2.3). Weights: codes c in 0..15 in blocks of 64 inputs, 32 bytes a block,
// byte j holding input j (low nibble) and input 32 + j (high nibble); per group of 32 inputs a
// scale s and a correction t = zero − 8·s, so W = c·s + t. Activations stay bfloat16:
//   y = Σ_g (s_g · Σ_{i∈g} c_i·x_i + t_g · Σ_{i∈g} x_i),
// the codes widened to bfloat16 exactly (0..15), products accumulated in float32 in a fixed order
// per row (batch-invariant like the rest).

// per row and group of 32 inputs, Σ x (float32, in input order)
static std::vector<float> group_sums(const bf16* x, int64_t M, int64_t K, int64_t ldx) {
    std::vector<float> sums(M * (K / 32));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < K / 32; ++g) {
            float total = 0.0f;
            for (int64_t k = g * 32; k < g * 32 + 32; ++k) total += bf16_to_f32(x[m * ldx + k]);
            sums[m * (K / 32) + g] = total;
        }
    return sums;
}

// Σ a·b over n floats in a fixed order (vector lanes by index, then their fixed sum)
static float dot_f32(const float* a, const float* b, int64_t n) {
#if SD_ISA == 2
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    const __mmask16 rest = static_cast<__mmask16>((1u << (n - i)) - 1u);
    return hsum(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(rest, a + i), _mm512_maskz_loadu_ps(rest, b + i), acc));
#elif SD_ISA >= 1
    vfloat acc = vset(0.0f);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) acc = vfma(vload(a + i), vload(b + i), acc);
    float tail[VL] = {0}, other[VL] = {0};
    std::memcpy(tail, a + i, (n - i) * sizeof(float));
    std::memcpy(other, b + i, (n - i) * sizeof(float));
    return hsum(vfma(vload(tail), vload(other), acc));
#else
    float total = 0.0f;
    for (int64_t i = 0; i < n; ++i) total = std::fma(a[i], b[i], total);
    return total;
#endif
}

#if SD_ISA == 2
// AVX-512: MG activation rows × NT weight rows at once (NT rows share each activation load; a
// step of one or two rows runs NT = 1: see Q4_FEW_ROWS).
// y[i, n] accumulates, per block of 64 inputs, dpbf16(x, codes)·s for each half in one chain: the
// same sequence whatever MG and NT.
template <int MG, int NT>
static void q4_tile_nt(const bf16* x, int64_t ldx, const float* xsums, int64_t m0, const uint8_t* codes,
                       const float* s, const float* t, int64_t K, const float* bias, int64_t n0, void* y,
                       int64_t ldy, bool out_f32) {
    const int64_t groups = K / 32;
    static const __m512i table = _mm512_set_epi16(  // bfloat16 of 0..15, twice
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040,
        0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0,
        0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
    __m512 acc[MG][NT];
    for (int i = 0; i < MG; ++i)
        for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < K / 64; ++b) {
        __m512bh w0[NT], w1[NT];
        for (int j = 0; j < NT; ++j) {
            const uint8_t* row = codes + (n0 + j) * (K / 2) + 32 * b;
            _mm_prefetch(reinterpret_cast<const char*>(row + 1024), _MM_HINT_T0);
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
            w0[j] = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(packed, low)), table);
            w1[j] = (__m512bh)_mm512_permutexvar_epi16(
                _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low)), table);
        }
#pragma GCC unroll 4
        for (int i = 0; i < MG; ++i) {
            const bf16* row = x + (m0 + i) * ldx + 64 * b;
            const __m512bh x0 = load_bh(row), x1 = load_bh(row + 32);
#pragma GCC unroll 4
            for (int j = 0; j < NT; ++j) {
                const float* scale = s + (n0 + j) * groups + 2 * b;
                acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x0, w0[j]), _mm512_set1_ps(scale[0]),
                                            acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x1, w1[j]), _mm512_set1_ps(scale[1]),
                                            acc[i][j]);
            }
        }
    }
    for (int i = 0; i < MG; ++i)
        for (int j = 0; j < NT; ++j) {
            const int64_t n = n0 + j;
            const float v = hsum(acc[i][j]) + dot_f32(t + n * groups, xsums + (m0 + i) * groups, groups) +
                            (bias ? bias[n] : 0.0f);
            if (out_f32)
                static_cast<float*>(y)[(m0 + i) * ldy + n] = v;
            else
                static_cast<bf16*>(y)[(m0 + i) * ldy + n] = f32_to_bf16(v);
        }
}

static const int Q4_NT = 4;    // weight rows per tile
static const int Q4_MG = 4;    // activation rows per tile
// Up to this many rows, one weight row at a time (as FEW_ROWS for bfloat16): on a Zen 5 (2 cores)
// the 0.5B draft's products took 10.0 ms for one row against 12.3 with Q4_NT rows, 11.4 against
// 13.7 for two, alike at three and 24 against 20 at five
static const int64_t Q4_FEW_ROWS = 2;

#define SD_Q4NT_CASE(G) case G: q4_tile_nt<G, NT>(x, ldx, xsums, m, codes, s, t, K, bias, n0, y, ldy, out_f32); break;

// all M rows against weight rows n0 … n0 + NT − 1
template <int NT>
static void q4_rows_nt(const bf16* x, int64_t ldx, const float* xsums, int64_t M, const uint8_t* codes,
                       const float* s, const float* t, int64_t K, const float* bias, int64_t n0, void* y,
                       int64_t ldy, bool out_f32) {
    for (int64_t m = 0; m < M;) {
        const int g = static_cast<int>(std::min<int64_t>(M - m, Q4_MG));
        switch (g) {
            SD_Q4NT_CASE(1) SD_Q4NT_CASE(2) SD_Q4NT_CASE(3) SD_Q4NT_CASE(4)
            default: break;
        }
        m += g;
    }
}
#endif

#if SD_ISA != 2
// AVX2 and portable: one weight row at a time
template <int MG>
static void q4_tile(const bf16* x, int64_t ldx, const float* xsums, int64_t m0, const uint8_t* codes, const float* s,
                    const float* t, int64_t K, float bias, int64_t n, void* y, int64_t ldy, bool out_f32) {
    const int64_t groups = K / 32;
    float sums[MG];
#if SD_ISA == 1
    __m256 acc[MG];
    for (int i = 0; i < MG; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 64; ++b)
        for (int h = 0; h < 2; ++h) {
            const __m256 scale = _mm256_set1_ps(s[2 * b + h]);
            for (int part = 0; part < 4; ++part) {  // 8 codes at a time
                const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 32 * b + 8 * part));
                const __m128i nib = h ? _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0f))
                                      : _mm_and_si128(bytes, _mm_set1_epi8(0x0f));
                const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib)), scale);
                for (int i = 0; i < MG; ++i)
                    acc[i] = _mm256_fmadd_ps(load8(x + (m0 + i) * ldx + 64 * b + 32 * h + 8 * part), w, acc[i]);
            }
        }
    for (int i = 0; i < MG; ++i) sums[i] = hsum(acc[i]);
#else
    for (int i = 0; i < MG; ++i) {
        float total = 0.0f;
        for (int64_t b = 0; b < K / 64; ++b)
            for (int h = 0; h < 2; ++h) {
                float dot = 0.0f;
                for (int j = 0; j < 32; ++j) {
                    const int c = h ? codes[32 * b + j] >> 4 : codes[32 * b + j] & 15;
                    dot = std::fma(static_cast<float>(c), bf16_to_f32(x[(m0 + i) * ldx + 64 * b + 32 * h + j]), dot);
                }
                total = std::fma(dot, s[2 * b + h], total);
            }
        sums[i] = total;
    }
#endif
    for (int i = 0; i < MG; ++i) {
        const float v = sums[i] + dot_f32(t, xsums + (m0 + i) * groups, groups) + bias;
        if (out_f32)
            static_cast<float*>(y)[(m0 + i) * ldy + n] = v;
        else
            static_cast<bf16*>(y)[(m0 + i) * ldy + n] = f32_to_bf16(v);
    }
}

static const int Q4_ROWS = 8;  // activation rows per pass over a weight row

#define SD_Q4_CASE(G) case G: q4_tile<G>(x, ldx, xsums, m, codes, s, t, K, bias, n, y, ldy, out_f32); break;

static void q4_row(const bf16* x, int64_t ldx, const float* xsums, int64_t M, const uint8_t* codes, const float* s,
                   const float* t, int64_t K, float bias, int64_t n, void* y, int64_t ldy, bool out_f32) {
    for (int64_t m = 0; m < M;) {
        const int g = static_cast<int>(std::min<int64_t>(M - m, Q4_ROWS));
        switch (g) {
            SD_Q4_CASE(1) SD_Q4_CASE(2) SD_Q4_CASE(3) SD_Q4_CASE(4)
            SD_Q4_CASE(5) SD_Q4_CASE(6) SD_Q4_CASE(7) SD_Q4_CASE(8)
            default: break;
        }
        m += g;
    }
}
#endif

extern "C" {

int sd_isa() { return SD_ISA; }

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]); x rows ldx apart, y rows ldy apart; y bfloat16, or
// float32 where out_f32 (an LM head's logits).
void sd_linear(const bf16* x, int64_t M, int64_t K, int64_t ldx, const bf16* w, int64_t N, const float* bias,
               void* y, int64_t ldy, int out_f32, int threads) {
    for (int64_t mb = 0; mb < M; mb += MB) {
        const int64_t rows = std::min(MB, M - mb);
        const bf16* xb = x + mb * ldx;
        void* yb = out_f32 ? static_cast<void*>(static_cast<float*>(y) + mb * ldy)
                           : static_cast<void*>(static_cast<bf16*>(y) + mb * ldy);
        // a few rows: one weight row at a time, a single stream per thread (the same bits: each
        // output's sum does not depend on its neighbours)
        const int64_t nt = rows <= FEW_ROWS ? 1 : NT, units = (N + nt - 1) / nt;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t n0 = u * nt;
            if (nt == NT && n0 + NT <= N)
                rows_of<NT>(xb, ldx, rows, w, K, bias, n0, yb, ldy, out_f32);
            else
                for (int64_t n = n0; n < std::min(N, n0 + nt); ++n) rows_of<1>(xb, ldx, rows, w, K, bias, n, yb, ldy, out_f32);
        }
    }
}

// y[m] = bf16(w · bf16(x[m] / sqrt(mean(x[m]²) + eps))), as transformers' RMSNorm rounds
void sd_rms_norm(const bf16* x, int64_t M, int64_t H, const bf16* w, float eps, bf16* y, int threads) {
    // one row (a step) in the calling thread: waking the team costs more than the row
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 1)
    for (int64_t m = 0; m < M; ++m) {
        const bf16* row = x + m * H;
        float lanes[16] = {0};
        for (int64_t i = 0; i < H; ++i) {
            float v = bf16_to_f32(row[i]);
            lanes[i & 15] = std::fma(v, v, lanes[i & 15]);
        }
        float total = 0.0f;
        for (int step = 8; step >= 1; step /= 2)
            for (int l = 0; l < step; ++l) lanes[l] += lanes[l + step];
        total = lanes[0];
        const float inv = 1.0f / std::sqrt(total / static_cast<float>(H) + eps);
        for (int64_t i = 0; i < H; ++i) {
            float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(row[i]) * inv));
            y[m * H + i] = f32_to_bf16(bf16_to_f32(w[i]) * normed);
        }
    }
}

// y[m, i] = bf16(bf16(silu(gate[m, i])) · up[m, i]); gate and up rows ld apart, y [M, I] dense
void sd_silu_mul(const bf16* gate, const bf16* up, int64_t ld, int64_t M, int64_t I, bf16* y, int threads) {
#pragma omp parallel num_threads(threads) if (M > 1)
    {
        std::vector<float> buf(I);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            const bf16* g = gate + m * ld;
            for (int64_t i = 0; i < I; ++i) buf[i] = -bf16_to_f32(g[i]);
            exp_inplace(buf.data(), I);
            for (int64_t i = 0; i < I; ++i) {
                float gi = bf16_to_f32(g[i]);
                float act = bf16_to_f32(f32_to_bf16(gi / (1.0f + buf[i])));
                y[m * I + i] = f32_to_bf16(act * bf16_to_f32(up[m * ld + i]));
            }
        }
    }
}

// q, k, v of a fused q|k|v product, the rotary embedding applied to q and k as transformers' bfloat16
// arithmetic rounds it (x·cos + rotate_half(x)·sin, each product and the sum rounded to bfloat16):
//   qkv [B·T rows, ld] bfloat16 (q: Hq·D, then k: Hkv·D, then v: Hkv·D); cos, sin [B·T, D];
//   q_out [B, T, Hq, D]; k_out, v_out [B, Hkv, T, D] (the cache's layout).
void sd_rope_split(const bf16* qkv, int64_t ld, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                   const bf16* cos, const bf16* sin, bf16* q_out, bf16* k_out, bf16* v_out, int threads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (B * T > 8)
    for (int64_t r = 0; r < B * T; ++r) {
        const int64_t b = r / T, t = r % T;
        const bf16* row = qkv + r * ld;
        const bf16* c = cos + r * D;
        const bf16* sn = sin + r * D;
        for (int64_t h = 0; h < Hq + Hkv; ++h) {
            const bf16* x = row + h * D;
            bf16* out = h < Hq ? q_out + (r * Hq + h) * D : k_out + ((b * Hkv + h - Hq) * T + t) * D;
            for (int64_t d = 0; d < D; ++d) {
                const float rot = d < half ? -bf16_to_f32(x[d + half]) : bf16_to_f32(x[d - half]);
                const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[d]) * bf16_to_f32(c[d])));
                const float e = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(sn[d])));
                out[d] = f32_to_bf16(a + e);
            }
        }
        for (int64_t h = 0; h < Hkv; ++h)
            std::memcpy(v_out + ((b * Hkv + h) * T + t) * D, row + (Hq + Hkv + h) * D, D * sizeof(bf16));
    }
}

// Attention of B·T query rows over a KV cache.
//   q [B, T, Hq, D] bfloat16 (dense); k, v: element (b, h, s, d) at b·kv_b + h·kv_h + s·D + d;
//   allowed [B, T, S] bytes (1: the query sees that slot), or null: query t sees slots
//   0 … S − T + t (dense causal rows); out [B, T, Hq, D] bfloat16.
// A query's visible slots are taken in slot order and numbered among themselves (see the top).
#if SD_ISA >= 1
// One query row's attention with AVX-512 (D a multiple of 32) or AVX2 (D a multiple of 8), D at
// most MAX_FAST_D: the same operations per score, softmax and output element as the general loop
// in sd_attention, in the same order (so the same bits), scheduled for throughput: 4 keys' score
// chains at a time, and (AVX-512) the output's accumulators in registers across the keys.
static const int64_t MAX_FAST_D = 256;
#if SD_ISA == 2
static const int64_t SCORE_STEP = 32;  // bfloat16 pairs per vdpbf16ps
typedef __m512bh QVec;
static inline QVec load_q(const bf16* p) { return load_bh(p); }
static inline __m512 score_step(__m512 a, QVec q, const bf16* key) { return _mm512_dpbf16_ps(a, q, load_bh(key)); }
static inline __m512 zero_acc() { return _mm512_setzero_ps(); }
#else
static const int64_t SCORE_STEP = 8;
typedef __m256 QVec;
static inline QVec load_q(const bf16* p) { return load8(p); }
static inline __m256 score_step(__m256 a, QVec q, const bf16* key) { return _mm256_fmadd_ps(q, load8(key), a); }
static inline __m256 zero_acc() { return _mm256_setzero_ps(); }
#endif

static void attend_fast(const bf16* qrow, const bf16* kbase, const bf16* vbase, const int64_t* slots, int64_t n,
                        int64_t D, float scale, float* p, bf16* o) {
    const int64_t steps = D / SCORE_STEP;
    QVec qv[MAX_FAST_D / SCORE_STEP];
    for (int64_t j = 0; j < steps; ++j) qv[j] = load_q(qrow + SCORE_STEP * j);
    float best = -INFINITY;
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) {
        const bf16* key[4] = {kbase + slots[c] * D, kbase + slots[c + 1] * D, kbase + slots[c + 2] * D,
                              kbase + slots[c + 3] * D};
        decltype(zero_acc()) a[4] = {zero_acc(), zero_acc(), zero_acc(), zero_acc()};
        for (int64_t j = 0; j < steps; ++j)
            for (int u = 0; u < 4; ++u) a[u] = score_step(a[u], qv[j], key[u] + SCORE_STEP * j);
        for (int u = 0; u < 4; ++u) {
            p[c + u] = hsum(a[u]) * scale;
            best = std::max(best, p[c + u]);
        }
    }
    for (; c < n; ++c) {
        const bf16* key = kbase + slots[c] * D;
        auto a = zero_acc();
        for (int64_t j = 0; j < steps; ++j) a = score_step(a, qv[j], key + SCORE_STEP * j);
        p[c] = hsum(a) * scale;
        best = std::max(best, p[c]);
    }
    for (int64_t i = 0; i < n; ++i) p[i] -= best;
    exp_inplace(p, n);
    float lanes[16] = {0};
    for (int64_t i = 0; i < n; ++i) lanes[i & 15] += p[i];
    for (int step = 8; step >= 1; step /= 2)
        for (int l = 0; l < step; ++l) lanes[l] += lanes[l + step];
    const float total = lanes[0];
    alignas(64) float result[MAX_FAST_D];
#if SD_ISA == 2
    __m512 acc[MAX_FAST_D / 16];
    const int64_t vectors = D / 16;
    for (int64_t j = 0; j < vectors; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
        const bf16* value = vbase + slots[i] * D;
        const __m512 weight = _mm512_set1_ps(p[i]);
        for (int64_t j = 0; j < vectors; ++j) {
            const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value + 16 * j))), 16));
            acc[j] = _mm512_fmadd_ps(weight, x, acc[j]);
        }
    }
    for (int64_t j = 0; j < vectors; ++j) _mm512_store_ps(result + 16 * j, acc[j]);
#else
    std::fill(result, result + D, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
        const bf16* value = vbase + slots[i] * D;
        const __m256 weight = _mm256_set1_ps(p[i]);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_store_ps(result + d, _mm256_fmadd_ps(weight, load8(value + d), _mm256_load_ps(result + d)));
    }
#endif
    for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(result[d] / total);
}
#endif

void sd_attention(const bf16* q, int64_t B, int64_t T, int64_t Hq, int64_t D, const bf16* k, const bf16* v,
                  int64_t Hkv, int64_t S, int64_t kv_b, int64_t kv_h, const uint8_t* allowed, float scale, bf16* out,
                  int threads) {
    const int64_t group = Hq / Hkv;
#pragma omp parallel num_threads(threads)
    {
        std::vector<int64_t> slots(S);
        std::vector<float> p(S + 16), acc(D), qf(D);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * T * Hq; ++item) {
            const int64_t b = item / (T * Hq), t = (item / Hq) % T, h = item % Hq, kvh = h / group;
            int64_t n = 0;
            if (allowed) {
                const uint8_t* row = allowed + (b * T + t) * S;
                for (int64_t s = 0; s < S; ++s)
                    if (row[s]) slots[n++] = s;
            } else {
                for (int64_t s = 0; s <= S - T + t; ++s) slots[n++] = s;
            }
            const bf16* qrow = q + ((b * T + t) * Hq + h) * D;
            const bf16* kbase = k + b * kv_b + kvh * kv_h;
            const bf16* vbase = v + b * kv_b + kvh * kv_h;
            float best = -INFINITY;
#if SD_ISA >= 1
            if (D % SCORE_STEP == 0 && D <= MAX_FAST_D) {
                attend_fast(qrow, kbase, vbase, slots.data(), n, D, scale, p.data(), out + ((b * T + t) * Hq + h) * D);
                continue;
            }
#endif
            for (int64_t c = 0; c < n; ++c) {
                const bf16* key = kbase + slots[c] * D;
#if SD_ISA == 2
                __m512 a = _mm512_setzero_ps();
                int64_t d = 0;
                for (; d + 32 <= D; d += 32) a = _mm512_dpbf16_ps(a, load_bh(qrow + d), load_bh(key + d));
                if (d < D) a = _mm512_dpbf16_ps(a, load_bh_tail(qrow + d, D - d), load_bh_tail(key + d, D - d));
                float s = hsum(a);
#elif SD_ISA == 1
                __m256 a = _mm256_setzero_ps();
                int64_t d = 0;
                for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(load8(qrow + d), load8(key + d), a);
                if (d < D) a = _mm256_fmadd_ps(load8_tail(qrow + d, D - d), load8_tail(key + d, D - d), a);
                float s = hsum(a);
#else
                float lanes[8] = {0};
                for (int64_t d = 0; d < D; ++d)
                    lanes[d & 7] = std::fma(bf16_to_f32(qrow[d]), bf16_to_f32(key[d]), lanes[d & 7]);
                float s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
#endif
                p[c] = s * scale;
                best = std::max(best, p[c]);
            }
            for (int64_t c = 0; c < n; ++c) p[c] -= best;
            exp_inplace(p.data(), n);
            float lanes[16] = {0};
            for (int64_t c = 0; c < n; ++c) lanes[c & 15] += p[c];
            for (int step = 8; step >= 1; step /= 2)
                for (int l = 0; l < step; ++l) lanes[l] += lanes[l + step];
            const float total = lanes[0];
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t c = 0; c < n; ++c) {
                const bf16* value = vbase + slots[c] * D;
                const float weight = p[c];
                for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(weight, bf16_to_f32(value[d]), acc[d]);
            }
            bf16* o = out + ((b * T + t) * Hq + h) * D;
            for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(acc[d] / total);
        }
    }
}

// y[M, N] = x[M, K] · Wᵀ (+ bias) with W in the 4-bit layout above: codes [N, K/2] bytes, s and t
// [N, K/32] floats; K a multiple of 64. y bfloat16, or float32 where out_f32.
void sd_linear_q4(const bf16* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* codes, const float* s,
                  const float* t, int64_t N, const float* bias, void* y, int64_t ldy, int out_f32, int threads) {
    const std::vector<float> xsums = group_sums(x, M, K, ldx);
#if SD_ISA == 2
    const int64_t nt = M <= Q4_FEW_ROWS ? 1 : Q4_NT, units = (N + nt - 1) / nt;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t n0 = u * nt;
        if (nt == Q4_NT && n0 + Q4_NT <= N)
            q4_rows_nt<Q4_NT>(x, ldx, xsums.data(), M, codes, s, t, K, bias, n0, y, ldy, out_f32);
        else
            for (int64_t n = n0; n < std::min(N, n0 + nt); ++n)
                q4_rows_nt<1>(x, ldx, xsums.data(), M, codes, s, t, K, bias, n, y, ldy, out_f32);
    }
#else
    const int64_t groups = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        __builtin_prefetch(codes + (n + 8) * (K / 2), 0, 1);  // a later row, ahead of its turn
        q4_row(x, ldx, xsums.data(), M, codes + n * (K / 2), s + n * groups, t + n * groups, K,
               bias ? bias[n] : 0.0f, n, y, ldy, out_f32);
    }
#endif
}

}  // extern "C"
