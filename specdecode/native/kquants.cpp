// Batch-invariant products on a GGUF file's own K-quant blocks (Q4_K, Q6_K), read as stored.
//
// y[m, n] = Σ_k x[m, k]·W[n, k] with W in llama.cpp's block formats, the weights never dequantized
// to a copy. Like llama.cpp's CPU path, activations are quantized to int8 per block of 256 inputs
// (a float scale dx = max|x|/127, values rounded to nearest), so the inner sums are exact integers:
//   Q4_K  W = d·sc_j·q − dmin·m_j   (q 4-bit, sc_j and m_j 6-bit per sub-block j of 32 inputs)
//         Σ_k x·W = dx·d·Σ_j sc_j·Σ_{k∈j} q·x̂  −  dx·dmin·Σ_j m_j·Σ_{k∈j} x̂
//   Q6_K  W = d·sc_j·(q − 32)       (q 6-bit, sc_j signed 8-bit per sub-block j of 16 inputs)
//         Σ_k x·W = dx·d·(Σ_j sc_j·Σ_{k∈j} q·x̂  −  32·Σ_j sc_j·Σ_{k∈j} x̂)
// where x̂ are the int8 activations. Per super-block of 256 inputs the integer sums are exact
// (bounded well inside int32; the pairs of u8·s8 products inside int16); the super-blocks' float
// terms are accumulated in a fixed order of vector lanes per output row. With AVX-512 each lane
// holds one sub-block's integers (transpose_lanes), scaled by d·sc_j in float32.
//
// Batch invariance: a row's activation scale and integers depend on that row alone, and its
// accumulation order on K alone (never on M, the other rows or the thread count: threads split
// the output columns), so a k-token verify gives each row the bits a one-token step gives it.
//
// Memory: each weight row's blocks are decoded once per call and multiplied into up to 12 rows
// (AVX-512; 8 with AVX2) while in registers (a 9-token verify in one pass); further rows re-read
// the weight row from cache.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>
#include <algorithm>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KQ_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define KQ_ISA 1
#else
#define KQ_ISA 0
#endif

typedef uint16_t bf16;

namespace {

const int QK = 256;               // inputs per super-block
const int Q4K_BYTES = 144;        // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
const int Q6K_BYTES = 210;        // 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d
const int TYPE_Q4_K = 12, TYPE_Q6_K = 14;  // GGML type ids
// activation rows per pass over a weight row: AVX-512 keeps 12 rows' accumulators and integer sums in its 32
// registers (a 9-token verify in one pass); AVX2's 16 would spill them
#if KQ_ISA == 2
const int ROWS = 12;
#else
const int ROWS = 8;
#endif
// How far ahead the weight stream is requested into the outer caches, as rows.cpp does (32 KiB):
// on an AMX Xeon (2 cores, oneDNN capped) a one-row pass over the Q4_K_M file took 52-54 ms with
// it against 57-61 ms with 2 KiB ahead into L1.
const int PREFETCH_BYTES = 32 << 10;

float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);  // exact, as the branches below
#endif
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalize
            int e = -1;
            uint32_t m = mant;
            do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
            bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

float bf16_to_float(bf16 h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

bf16 float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<bf16>(bits >> 16);
}

// 64-byte aligned storage for the activations: a vector load that straddles two cache lines costs
// about twice one that does not (a 9-row block pass ran 1.7x slower from malloc's 16-byte alignment)
template <class T>
struct Aligned {
    using value_type = T;
    Aligned() = default;
    template <class U> Aligned(const Aligned<U>&) {}
    T* allocate(size_t n) {
        void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
        if (!p) throw std::bad_alloc();
        return static_cast<T*>(p);
    }
    void deallocate(T* p, size_t) { std::free(p); }
    template <class U> bool operator==(const Aligned<U>&) const { return true; }
    template <class U> bool operator!=(const Aligned<U>&) const { return false; }
};
template <class T> using AlignedVector = std::vector<T, Aligned<T>>;

