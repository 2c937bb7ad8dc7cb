// Run-time CPU-feature detection for kernel dispatch. One build runs on any x86-64:
// wider kernels are compiled in their own files and only called when the CPU (and the OS,
// for the wider register state) supports them.
#pragma once

namespace offload {

struct CpuFeatures {
  bool avx2 = false;     // AVX2 + FMA + F16C (the set the *_avx2.cpp kernels need)
  bool avx512 = false;   // AVX-512 F/BW/VL/DQ (the set the *_avx512.cpp kernels need)
  bool avx512_bf16 = false;
  bool neon = false;
};

// Detected once, on first call; thread-safe (function-local static).
const CpuFeatures& cpu_features();

}  // namespace offload
