// The per-ISA kernel tables. Each kernel file exports one selector that returns the
// instantiation for a (grad dtype, moment dtype, output dtype, L2) combination, or
// nullptr when that file was compiled for another architecture. Dispatch (adam.cpp)
// calls a selector only after checking the CPU (csrc/common/cpu_features.h).
#pragma once

#include <cstddef>

#include "adam/adam.h"

namespace offload {

// Updates elements [begin, end) of b.
using AdamKernel = void (*)(const AdamBuffers& b, const AdamScalars& s, size_t begin,
                            size_t end);
using RooflineAdamKernel = void (*)(float* p, const float* g, float* m, float* v,
                                    size_t begin, size_t end);
using RooflineTriadKernel = void (*)(float* a, const float* b, const float* c, float s,
                                     size_t begin, size_t end);

struct KernelSet {
  AdamKernel (*select)(DType grad, DType moments, DType out, bool l2) = nullptr;
  RooflineAdamKernel roofline_adam = nullptr;
  RooflineTriadKernel roofline_triad = nullptr;
};

KernelSet scalar_kernels();
KernelSet portable_kernels();
KernelSet avx2_kernels();    // empty KernelSet when not built for x86-64
KernelSet avx512_kernels();  // empty KernelSet when not built for x86-64

// Chunk boundaries are multiples of this many elements: a whole number of the widest
// kernel's iterations (32), and whole cache lines for 2-byte and 4-byte arrays alike, so
// threads working on neighbouring chunks never write the same line.
constexpr size_t kChunkAlignElems = 64;

// Builds the selector's switch over the dtype combinations for a kernel template
// `KERNEL<G, M, O, L2>` (a function template with the AdamKernel signature).
#define OFFLOAD_ADAM_SELECTOR(NAME, KERNEL)                                              \
  template <DType G, DType M, bool L2>                                                   \
  AdamKernel NAME##_out(DType out) {                                                     \
    switch (out) {                                                                       \
      case DType::kNone: return &KERNEL<G, M, DType::kNone, L2>;                         \
      case DType::kBF16: return &KERNEL<G, M, DType::kBF16, L2>;                         \
      case DType::kF16: return &KERNEL<G, M, DType::kF16, L2>;                           \
      default: return nullptr;                                                           \
    }                                                                                    \
  }                                                                                      \
  template <DType G, bool L2>                                                            \
  AdamKernel NAME##_moments(DType moments, DType out) {                                  \
    switch (moments) {                                                                   \
      case DType::kF32: return NAME##_out<G, DType::kF32, L2>(out);                      \
      case DType::kBF16: return NAME##_out<G, DType::kBF16, L2>(out);                    \
      default: return nullptr;                                                           \
    }                                                                                    \
  }                                                                                      \
  template <bool L2>                                                                     \
  AdamKernel NAME##_grad(DType grad, DType moments, DType out) {                         \
    switch (grad) {                                                                      \
      case DType::kF32: return NAME##_moments<DType::kF32, L2>(moments, out);            \
      case DType::kBF16: return NAME##_moments<DType::kBF16, L2>(moments, out);          \
      case DType::kF16: return NAME##_moments<DType::kF16, L2>(moments, out);            \
      default: return nullptr;                                                           \
    }                                                                                    \
  }                                                                                      \
  AdamKernel NAME(DType grad, DType moments, DType out, bool l2) {                       \
    return l2 ? NAME##_grad<true>(grad, moments, out)                                    \
              : NAME##_grad<false>(grad, moments, out);                                  \
  }

}  // namespace offload
