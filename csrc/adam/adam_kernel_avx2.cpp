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

// fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (adam_math::f32_to_bf16).
inline __m128i to_bf16(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  // Values are <= 0xFFFF, so unsigned-saturating packing is exact. packus works within
  // 128-bit lanes ([a0..3 a0..3 | a4..7 a4..7]); the permute gathers quads 0 and 2.
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
}

template <DType D>
inline void store8(void* base, size_t i, __m256 f) {
  if constexpr (D == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, f);
  } else if constexpr (D == DType::kBF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     to_bf16(f));
  } else if constexpr (D == DType::kF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
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

// [Note: operation order] on 8 lanes.
template <DType G, DType M, DType O, bool L2>
inline void step8(const AdamBuffers& b, const Scalars8& s, size_t i) {
  __m256 g = _mm256_mul_ps(load8<G>(b.grad, i), s.grad_scale);
  __m256 p = _mm256_loadu_ps(b.master + i);
  if constexpr (L2) g = _mm256_fmadd_ps(p, s.l2, g);
  p = _mm256_mul_ps(p, s.decay);
  __m256 m = load8<M>(b.exp_avg, i);
  __m256 v = load8<M>(b.exp_avg_sq, i);
  m = _mm256_fmadd_ps(s.one_minus_beta1, _mm256_sub_ps(g, m), m);
  v = _mm256_fmadd_ps(_mm256_mul_ps(s.one_minus_beta2, g), g, _mm256_mul_ps(v, s.beta2));
  const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v), s.inv_bc2_sqrt, s.eps);
  p = _mm256_fmadd_ps(s.neg_step_size, _mm256_div_ps(m, d), p);
  _mm256_storeu_ps(b.master + i, p);
  store8<M>(b.exp_avg, i, m);
  store8<M>(b.exp_avg_sq, i, v);
  if constexpr (O != DType::kNone) store8<O>(b.out, i, p);
}

template <DType G, DType M, DType O, bool L2>
void avx2_kernel(const AdamBuffers& b, const AdamScalars& s, size_t begin, size_t end) {
  const Scalars8 s8(s);
  size_t i = begin;
  // Two independent vectors per iteration keep the sqrt/div unit and the loads busy.
  for (; i + 16 <= end; i += 16) {
    step8<G, M, O, L2>(b, s8, i);
    step8<G, M, O, L2>(b, s8, i + 8);
  }
  for (; i + 8 <= end; i += 8) step8<G, M, O, L2>(b, s8, i);
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
