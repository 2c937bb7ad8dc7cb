// The AVX-512 (F/BW/VL/DQ) kernel: 16 fp32 lanes, two vectors per iteration. Compiled
// with the AVX-512 flags (CMakeLists.txt) and called only when cpu_features().avx512 is
// set. Same operations as adam_math.h ([Note: operation order]): equal to the scalar
// kernel bit for bit; the tail (< 16 elements) runs adam_math's element function.
#include "adam/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "adam/adam_math.h"
#include "adam/roofline_impl.h"
#include "adam/simd_avx512.h"

namespace offload {
namespace {

struct Scalars16 {
  __m512 grad_scale, l2, decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size,
      inv_bc2_sqrt, eps;
  explicit Scalars16(const AdamScalars& s)
      : grad_scale(_mm512_set1_ps(s.grad_scale)),
        l2(_mm512_set1_ps(s.l2)),
        decay(_mm512_set1_ps(s.decay)),
        one_minus_beta1(_mm512_set1_ps(s.one_minus_beta1)),
        beta2(_mm512_set1_ps(s.beta2)),
        one_minus_beta2(_mm512_set1_ps(s.one_minus_beta2)),
        neg_step_size(_mm512_set1_ps(s.neg_step_size)),
        inv_bc2_sqrt(_mm512_set1_ps(s.inv_bc2_sqrt)),
        eps(_mm512_set1_ps(s.eps)) {}
};

struct Update16 {
  __m512 p, m, v;
};

// [Note: operation order] on 16 lanes: the new p, m, v of elements i..i+15.
template <DType G, DType M, bool L2>
inline Update16 update16(const float* p_base, const void* g_base, const void* m_base,
                         const void* v_base, const Scalars16& s, size_t i) {
  __m512 g = _mm512_mul_ps(load16<G>(g_base, i), s.grad_scale);
  __m512 p = _mm512_loadu_ps(p_base + i);
  if constexpr (L2) g = _mm512_fmadd_ps(p, s.l2, g);
  p = _mm512_mul_ps(p, s.decay);
  __m512 m = load16<M>(m_base, i);
  __m512 v = load16<M>(v_base, i);
  m = _mm512_fmadd_ps(s.one_minus_beta1, _mm512_sub_ps(g, m), m);
  v = _mm512_fmadd_ps(_mm512_mul_ps(s.one_minus_beta2, g), g, _mm512_mul_ps(v, s.beta2));
  const __m512 d = _mm512_fmadd_ps(_mm512_sqrt_ps(v), s.inv_bc2_sqrt, s.eps);
  p = _mm512_fmadd_ps(s.neg_step_size, _mm512_div_ps(m, d), p);
  return {p, m, v};
}

// 32 elements per iteration: two independent vectors for the sqrt/div unit, and the
// copy-out in whole cache lines. kAhead: the prefetch distance in elements (0: none).
template <DType G, DType M, DType O, bool L2, bool kStream, size_t kAhead>
void avx512_loop(const AdamBuffers& b, const AdamScalars& s, size_t begin, size_t end) {
  const Scalars16 s16(s);
  // The pointers in locals: read through `b` they would be reloaded after every store
  // (a float store may alias the struct, as far as the compiler can tell).
  float* const p = b.master;
  const void* const g = b.grad;
  void* const m = b.exp_avg;
  void* const v = b.exp_avg_sq;
  void* const out = b.out;
  size_t i = begin;
  for (; i + 32 <= end; i += 32) {
    if constexpr (kAhead != 0) {
      prefetch_block<DType::kF32, 32>(p, i + kAhead);
      prefetch_block<G, 32>(g, i + kAhead);
      prefetch_block<M, 32>(m, i + kAhead);
      prefetch_block<M, 32>(v, i + kAhead);
    }
    const Update16 a = update16<G, M, L2>(p, g, m, v, s16, i);
    const Update16 c = update16<G, M, L2>(p, g, m, v, s16, i + 16);
    store32<DType::kF32>(p, i, a.p, c.p);
    store32<M>(m, i, a.m, c.m);
    store32<M>(v, i, a.v, c.v);
    if constexpr (O != DType::kNone) store32<O, kStream>(out, i, a.p, c.p);
  }
  for (; i + 16 <= end; i += 16) {
    const Update16 a = update16<G, M, L2>(p, g, m, v, s16, i);
    _mm512_storeu_ps(p + i, a.p);
    store16<M>(m, i, a.m);
    store16<M>(v, i, a.v);
    if constexpr (O != DType::kNone) store16<O>(out, i, a.p);
  }
  for (; i < end; ++i) adam_math::adam_element<G, M, O, L2>(b, s, i);
}

template <DType G, DType M, DType O, bool L2>
void avx512_kernel(const AdamBuffers& b, const AdamScalars& s, size_t begin, size_t end) {
  constexpr size_t kAhead = kAheadFor<G, M, O>;
  if (!large_step(b)) return avx512_loop<G, M, O, L2, false, 0>(b, s, begin, end);
  if constexpr (O != DType::kNone) {
    if (copy_out_aligned(b, begin, 64)) {
      avx512_loop<G, M, O, L2, true, kAhead>(b, s, begin, end);
      _mm_sfence();  // the streamed lines are globally visible before the step returns
      return;
    }
  }
  avx512_loop<G, M, O, L2, false, kAhead>(b, s, begin, end);
}

OFFLOAD_ADAM_SELECTOR(select_avx512, avx512_kernel)

}  // namespace

KernelSet avx512_kernels() {
  KernelSet k;
  k.select = &select_avx512;
  OFFLOAD_ROOFLINE_VARIANTS(k);
  k.roofline_triad = &roofline_impl::triad;
  return k;
}

}  // namespace offload

#else  // not x86-64

namespace offload {
KernelSet avx512_kernels() { return {}; }
}  // namespace offload

#endif