#if KQ_ISA == 2
// The AVX-512 kernels sum a super-block's 256 products into one vector of 16 int32 lanes, each lane
// within one sub-block, so that a row's scales are applied once per lane (a conversion, a product
// and an FMA per row and block, instead of packing and scaling each 64 inputs' sums).
// vpdpbusd sums 4 products per int32 lane; the blocks' codes, decoded 64 inputs at a time as stored
// (codes[c] for c = 0..3), hold 4 lanes per sub-block in each 128-bit group j. A 4×4 transpose of
// the int32 lanes within each group (V_i lane 4j + c = codes[c] lane 4j + i) gives 4 vectors whose
// lane 4j + c is always in the sub-block of codes[c]'s group j: the activations are stored in that
// order (prepare_block), and 4 vpdpbusd accumulate into one vector.
//   Q4_K: codes[c] group j is in sub-block 4·(c/2) + c%2 + 2·(j/2) (two lanes per sub-block of 32);
//   Q6_K: codes[c] group j is in sub-block 4c + j (one lane per sub-block of 16).
alignas(64) const int32_t kQ4Lane[16] = {0, 1, 4, 5, 0, 1, 4, 5, 2, 3, 6, 7, 2, 3, 6, 7};
alignas(64) const int32_t kQ6Lane[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

inline void transpose_lanes(const __m512i* codes, __m512i* v) {
    const __m512i t0 = _mm512_unpacklo_epi32(codes[0], codes[1]), t1 = _mm512_unpackhi_epi32(codes[0], codes[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(codes[2], codes[3]), t3 = _mm512_unpackhi_epi32(codes[2], codes[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2);
    v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3);
    v[3] = _mm512_unpackhi_epi64(t1, t3);
}
#endif

// A call's activations as int8 per row and super-block: values x̂ (rounded to nearest even),
// scale dx = max|x|/127, and what the kernels need of them. Without AVX-512: x̂ as given, dx, and
// the sums of x̂ per 16 and per 32 inputs (the Q6_K offset, the Q4_K minimums). With AVX-512,
// block-major (a group's rows of one block a fixed stride apart) and in the kernels' lane order.
struct Activations {
    int64_t M = 0, K = 0;
    AlignedVector<float> low;      // [M, K/32] dx·(Σ x̂ per 32 inputs): Q4_K's minimums
#if KQ_ISA == 2
    AlignedVector<int8_t> t4, t6;  // [K/256, M, 256] x̂ in the lane order of Q4_K's and Q6_K's codes
    AlignedVector<int32_t> off6;   // [K/256, M, 16] −32·Σ x̂ per Q6_K sub-block, in its lane order
    AlignedVector<float> d;        // [K/256, M]
    float dx(int64_t row, int64_t b) const { return d[b * M + row]; }
#else
    AlignedVector<int8_t> q;       // [M, K]
    AlignedVector<float> d;        // [M, K/256]
    AlignedVector<int16_t> sum16;  // [M, K/16]
    AlignedVector<int16_t> sum32;  // [M, K/32]
    float dx(int64_t row, int64_t b) const { return d[row * (K / QK) + b]; }
#endif

    bool q4 = true, q6 = true;     // whether the call has Q4_K, Q6_K weights (AVX-512: only their layouts are made)

    Activations(int64_t rows, int64_t inputs, bool has_q4, bool has_q6)
        : M(rows), K(inputs), low(rows * (inputs / 32)), q4(has_q4), q6(has_q6) {
#if KQ_ISA == 2
        if (q4) t4.resize(M * K);
        if (q6) t6.resize(M * K);
        if (q6) off6.resize(M * (K / QK) * 16);
#else
        q.resize(M * K);
        sum16.resize(M * (K / 16));
        sum32.resize(M * (K / 32));
#endif
        d.resize(M * (K / QK));
    }
};

// The scale of 256 inputs: max|x|/127 and its inverse; a NaN or infinite input gives a NaN scale (and
// x̂ = 0), so that the row's outputs become NaN, as a float product's would.
inline void block_scale(float amax, bool finite, float& d, float& inverse) {
    if (!finite) amax = NAN;
    inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    d = amax / 127.0f;
}

#if KQ_ISA == 2
// Row m's block b of x (its 256 inputs at x): x̂, written in the lane order of the kernels' codes
// (transpose_lanes): position 64i + 16j + 4c + e of a block holds the input that codes[c] byte
// 16j + 4i + e multiplies (Q4_K's codes[c] are its nibbles as stored: inputs per 128 0-31, 64-95,
// 32-63, 96-127; Q6_K's the inputs 64c.. in order); the sums of x̂ per sub-block come from the same
// transpose (lane 4j + c: sub-block 4c + j of 16).
void prepare_block(Activations& a, const bf16* x, int64_t m, int64_t b) {
    __m512 v[16];
    __m512 amax = _mm512_setzero_ps();
    __mmask16 special = 0;
    for (int j = 0; j < 16; ++j) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * j));
        v[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // exact
        special |= _mm512_fpclass_ps_mask(v[j], 0x99);  // NaN or ±infinity
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[j]));
    }
    float d, inverse;
    block_scale(_mm512_reduce_max_ps(amax), special == 0, d, inverse);
    const __m512 scale = _mm512_set1_ps(inverse), top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
    __m512i q[4];  // inputs 64c.. in order
    for (int c = 0; c < 4; ++c) {
        __m128i part[4];
        for (int j = 0; j < 4; ++j) {
            const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[4 * c + j], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            part[j] = special ? _mm_setzero_si128()
                              : _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(top, _mm512_max_ps(bottom, r))));
        }
        q[c] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(part[0]), part[1], 1),
                                                     part[2], 2), part[3], 3);
    }
    __m512i t[4], sums[4];
    if (a.q6) {
        transpose_lanes(q, t);
        int8_t* t6 = a.t6.data() + (b * a.M + m) * QK;
        for (int i = 0; i < 4; ++i) _mm512_store_si512(t6 + 64 * i, t[i]);
    }
    if (a.q4) {
        // Q4_K's nibble order: 128 inputs as 0-31, 64-95 (codes[0]) and 32-63, 96-127 (codes[1])
        const __m512i nibbles[4] = {_mm512_shuffle_i64x2(q[0], q[1], 0x44), _mm512_shuffle_i64x2(q[0], q[1], 0xee),
                                    _mm512_shuffle_i64x2(q[2], q[3], 0x44), _mm512_shuffle_i64x2(q[2], q[3], 0xee)};
        transpose_lanes(nibbles, t);
        int8_t* t4 = a.t4.data() + (b * a.M + m) * QK;
        for (int i = 0; i < 4; ++i) _mm512_store_si512(t4 + 64 * i, t[i]);
    }
    // Σ x̂ per 4 inputs, then per sub-block of 16 in the lane order
    const __m512i ones = _mm512_set1_epi8(1);
    for (int c = 0; c < 4; ++c) sums[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, q[c]);
    transpose_lanes(sums, t);
    const __m512i sum16 = _mm512_add_epi32(_mm512_add_epi32(t[0], t[1]), _mm512_add_epi32(t[2], t[3]));
    if (a.q6) _mm512_store_si512(a.off6.data() + (b * a.M + m) * 16, _mm512_mullo_epi32(sum16, _mm512_set1_epi32(-32)));
    alignas(64) int32_t natural[16];  // sub-block j's sum (the transpose is its own inverse)
    _mm512_store_si512(natural, _mm512_permutexvar_epi32(_mm512_load_si512(kQ6Lane), sum16));
    for (int j = 0; j < 8; ++j) a.low[m * (a.K / 32) + 8 * b + j] = d * static_cast<float>(natural[2 * j] + natural[2 * j + 1]);
    a.d[b * a.M + m] = d;
}
#else
// Row m's block b of x (its 256 inputs at x): x̂, dx and the sums
void prepare_block(Activations& a, const bf16* x, int64_t m, int64_t b) {
    float values[QK];
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < QK; ++i) {
        values[i] = bf16_to_float(x[i]);
        finite = finite && std::isfinite(values[i]);
        amax = std::max(amax, std::fabs(values[i]));
    }
    float d, inverse;
    block_scale(amax, finite, d, inverse);
    int8_t* q = a.q.data() + m * a.K + b * QK;
    for (int i = 0; i < QK; ++i) {
        const float r = std::nearbyint(values[i] * inverse);  // the default rounding: to nearest even
        q[i] = static_cast<int8_t>(r == r ? std::max(-127.0f, std::min(127.0f, r)) : 0.0f);
    }
    int16_t* sum16 = a.sum16.data() + m * (a.K / 16) + b * (QK / 16);
    int16_t* sum32 = a.sum32.data() + m * (a.K / 32) + b * (QK / 32);
    for (int j = 0; j < QK / 16; ++j) {
        int total = 0;
        for (int i = 0; i < 16; ++i) total += q[16 * j + i];
        sum16[j] = static_cast<int16_t>(total);
    }
    for (int j = 0; j < QK / 32; ++j) {
        sum32[j] = static_cast<int16_t>(sum16[2 * j] + sum16[2 * j + 1]);
        a.low[m * (a.K / 32) + 8 * b + j] = d * static_cast<float>(sum32[j]);
    }
    a.d[m * (a.K / QK) + b] = d;
}
#endif

