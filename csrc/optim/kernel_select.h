// Picking a kernel file's instantiation from run-time dtype codes: the selectors of the
// one-state kernel tables (kernels.h). Included by the kernel files only, each of which
// instantiates its own copy with its own ISA flags.
#pragma once

#include <cstddef>

#include "optim/kernels.h"
#include "optim/one_state_math.h"

namespace offload {
namespace one_state_select {
// Internal linkage: each kernel file instantiates its own (see [Note: one copy per ISA]).
namespace {

// `Impl::kernel<Op, G, S, O, F>` is a kernel file's instantiation for one combination;
// these pick it from run-time dtype codes. nullptr: a combination no kernel implements.
template <class Impl, class Op, DType G, DType S, bool F>
auto select_out(DType out) -> void (*)(const OneStateBuffers&, const typename Op::Scalars&,
                                       size_t, size_t) {
  switch (out) {
    case DType::kNone: return &Impl::template kernel<Op, G, S, DType::kNone, F>;
    case DType::kBF16: return &Impl::template kernel<Op, G, S, DType::kBF16, F>;
    case DType::kF16: return &Impl::template kernel<Op, G, S, DType::kF16, F>;
    default: return nullptr;
  }
}

template <class Impl, class Op, DType G, bool F>
auto select_state(DType state, DType out) {
  switch (state) {
    case DType::kF32: return select_out<Impl, Op, G, DType::kF32, F>(out);
    case DType::kBF16: return select_out<Impl, Op, G, DType::kBF16, F>(out);
    default: return decltype(select_out<Impl, Op, G, DType::kF32, F>(out)){nullptr};
  }
}

template <class Impl, class Op, bool F>
auto select_grad(DType grad, DType state, DType out) {
  switch (grad) {
    case DType::kF32: return select_state<Impl, Op, DType::kF32, F>(state, out);
    case DType::kBF16: return select_state<Impl, Op, DType::kBF16, F>(state, out);
    case DType::kF16: return select_state<Impl, Op, DType::kF16, F>(state, out);
    default: return decltype(select_state<Impl, Op, DType::kF32, F>(state, out)){nullptr};
  }
}

template <class Impl, class Op>
auto select(DType grad, DType state, DType out, bool flag)
    -> void (*)(const OneStateBuffers&, const typename Op::Scalars&, size_t, size_t) {
  if constexpr (Op::kHasFlag) {
    if (flag) return select_grad<Impl, Op, true>(grad, state, out);
  }
  return select_grad<Impl, Op, false>(grad, state, out);
}

// The table of a kernel file whose `Impl` instantiates both optimizers.
template <class Impl>
OneStateKernelSet make_kernel_set(RooflineOneStateKernel roofline) {
  OneStateKernelSet k;
  k.lion = &select<Impl, one_state_math::LionOp>;
  k.adagrad = &select<Impl, one_state_math::AdagradOp>;
  k.roofline = roofline;
  return k;
}

}  // namespace
}  // namespace one_state_select
}  // namespace offload
