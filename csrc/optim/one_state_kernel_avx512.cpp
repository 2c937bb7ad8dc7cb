// The AVX-512 (F/BW/VL/DQ) kernels of Lion and Adagrad: one_state_math.h on 16 fp32 lanes,
// two vectors per iteration. Compiled with the AVX-512 flags (CMakeLists.txt) and called
// only when cpu_features().avx512 is set. Equal to the scalar kernels bit for bit.
#include "optim/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "adam/simd_avx512.h"
#include "optim/kernel_select.h"
#include "optim/one_state_math.h"

namespace offload {
namespace {

struct Avx512Lanes : Avx512Arith {
  template <DType D>
  static void store2(void* base, size_t i, V a, V b) {
    store16<D>(base, i, a);
    store16<D>(base, i + kWidth, b);
  }
  // copysign(1, a) where a is non-zero and ordered, else +0: ScalarLanes::sign's values.
  static V sign(V a) {
    const __mmask16 nonzero = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    const __m512i sign_bit = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN));
    const __m512i one = _mm512_or_si512(sign_bit, _mm512_castps_si512(_mm512_set1_ps(1.0f)));
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(nonzero, one));
  }
};

struct Avx512Impl {
  template <class Op, DType G, DType S, DType O, bool F>
  static void kernel(const OneStateBuffers& b, const typename Op::Scalars& s, size_t begin,
                     size_t end) {
    one_state_math::run_vectors<Avx512Lanes, Op, G, S, O, F>(b, s, begin, end);
  }
};

}  // namespace

OneStateKernelSet avx512_one_state_kernels() {
  return one_state_select::make_kernel_set<Avx512Impl>(&one_state_math::one_state_traffic);
}

}  // namespace offload

#else  // not x86-64

namespace offload {
OneStateKernelSet avx512_one_state_kernels() { return {}; }
}  // namespace offload

#endif