// Q4_K's 12 bytes of scales: sub-block j's 6-bit scale sc[j] and minimum mn[j]. The format packs
// j < 4 in the low 6 bits of bytes j (scale) and 4 + j (minimum); j ≥ 4 in the nibbles of byte
// 4 + j (scale low, minimum high) with their top 2 bits in the top bits of bytes j − 4 (scale)
// and j (minimum). Four bytes at a time in 32-bit words.
inline void q4k_scales(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
    uint32_t w0, w1, w2;
    std::memcpy(&w0, s, 4);
    std::memcpy(&w1, s + 4, 4);
    std::memcpy(&w2, s + 8, 4);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    const uint32_t sc_lo = w0 & low6, mn_lo = w1 & low6;
    const uint32_t sc_hi = (w2 & low4) | (((w0 >> 6) & low2) << 4);
    const uint32_t mn_hi = ((w2 >> 4) & low4) | (((w1 >> 6) & low2) << 4);
    // byte j of sc is sub-block j's scale, of mn its minimum (kept in registers: bytes stored four
    // at a time and read back eight at a time would stall the load)
    sc = sc_lo | (static_cast<uint64_t>(sc_hi) << 32);
    mn = mn_lo | (static_cast<uint64_t>(mn_hi) << 32);
}

#if KQ_ISA == 2
// MG rows' 256 products with a block's transposed codes v, added to dot[i] (int32 lanes in the
// kernels' order): xt is the first row's activations in lane order, the rows' 256 bytes one after
// another. Each of the 4 steps runs over all rows before the next, so that the rows' chains of
// vpdpbusd overlap.
template <int MG>
inline void rows_dot(const __m512i* v, const int8_t* xt, __m512i* dot) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
#pragma GCC unroll 16
        for (int i = 0; i < MG; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], v[c], _mm512_loadu_si512(xt + QK * i + 64 * c));
}

