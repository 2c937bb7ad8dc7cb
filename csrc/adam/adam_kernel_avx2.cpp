// The AVX2 + FMA + F16C kernel: 8 fp32 lanes, two vectors per iteration. Compiled with
// -mavx2 -mfma -mf16c (CMakeLists.txt) and called only when cpu_features().avx2 is set.
// Same operations as adam_math.h ([Note: operation order]), so results equal the scalar
// kernel's bit for bit; the tail (< 16 elements) runs adam_math's element function.
#include "adam/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "adam/adam_math.h"
#include "adam/roofline_impl.h"

namespace offload {
namespace {

template <DType D>
inline __m256 load8(const void* base, size_t i) {
  if constexpr (D == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBF16) {
    // bf16 is the upper half of an fp32: widen to 32 bits and shift into place.
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_cvtph_ps(h);
  }
}

// [Note: bf16 rounding on AVX2] fp32 -> bf16, round to nearest even, NaN -> 0x7FC0
// (adam_math::f32_to_bf16): bits + 0x7FFF + lsb, upper half kept. The narrowing to 16 bits
// is done for two vectors at once (one shift, one word blend, one byte shuffle, one
// permute for 16 values) rather than per vector (pack + permute each): the step is bound
// by the sqrt/divide unit, and every extra shuffle competes with it for issue slots. In
// cache on Zen 2 this took bf16 output from 1450 to 1750 Mparam/s per core (fp32: 2600).
// (Measured and rejected: computing the lsb with a compare instead of a shift, four
// vectors per iteration, storing the moments before the sqrt/div chain: no gain or worse.)
inline __m256i round_bf16_in_upper_half(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
}

// 16 values (a: elements 0..7, b: 8..15) to 16 contiguous bf16.
inline __m256i to_bf16_x16(__m256 a, __m256 b) {
  const __m256i lo = _mm256_srli_epi32(round_bf16_in_upper_half(a), 16);
  const __m256i hi = round_bf16_in_upper_half(b);
  // Per 32-bit lane: low word a_k, high word b_k; then per 128-bit lane gather the a's and
  // the b's ([a0..3 b0..3 | a4..7 b4..7]) and order the 64-bit blocks as a0..7 b0..7.
  const __m256i mixed = _mm256_blend_epi16(lo, hi, 0xAA);
  const __m256i grouped = _mm256_shuffle_epi8(
      mixed, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  return _mm256_permute4x64_epi64(grouped, 0xD8);
}

// 8 values to 8 bf16 (the remainder loop).
inline __m128i to_bf16_x8(__m256 f) {
  return _mm256_castsi256_si128(to_bf16_x16(f, f));
}

template <DType D>
inline void store8(void* base, size_t i, __m256 f) {
  if constexpr (D == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, f);
  } else if constexpr (D == DType::kBF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     to_bf16_x8(f));
  } else if constexpr (D == DType::kF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Elements i..i+7 from a, i+8..i+15 from b.
template <DType D>
inline void store16(void* base, size_t i, __m256 a, __m256 b) {
  if constexpr (D == DType::kBF16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        to_bf16_x16(a, b));
  } else {
    store8<D>(base, i, a);
    store8<D>(base, i + 8, b);
  }
}

struct Scalars8 {
  __m256 grad_scale, l2, decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size,
      inv_bc2_sqrt, eps;
  explicit Scalars8(const AdamScalars& s)
      : grad_scale(_mm256_set1_ps(s.grad_scale)),
        l2(_mm256_set1_ps(s.l2)),
        decay(_mm256_set1_ps(s.decay)),
        one_minus_beta1(_mm256_set1_ps(s.one_minus_beta1)),
        beta2(_mm256_set1_ps(s.beta2)),
        one_minus_beta2(_mm256_set1_ps(s.one_minus_beta2)),
        neg_step_size(_mm256_set1_ps(s.neg_step_size)),
        inv_bc2_sqrt(_mm256_set1_ps(s.inv_bc2_sqrt)),
        eps(_mm256_set1_ps(s.eps)) {}
};

struct Update8 {
  __m256 p, m, v;
};

// [Note: operation order] on 8 lanes: the new p, m, v of elements i..i+7.
template <DType G, DType M, bool L2>
inline Update8 update8(const float* p_base, const void* g_base, const void* m_base,
                       const void* v_base, const Scalars8& s, size_t i) {
  __m256 g = _mm256_mul_ps(load8<G>(g_base, i), s.grad_scale);
  __m256 p = _mm256_loadu_ps(p_base + i);
  if constexpr (L2) g = _mm256_fmadd_ps(p, s.l2, g);
  p = _mm256_mul_ps(p, s.decay);
  __m256 m = load8<M>(m_base, i);
  __m256 v = load8<M>(v_base, i);
  m = _mm256_fmadd_ps(s.one_minus_beta1, _mm256_sub_ps(g, m), m);
  v = _mm256_fmadd_ps(_mm256_mul_ps(s.one_minus_beta2, g), g, _mm256_mul_ps(v, s.beta2));
  const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v), s.inv_bc2_sqrt, s.eps);
  p = _mm256_fmadd_ps(s.neg_step_size, _mm256_div_ps(m, d), p);
  return {p, m, v};
}

template <DType G, DType M, DType O, bool L2>
void avx2_kernel(const AdamBuffers& b, const AdamScalars& s, size_t begin, size_t end) {
  const Scalars8 s8(s);
  // The pointers in locals: read through `b` they would be reloaded after every store
  // (a float store may alias the struct, as far as the compiler can tell).
  float* const p = b.master;
  const void* const g = b.grad;
  void* const m = b.exp_avg;
  void* const v = b.exp_avg_sq;
  void* const out = b.out;
  size_t i = begin;
  // 16 elements per iteration: two independent vectors keep the sqrt/div unit busy, and
  // bf16 results are narrowed in pairs ([Note: bf16 rounding on AVX2]).
  for (; i + 16 <= end; i += 16) {
    const Update8 a = update8<G, M, L2>(p, g, m, v, s8, i);
    const Update8 c = update8<G, M, L2>(p, g, m, v, s8, i + 8);
    _mm256_storeu_ps(p + i, a.p);
    _mm256_storeu_ps(p + i + 8, c.p);
    store16<M>(m, i, a.m, c.m);
    store16<M>(v, i, a.v, c.v);
    if constexpr (O != DType::kNone) store16<O>(out, i, a.p, c.p);
  }
  for (; i + 8 <= end; i += 8) {
    const Update8 a = update8<G, M, L2>(p, g, m, v, s8, i);
    _mm256_storeu_ps(p + i, a.p);
    store8<M>(m, i, a.m);
    store8<M>(v, i, a.v);
    if constexpr (O != DType::kNone) store8<O>(out, i, a.p);
  }
  for (; i < end; ++i) adam_math::adam_element<G, M, O, L2>(b, s, i);
}

OFFLOAD_ADAM_SELECTOR(select_avx2, avx2_kernel)

}  // namespace

KernelSet avx2_kernels() {
  KernelSet k;
  k.select = &select_avx2;
  k.roofline_adam = &roofline_impl::adam_traffic;
  k.roofline_triad = &roofline_impl::triad;
  return k;
}

}  // namespace offload

#else  // not x86-64

namespace offload {
KernelSet avx2_kernels() { return {}; }
}  // namespace offload

#endif
