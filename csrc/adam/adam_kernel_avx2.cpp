// The AVX2 + FMA + F16C kernel: 8 fp32 lanes, two vectors per iteration. Compiled with
// -mavx2 -mfma -mf16c (CMakeLists.txt) and called only when cpu_features().avx2 is set.
// Same operations as adam_math.h ([Note: operation order]), so results equal the scalar
// kernel's bit for bit; the tail (< 16 elements) runs adam_math's element function.
#include "adam/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "adam/adam_math.h"
#include "adam/roofline_impl.h"
#include "adam/simd_avx2.h"

namespace offload {
namespace {

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

// kAhead: the prefetch distance in elements (0: none), kStream: the copy-out with
// non-temporal stores ([Note: large steps] in kernels.h).
template <DType G, DType M, DType O, bool L2, bool kStream, size_t kAhead>
void avx2_loop(const AdamBuffers& b, const AdamScalars& s, size_t begin, size_t end) {
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
    if constexpr (kAhead != 0) {
      prefetch_block<DType::kF32, 16>(p, i + kAhead);
      prefetch_block<G, 16>(g, i + kAhead);
      prefetch_block<M, 16>(m, i + kAhead);
      prefetch_block<M, 16>(v, i + kAhead);
    }
    const Update8 a = update8<G, M, L2>(p, g, m, v, s8, i);
    const Update8 c = update8<G, M, L2>(p, g, m, v, s8, i + 8);
    _mm256_storeu_ps(p + i, a.p);
    _mm256_storeu_ps(p + i + 8, c.p);
    store16<M>(m, i, a.m, c.m);
    store16<M>(v, i, a.v, c.v);
    if constexpr (O != DType::kNone) store16<O, kStream>(out, i, a.p, c.p);
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

template <DType G, DType M, DType O, bool L2>
void avx2_kernel(const AdamBuffers& b, const AdamScalars& s, size_t begin, size_t end) {
  constexpr size_t kAhead = kAheadFor<G, M, O>;
  if (!large_step(b)) return avx2_loop<G, M, O, L2, false, 0>(b, s, begin, end);
  if constexpr (O != DType::kNone) {
    if (copy_out_aligned(b, begin, 32)) {
      avx2_loop<G, M, O, L2, true, kAhead>(b, s, begin, end);
      _mm_sfence();  // the streamed lines are globally visible before the step returns
      return;
    }
  }
  avx2_loop<G, M, O, L2, false, kAhead>(b, s, begin, end);
}

OFFLOAD_ADAM_SELECTOR(select_avx2, avx2_kernel)

}  // namespace

KernelSet avx2_kernels() {
  KernelSet k;
  k.select = &select_avx2;
  OFFLOAD_ROOFLINE_VARIANTS(k);
  k.roofline_triad = &roofline_impl::triad;
  return k;
}

}  // namespace offload

#else  // not x86-64

namespace offload {
KernelSet avx2_kernels() { return {}; }
}  // namespace offload

#endif