inline float hsum(__m512 v) {  // fixed order: halves, then quarters, …
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
#elif KQ_ISA == 1
// One row's integer dot with a decoded super-block: codes [8 × 32] u8 against x̂ [256] s8, each
// 32 inputs' pairs scaled by their sub-block's scales[j] (int16 lanes) and summed into int32.
inline __m256i block_dot(const __m256i* codes, const int8_t* xq, const __m256i* scales) {
    __m256i dot = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(codes[j], xv), scales[j]));
    }
    return dot;
}

inline float hsum(__m256 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
#endif

// A pass over the super-blocks [b0, b1) of one weight row (AVX-512). The rows' float accumulators
// live in registers during the pass and in `saved` ([MG][16] floats) between passes: a store and a
// load are exact, so a row split into passes gets the bits of one pass over all its blocks (each
// output accumulates its blocks in the same order either way). One pass (saved = nullptr) is the
// whole row.
#if KQ_ISA == 2
template <int MG>
inline void load_acc(__m512* acc, const float* saved, int64_t b0) {
    for (int i = 0; i < MG; ++i) acc[i] = saved && b0 > 0 ? _mm512_loadu_ps(saved + 16 * i) : _mm512_setzero_ps();
}
#endif

// sums[i] = Σ_k x[m0 + i, k]·W[k] for one Q4_K weight row (with AVX-512, its blocks [b0, b1) only
// where `saved` is given: sums are written after the last block's pass)
template <int MG>
void q4k_rows(const Activations& a, int64_t m0, const uint8_t* w, float* sums, float* mins_row,
              int64_t b0 = 0, int64_t b1 = -1, float* saved = nullptr) {
    const int64_t blocks = a.K / QK;
#if KQ_ISA == 2
    if (b1 < 0) b1 = blocks;
    __m512 acc[MG];
    load_acc<MG>(acc, saved, b0);
    const __m512i nibble = _mm512_set1_epi8(0x0f), lanes = _mm512_load_si512(kQ4Lane);
    for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* block = w + b * Q4K_BYTES;
        for (int p = 0; p < Q4K_BYTES; p += 64)
            _mm_prefetch(reinterpret_cast<const char*>(block + PREFETCH_BYTES + p), _MM_HINT_T2);
        uint16_t dh, dminh;
        std::memcpy(&dh, block, 2);
        std::memcpy(&dminh, block + 2, 2);
        uint64_t sc, mn;
        q4k_scales(block + 4, sc, mn);
        // dmin·mn[j] per sub-block, kept for the whole weight row: the minimums' term is one dot
        // product per row after the blocks (below), not a product per row and block
        _mm256_storeu_ps(mins_row + 8 * b, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_cvtsi64_si128(static_cast<long long>(mn)))), _mm256_set1_ps(half_to_float(dminh))));
        // d·sc per lane (float32, exact: an 11-bit mantissa times a 6-bit integer)
        const __m512 scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutexvar_epi32(
            lanes, _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(sc))))), _mm512_set1_ps(half_to_float(dh)));
        // 64 bytes of nibbles at a time, as stored, then in lane order
        __m512i codes[4], v[4];
        for (int h = 0; h < 2; ++h) {
            const __m512i packed = _mm512_loadu_si512(block + 16 + 64 * h);
            codes[2 * h] = _mm512_and_si512(packed, nibble);
            codes[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        }
        transpose_lanes(codes, v);
        // unrolled: the rows' accumulators stay in registers
        __m512i dot[MG];
        for (int i = 0; i < MG; ++i) dot[i] = _mm512_setzero_si512();
        rows_dot<MG>(v, a.t4.data() + (b * a.M + m0) * QK, dot);
#pragma GCC unroll 16
        for (int i = 0; i < MG; ++i)
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[i]), scale),
                                     _mm512_set1_ps(a.dx(m0 + i, b)), acc[i]);
    }
    if (b1 < blocks) {
        for (int i = 0; i < MG; ++i) _mm512_storeu_ps(saved + 16 * i, acc[i]);
        return;
    }
    // Σ_j dmin·mn[j]·dx·Σx̂ over the row's sub-blocks, 16 at a time in a fixed order (K's alone)
    const int64_t subs = a.K / 32;
    for (int i = 0; i < MG; ++i) {
        const float* low = a.low.data() + (m0 + i) * subs;
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < subs; j += 16) {
            const __mmask16 mask = subs - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (subs - j)) - 1);
            total = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, mins_row + j), _mm512_maskz_loadu_ps(mask, low + j), total);
        }
        sums[i] = hsum(acc[i]) - hsum(total);
    }
