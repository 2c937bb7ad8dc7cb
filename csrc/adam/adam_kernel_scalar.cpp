// The scalar reference kernel: adam_math.h applied one element at a time. Every other
// kernel is tested against this one, bit for bit. Auto-vectorisation is switched off here
// so that "scalar" stays a genuinely independent path (and a readable one in a profile).
#include "adam/adam_math.h"
#include "adam/kernels.h"
#include "adam/roofline_impl.h"

namespace offload {
namespace {

template <DType G, DType M, DType O, bool L2>
__attribute__((optimize("no-tree-vectorize"))) void scalar_kernel(
    const AdamBuffers& b, const AdamScalars& s, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) adam_math::adam_element<G, M, O, L2>(b, s, i);
}

OFFLOAD_ADAM_SELECTOR(select_scalar, scalar_kernel)

}  // namespace

KernelSet scalar_kernels() {
  KernelSet k;
  k.select = &select_scalar;
  OFFLOAD_ROOFLINE_VARIANTS(k);
  k.roofline_triad = &roofline_impl::triad;
  return k;
}

}  // namespace offload
