// The AVX2 + FMA + F16C kernels of Lion and Adagrad: one_state_math.h on 8 fp32 lanes, two
// vectors per iteration. Compiled with -mavx2 -mfma -mf16c (CMakeLists.txt) and called only
// when cpu_features().avx2 is set. Equal to the scalar kernels bit for bit.
#include "optim/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "adam/simd_avx2.h"
#include "optim/kernel_select.h"
#include "optim/one_state_math.h"

namespace offload {
namespace {

struct Avx2Lanes : Avx2Arith {
  // Elements i..i+7 from a, i+8..i+15 from b; bf16 narrowed in one go ([Note: bf16
  // rounding on AVX2], csrc/adam/simd_avx2.h).
  template <DType D>
  static void store2(void* base, size_t i, V a, V b) {
    store16<D>(base, i, a, b);
  }
  // copysign(1, a) where a is non-zero and ordered, else +0: ScalarLanes::sign's values.
  static V sign(V a) {
    const V nonzero = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_OQ);
    const V one = _mm256_or_ps(_mm256_and_ps(a, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
    return _mm256_and_ps(nonzero, one);
  }
};

struct Avx2Impl {
  template <class Op, DType G, DType S, DType O, bool F>
  static void kernel(const OneStateBuffers& b, const typename Op::Scalars& s, size_t begin,
                     size_t end) {
    one_state_math::run_vectors<Avx2Lanes, Op, G, S, O, F>(b, s, begin, end);
  }
};

}  // namespace

OneStateKernelSet avx2_one_state_kernels() {
  return one_state_select::make_kernel_set<Avx2Impl>(&one_state_math::one_state_traffic);
}

}  // namespace offload

#else  // not x86-64

namespace offload {
OneStateKernelSet avx2_one_state_kernels() { return {}; }
}  // namespace offload

#endif