#elif KQ_ISA == 1
    __m256 acc[MG];
    __m128 low[MG];
    for (int i = 0; i < MG; ++i) { acc[i] = _mm256_setzero_ps(); low[i] = _mm_setzero_ps(); }
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = w + b * Q4K_BYTES;
        uint16_t dh, dminh;
        std::memcpy(&dh, block, 2);
        std::memcpy(&dminh, block + 2, 2);
        const float d = half_to_float(dh), dmin = half_to_float(dminh);
        uint64_t sc, mn;
        q4k_scales(block + 4, sc, mn);
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mn)));
        __m256i codes[8], scales[8];
        for (int c = 0; c < 4; ++c) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c));
            codes[2 * c] = _mm256_and_si256(packed, nibble);
            codes[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            scales[2 * c] = _mm256_set1_epi16(static_cast<int16_t>((sc >> (16 * c)) & 0xff));
            scales[2 * c + 1] = _mm256_set1_epi16(static_cast<int16_t>((sc >> (16 * c + 8)) & 0xff));
        }
        // unrolled: the rows' accumulators stay in registers
#pragma GCC unroll 16
        for (int i = 0; i < MG; ++i) {
            const int64_t row = m0 + i;
            const int8_t* xq = a.q.data() + row * a.K + b * QK;
            __m256i dot = block_dot(codes, xq, scales);
            const float dx = a.dx(row, b);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * dx), acc[i]);
            const __m128i sums = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.sum32.data() + row * (a.K / 32) + 8 * b));
            low[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mn16, sums)), _mm_set1_ps(dmin * dx), low[i]);
        }
    }
    for (int i = 0; i < MG; ++i) {
        __m128 l = _mm_add_ps(low[i], _mm_movehl_ps(low[i], low[i]));
        l = _mm_add_ss(l, _mm_movehdup_ps(l));
        sums[i] = hsum(acc[i]) - _mm_cvtss_f32(l);
    }
#else
    for (int i = 0; i < MG; ++i) {
        const int64_t row = m0 + i;
        float total = 0.0f, low = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = w + b * Q4K_BYTES;
            uint16_t dh, dminh;
            std::memcpy(&dh, block, 2);
            std::memcpy(&dminh, block + 2, 2);
            uint64_t sc, mn;
            q4k_scales(block + 4, sc, mn);
            const int8_t* xq = a.q.data() + row * a.K + b * QK;
            int32_t dot = 0, mins = 0;
            for (int k = 0; k < QK; ++k) {
                const int c = k / 64, l = k % 64;
                const int q = l < 32 ? block[16 + 32 * c + l] & 15 : block[16 + 32 * c + l - 32] >> 4;
                dot += static_cast<int>((sc >> (8 * (k / 32))) & 0xff) * q * xq[k];
            }
            for (int j = 0; j < 8; ++j) mins += static_cast<int>((mn >> (8 * j)) & 0xff) * a.sum32[row * (a.K / 32) + 8 * b + j];
            const float dx = a.dx(row, b);
            total = std::fma(static_cast<float>(dot), half_to_float(dh) * dx, total);
            low = std::fma(static_cast<float>(mins), half_to_float(dminh) * dx, low);
        }
        sums[i] = total - low;
    }
