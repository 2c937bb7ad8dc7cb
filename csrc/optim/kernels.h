// The per-ISA kernel tables of the one-state optimizers. Each kernel file exports one
// table whose selectors return the instantiation for a (grad dtype, state dtype, output
// dtype, flag) combination, or an empty table when that file was compiled for another
// architecture. Dispatch (one_state.cpp) calls a table only after checking the CPU.
#pragma once

#include <cstddef>

#include "optim/one_state.h"

namespace offload {

// Updates elements [begin, end) of b.
using LionKernel = void (*)(const OneStateBuffers& b, const LionScalars& s, size_t begin,
                            size_t end);
using AdagradKernel = void (*)(const OneStateBuffers& b, const AdagradScalars& s,
                               size_t begin, size_t end);
using RooflineOneStateKernel = void (*)(float* p, const float* g, float* s, size_t begin,
                                        size_t end);

struct OneStateKernelSet {
  // flag: unused by Lion; Adagrad's L2 weight decay (weight_decay != 0).
  LionKernel (*lion)(DType grad, DType state, DType out, bool flag) = nullptr;
  AdagradKernel (*adagrad)(DType grad, DType state, DType out, bool flag) = nullptr;
  RooflineOneStateKernel roofline = nullptr;
};

OneStateKernelSet scalar_one_state_kernels();
OneStateKernelSet portable_one_state_kernels();
OneStateKernelSet avx2_one_state_kernels();    // empty when not built for x86-64
OneStateKernelSet avx512_one_state_kernels();  // empty when not built for x86-64

}  // namespace offload
