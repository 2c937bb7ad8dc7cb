// The per-ISA kernel tables. Each kernel file exports one selector that returns the
// instantiation for a (grad dtype, moment dtype, output dtype, L2) combination, or
// nullptr when that file was compiled for another architecture. Dispatch (adam.cpp)
// calls a selector only after checking the CPU (csrc/common/cpu_features.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "adam/adam.h"

namespace offload {

// Updates elements [begin, end) of b.
using AdamKernel = void (*)(const AdamBuffers& b, const AdamScalars& s, size_t begin,
                            size_t end);
using RooflineAdamKernel = void (*)(float* p, const float* g, float* m, float* v,
                                    size_t begin, size_t end);
using RooflineTriadKernel = void (*)(float* a, const float* b, const float* c, float s,
                                     size_t begin, size_t end);

// The roofline's variants ([Note: a limit that is the limit] in adam.cpp), in the order
// of kRooflineVariantNames (adam.h): the plain loop, then software prefetch 256, 512,
// 1024 and 2048 elements ahead.
constexpr int kRooflineVariants = 5;

struct KernelSet {
  AdamKernel (*select)(DType grad, DType moments, DType out, bool l2) = nullptr;
  RooflineAdamKernel roofline_adam[kRooflineVariants] = {};
  RooflineTriadKernel roofline_triad = nullptr;
};

// The variants' table for a kernel file: its own compilation of roofline_impl's loops.
#define OFFLOAD_ROOFLINE_VARIANTS(k)                                  \
  do {                                                                \
    (k).roofline_adam[0] = &roofline_impl::adam_traffic;             \
    (k).roofline_adam[1] = &roofline_impl::adam_traffic_ahead<256>;  \
    (k).roofline_adam[2] = &roofline_impl::adam_traffic_ahead<512>;  \
    (k).roofline_adam[3] = &roofline_impl::adam_traffic_ahead<1024>; \
    (k).roofline_adam[4] = &roofline_impl::adam_traffic_ahead<2048>; \
  } while (0)

KernelSet scalar_kernels();
KernelSet portable_kernels();
KernelSet avx2_kernels();    // empty KernelSet when not built for x86-64
KernelSet avx512_kernels();  // empty KernelSet when not built for x86-64

// Chunk boundaries are multiples of this many elements: a whole number of the widest
// kernel's iterations (32), and whole cache lines for 2-byte and 4-byte arrays alike, so
// threads working on neighbouring chunks never write the same line.
constexpr size_t kChunkAlignElems = 64;

// [Note: large steps] A step over at least kLargeStepElems elements (4M: 80-112 MB of
// traffic, far more than any last-level cache) streams from memory, and the SIMD kernels
// then take their memory-bound shape: software prefetch ahead of every stream they read
// ([Note: prefetch distance]) and the streamed copy-out below. Smaller steps run the plain
// loop: in cache, prefetches only cost issue slots and a streamed copy-out would push out
// lines the caller reads next.
constexpr size_t kLargeStepElems = size_t{1} << 22;

inline bool large_step(const AdamBuffers& b) { return b.n >= kLargeStepElems; }

// [Note: prefetch distance] From memory, the kernels read four streams whose lines the
// hardware prefetchers fetch only so far ahead, and the sqrt/div chain leaves the core
// fewer loads in flight than a plain copy loop has: on their own the SIMD kernels fell
// short of the roofline on the Zen 5 here, most with bf16 moments (AVX-512, 2 threads:
// fp32 0.97-1.00, bf16 grads + bf16 out 0.92-0.97, bf16 moments 0.85-0.89, bf16
// everything 0.77-0.81). A software prefetch a fixed distance ahead in every stream read
// closes most of the gap (docs/adam.md, "AVX-512 against the roofline", has the numbers
// and the scan). The distance is in elements: 512 with fp32 moments, 2048 with bf16
// moments (their 2-byte streams want it longer). Too short or too long is worse than
// none: AVX2 fp32, one thread, 128 elements 0.89 of the roofline and 1024 0.91, against
// 0.99 without and 1.03 at 512. G and O are parameters so that a mix can get its own.
template <DType G, DType M, DType O>
constexpr size_t kAheadFor = M == DType::kBF16 ? 2048 : 512;

template <DType D>
constexpr size_t kDTypeBytes = D == DType::kF32 ? 4 : 2;

// Prefetches (for reading, into every level) the lines of kElems elements of one stream
// from element i on; at least one line. The address is an integer sum: near the end it
// points past the array, which a prefetch tolerates (it never faults) and pointer
// arithmetic would not.
template <DType D, size_t kElems>
inline void prefetch_block(const void* base, size_t i) {
  constexpr size_t kLines = kElems * kDTypeBytes<D> < 64 ? 1 : kElems * kDTypeBytes<D> / 64;
  const uintptr_t at = reinterpret_cast<uintptr_t>(base) + i * kDTypeBytes<D>;
  for (size_t l = 0; l < kLines; ++l) {
    __builtin_prefetch(reinterpret_cast<const void*>(at + 64 * l), 0, 3);
  }
}

// [Note: streamed copy-out] The 16-bit copy of the parameters (out_lowp) is the one
// array a step writes without reading it, so an ordinary store first reads each of its
// lines from memory (read-for-ownership): 2 B/param of traffic nobody asked for. In large
// steps the SIMD kernels write it with non-temporal stores instead, when the chunk's first
// element is aligned to the stores' width (torch's allocations are; a view may not be, and
// then the step stores as usual). p, m and v are read before they are written, so their
// lines are in cache when stored: streaming them measured slower (fp32: 0.93 of the
// roofline against 0.99). Streaming changes where bytes go, never their values.
inline bool copy_out_aligned(const AdamBuffers& b, size_t begin, size_t align_bytes) {
  const auto addr = reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(b.out) + begin);
  return addr % align_bytes == 0;
}

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