#endif
}

// sums[i] = Σ_k x[m0 + i, k]·W[k] for one Q6_K weight row (passes as q4k_rows)
template <int MG>
void q6k_rows(const Activations& a, int64_t m0, const uint8_t* w, float* sums, float*,
              int64_t b0 = 0, int64_t b1 = -1, float* saved = nullptr) {
    const int64_t blocks = a.K / QK;
#if KQ_ISA == 2
    if (b1 < 0) b1 = blocks;
    __m512 acc[MG];
    load_acc<MG>(acc, saved, b0);
    const __m512i nibble = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x03), lanes = _mm512_load_si512(kQ6Lane);
    for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* block = w + b * Q6K_BYTES;
        for (int p = 0; p < Q6K_BYTES; p += 64)
            _mm_prefetch(reinterpret_cast<const char*>(block + PREFETCH_BYTES + p), _MM_HINT_T2);
        uint16_t dh;
        std::memcpy(&dh, block + 208, 2);
        // d·sc per lane (float32, exact: an 11-bit mantissa times an 8-bit integer)
        const __m512 scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutexvar_epi32(
            lanes, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192))))),
            _mm512_set1_ps(half_to_float(dh)));
        __m512i codes[4], v[4];
        for (int h = 0; h < 2; ++h) {
            const __m512i lowbits = _mm512_loadu_si512(block + 64 * h);
            const __m256i highbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
            const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(highbits), _mm256_srli_epi16(highbits, 2), 1);
            codes[2 * h] = _mm512_or_si512(_mm512_and_si512(lowbits, nibble),
                                           _mm512_slli_epi16(_mm512_and_si512(hb, two), 4));
            codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lowbits, 4), nibble),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4), two), 4));
        }
        transpose_lanes(codes, v);
        // unrolled: the rows' accumulators stay in registers
        // from the −32 offset's integers (−32·Σ x̂ per sub-block), then the codes' products
        __m512i dot[MG];
#pragma GCC unroll 16
        for (int i = 0; i < MG; ++i) dot[i] = _mm512_loadu_si512(a.off6.data() + (b * a.M + m0 + i) * 16);
        rows_dot<MG>(v, a.t6.data() + (b * a.M + m0) * QK, dot);
#pragma GCC unroll 16
        for (int i = 0; i < MG; ++i)
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[i]), scale),
                                     _mm512_set1_ps(a.dx(m0 + i, b)), acc[i]);
    }
    if (b1 < blocks) {
        for (int i = 0; i < MG; ++i) _mm512_storeu_ps(saved + 16 * i, acc[i]);
        return;
    }
    for (int i = 0; i < MG; ++i) sums[i] = hsum(acc[i]);
#elif KQ_ISA == 1
    __m256 acc[MG];
    for (int i = 0; i < MG; ++i) acc[i] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x03);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = w + b * Q6K_BYTES;
        uint16_t dh;
        std::memcpy(&dh, block + 208, 2);
        const float d = half_to_float(dh);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
        __m256i codes[8], scales[8];
        for (int h = 0; h < 2; ++h)
            for (int part = 0; part < 2; ++part) {  // 32 low-nibble bytes, 32 high-bit bytes
                const __m256i lowbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32 * part));
                const __m256i hb = _mm256_srli_epi16(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h)), 2 * part);
                // inputs 128h + 32·part + l and 128h + 64 + 32·part + l
                codes[4 * h + part] = _mm256_or_si256(_mm256_and_si256(lowbits, nibble),
                                                      _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
                codes[4 * h + 2 + part] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(lowbits, 4), nibble),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), two), 4));
            }
        for (int j = 0; j < 8; ++j) {  // 32 inputs: sub-blocks 2j (lanes 0-7) and 2j + 1 (lanes 8-15)
            const int8_t* s = reinterpret_cast<const int8_t*>(block + 192 + 2 * j);
            scales[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(s[0])), _mm_set1_epi16(s[1]), 1);
        }
        // unrolled: the rows' accumulators stay in registers
#pragma GCC unroll 16
        for (int i = 0; i < MG; ++i) {
            const int64_t row = m0 + i;
            const int8_t* xq = a.q.data() + row * a.K + b * QK;
            __m256i dot = block_dot(codes, xq, scales);
            const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sum16.data() + row * (a.K / 16) + 16 * b));
            dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.dx(row, b)), acc[i]);
        }
    }
    for (int i = 0; i < MG; ++i) sums[i] = hsum(acc[i]);
