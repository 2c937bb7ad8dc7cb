// The per-ISA kernel tables of the 8-bit Adam step. Each kernel file exports one table whose
// selector returns the instantiation for a (grad dtype, output dtype, L2) combination, or an
// empty table when that file was compiled for another architecture. Dispatch (adam8bit.cpp)
// calls a table only after checking the CPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "adam8bit/adam8bit.h"
#include "adam8bit/code_map.h"

namespace offload {

// Updates blocks [block_begin, block_end) of b.
using Adam8bitKernel = void (*)(const Adam8bitBuffers& b, const AdamScalars& s,
                                size_t block_begin, size_t block_end);
// Quantises blocks [block_begin, block_end) of src (n elements in all).
using QuantizeKernel = void (*)(const float* src, uint8_t* codes, float* scales, size_t n,
                                const CodeMap& map, size_t block_begin, size_t block_end);
using RooflineAdam8bitKernel = void (*)(float* p, const float* g, uint8_t* cm, uint8_t* cv,
                                        size_t begin, size_t end);

struct Adam8bitKernelSet {
  Adam8bitKernel (*select)(DType grad, DType out, bool l2) = nullptr;
  QuantizeKernel quantize = nullptr;
  RooflineAdam8bitKernel roofline = nullptr;
};

Adam8bitKernelSet scalar_adam8bit_kernels();
Adam8bitKernelSet portable_adam8bit_kernels();
Adam8bitKernelSet avx2_adam8bit_kernels();    // empty when not built for x86-64
Adam8bitKernelSet avx512_adam8bit_kernels();  // empty when not built for x86-64
// The AVX-512 kernels with AVX512-VBMI byte permutes for dequantisation (empty likewise).
Adam8bitKernelSet avx512vbmi_adam8bit_kernels();

// Internal linkage: each kernel file instantiates its own (see [Note: one copy per ISA]).
namespace adam8bit_select {
namespace {

// `Impl::step<G, O, L2>` and `Impl::quantize` are a kernel file's instantiations; this
// builds its table. nullptr: a combination no kernel implements.
template <class Impl, DType G, bool L2>
Adam8bitKernel select_out(DType out) {
  switch (out) {
    case DType::kNone: return &Impl::template step<G, DType::kNone, L2>;
    case DType::kBF16: return &Impl::template step<G, DType::kBF16, L2>;
    case DType::kF16: return &Impl::template step<G, DType::kF16, L2>;
    default: return nullptr;
  }
}

template <class Impl, bool L2>
Adam8bitKernel select_grad(DType grad, DType out) {
  switch (grad) {
    case DType::kF32: return select_out<Impl, DType::kF32, L2>(out);
    case DType::kBF16: return select_out<Impl, DType::kBF16, L2>(out);
    case DType::kF16: return select_out<Impl, DType::kF16, L2>(out);
    default: return nullptr;
  }
}

template <class Impl>
Adam8bitKernel select(DType grad, DType out, bool l2) {
  return l2 ? select_grad<Impl, true>(grad, out) : select_grad<Impl, false>(grad, out);
}

template <class Impl>
Adam8bitKernelSet make_kernel_set(RooflineAdam8bitKernel roofline) {
  Adam8bitKernelSet k;
  k.select = &select<Impl>;
  k.quantize = &Impl::quantize;
  k.roofline = roofline;
  return k;
}

}  // namespace
}  // namespace adam8bit_select
}  // namespace offload