#else
    for (int i = 0; i < MG; ++i) {
        const int64_t row = m0 + i;
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = w + b * Q6K_BYTES;
            uint16_t dh;
            std::memcpy(&dh, block + 208, 2);
            const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
            const int8_t* xq = a.q.data() + row * a.K + b * QK;
            int32_t dot = 0;
            for (int k = 0; k < QK; ++k) {
                const int h = k / 128, r = k % 128, quarter = r / 32, l = r % 32;
                const uint8_t lowbyte = block[64 * h + l + (quarter & 1) * 32];
                const int lo = quarter < 2 ? lowbyte & 15 : lowbyte >> 4;
                const int hi = (block[128 + 32 * h + l] >> (2 * quarter)) & 3;
                dot += sc[k / 16] * ((lo | (hi << 4)) - 32) * xq[k];
            }
            total = std::fma(static_cast<float>(dot), half_to_float(dh) * a.dx(row, b), total);
        }
        sums[i] = total;
    }
#endif
}

template <int MG>
void rows_kq(int type, const Activations& a, int64_t m0, const uint8_t* w, float* sums, float* scratch,
             int64_t b0, int64_t b1, float* saved) {
    if (type == TYPE_Q4_K)
        q4k_rows<MG>(a, m0, w, sums, scratch, b0, b1, saved);
    else
        q6k_rows<MG>(a, m0, w, sums, scratch, b0, b1, saved);
}

#define KQ_CASE(G) case G: rows_kq<G>(type, a, m, w, sums, scratch, b0, b1, saved); break;

// One group of g activation rows (from m) against one weight row's blocks [b0, b1) (all: b1 = -1)
void group_pass(int type, const Activations& a, int64_t m, int g, const uint8_t* w, float* sums, float* scratch,
                int64_t b0, int64_t b1, float* saved) {
    switch (g) {
        KQ_CASE(1) KQ_CASE(2) KQ_CASE(3) KQ_CASE(4) KQ_CASE(5) KQ_CASE(6) KQ_CASE(7) KQ_CASE(8)
#if KQ_ISA == 2
        KQ_CASE(9) KQ_CASE(10) KQ_CASE(11) KQ_CASE(12)
#endif
        default: break;
    }
}

// rows in equal groups of at most ROWS (16 rows: 8 + 8, not 12 + 4): each group decodes the weight
// row again, and a group's cost is mostly per row
int64_t group_size(int64_t M) {
    const int64_t groups = (M + ROWS - 1) / ROWS;
    return (M + groups - 1) / groups;
}

void weight_row(int type, const Activations& a, int64_t M, const uint8_t* w, float* sums, float* scratch) {
    const int64_t size = group_size(M);
    for (int64_t m = 0; m < M; m += size) {
        const int g = static_cast<int>(std::min<int64_t>(M - m, size));
        group_pass(type, a, m, g, w, sums + m, scratch, 0, -1, nullptr);
    }
}

// y[m, n] = sums[m] (+ bias[n]) for the M rows: output column n, bfloat16 or float32
void store_column(const float* sums, int64_t M, int64_t n, const float* bias, void* y, int64_t ldy, int out_f32) {
    const float add = bias ? bias[n] : 0.0f;
    for (int64_t m = 0; m < M; ++m) {
        const float v = sums[m] + add;
        if (out_f32)
            static_cast<float*>(y)[m * ldy + n] = v;
        else
            static_cast<bf16*>(y)[m * ldy + n] = float_to_bf16(v);
    }
}

#if KQ_ISA == 2
// Weight rows a tile at a time, their blocks a span at a time: a group's int8 activations over the
// whole K (9 rows of an 8960-input product: 80 KB) do not stay in L1, so one weight row after
// another would stream them from L2 again for each (at 9 rows ffn_down ran 1.5x slower per byte
// than gate|up, 1536 inputs); a span's (≤ SPAN_BYTES) stays in L1 for the tile's rows. The bits
// are those of weight_row (q4k_rows: passes).
const int TILE = 8;                  // weight rows per tile
const int64_t SPAN_BYTES = 16 << 10;  // a group's activations per span
int64_t tiled_above = 24 << 10;        // activations (M·K bytes) above which tiles run (sd_kq_tiled_above)

void weight_tile(int type, const Activations& a, int64_t M, const uint8_t* w, int64_t row_bytes, int count,
                 float* sums, float* scratch, float* saved) {
    const int64_t size = group_size(M), blocks = a.K / QK;
    for (int64_t m = 0; m < M; m += size) {
        const int g = static_cast<int>(std::min<int64_t>(M - m, size));
        const int64_t span = std::max<int64_t>(1, SPAN_BYTES / (g * QK));
        for (int64_t b0 = 0; b0 < blocks; b0 += span) {
            const int64_t b1 = std::min(blocks, b0 + span);
            for (int t = 0; t < count; ++t)
                group_pass(type, a, m, g, w + t * row_bytes, sums + t * M + m, scratch + t * (a.K / 32), b0, b1,
                           saved + t * ROWS * 16);
        }
    }
}
#endif

}  // namespace

extern "C" {

int sd_kq_isa() { return KQ_ISA; }

// Sets the activation bytes (M·K) above which products run tiled (the bits are the same either
// way: tests and benchmarks compare the two paths); returns the previous value (-1 without AVX-512).
int64_t sd_kq_tiled_above(int64_t bytes) {
#if KQ_ISA == 2
    const int64_t previous = tiled_above;
    tiled_above = bytes;
    return previous;
#else
    (void)bytes;
    return -1;
#endif
}

int64_t sd_kq_row_bytes(int type, int64_t K) {
    if (K % QK != 0) return -1;
    if (type == TYPE_Q4_K) return K / QK * Q4K_BYTES;
    if (type == TYPE_Q6_K) return K / QK * Q6K_BYTES;
    return -1;
}

// y[M, Σ rows] = x[M, K] · [W_0; W_1; …]ᵀ (+ bias): `parts` weight tensors, each rows[p] rows of
// K inputs in GGML type types[p] (Q4_K or Q6_K) at weights[p], their outputs side by side; x rows
// ldx apart (bfloat16), y rows ldy apart, bfloat16 or float32 (out_f32). K a multiple of 256.
void sd_linear_kq(const bf16* x, int64_t M, int64_t K, int64_t ldx, int parts, const uint8_t* const* weights,
                  const int* types, const int64_t* rows, const float* bias, void* y, int64_t ldy, int out_f32,
                  int threads) {
    if (M <= 0) return;
    Activations a(M, K, std::count(types, types + parts, TYPE_Q4_K) > 0, std::count(types, types + parts, TYPE_Q6_K) > 0);
    std::vector<int64_t> first(parts + 1, 0);
    for (int p = 0; p < parts; ++p) first[p + 1] = first[p] + rows[p];
    const int64_t total = first[parts];
#if KQ_ISA == 2
    const bool tiled = M > 1 && M * K > tiled_above;
    std::vector<std::pair<int, int64_t>> tiles;  // (part, first row): tiles never straddle parts
    if (tiled)
        for (int p = 0; p < parts; ++p)
            for (int64_t r = 0; r < rows[p]; r += TILE) tiles.emplace_back(p, r);
#endif
#pragma omp parallel num_threads(threads)
    {
        // the rows' blocks quantized by all threads, then the output columns split between them
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * (K / QK); ++i) {
            const int64_t m = i / (K / QK), b = i % (K / QK);
            prepare_block(a, x + m * ldx + b * QK, m, b);
        }
#if KQ_ISA == 2
        if (tiled) {
            std::vector<float> sums(TILE * M), scratch(TILE * (K / 32)), saved(TILE * ROWS * 16);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) {
                const int p = tiles[i].first;
                const int64_t r = tiles[i].second, row_bytes = sd_kq_row_bytes(types[p], K);
                const int count = static_cast<int>(std::min<int64_t>(TILE, rows[p] - r));
                weight_tile(types[p], a, M, weights[p] + r * row_bytes, row_bytes, count, sums.data(), scratch.data(),
                            saved.data());
                for (int t = 0; t < count; ++t)
                    store_column(sums.data() + t * M, M, first[p] + r + t, bias, y, ldy, out_f32);
            }
        } else
#endif
        {
            std::vector<float> sums(M), scratch(K / 32);
#pragma omp for schedule(static)
            for (int64_t n = 0; n < total; ++n) {
                const int p = static_cast<int>(std::upper_bound(first.begin(), first.end(), n) - first.begin()) - 1;
                const uint8_t* w = weights[p] + (n - first[p]) * sd_kq_row_bytes(types[p], K);
                weight_row(types[p], a, M, w, sums.data(), scratch.data());
                store_column(sums.data(), M, n, bias, y, ldy, out_f32);
            }
        }
    }
}

}  // extern "C"
