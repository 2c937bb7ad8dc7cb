// The fused Adam/AdamW step over flat arrays: what the kernels compute, which kernel runs,
// and on how many threads. C++ sees raw pointers, element counts and dtype enums only
// (Python owns the tensors and validates them, offload/optim/functional.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace offload {

// Element types a buffer may hold. The numeric values are part of the binding's contract.
enum class DType : int {
  kNone = -1,  // "no buffer" (only for the low-precision output)
  kF32 = 0,
  kBF16 = 1,   // bfloat16: the upper 16 bits of an IEEE fp32
  kF16 = 2,    // IEEE binary16
};

// One kernel per instruction set. kAuto resolves to the widest the CPU supports.
enum class Isa : int { kAuto = -1, kScalar = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3 };

// The buffers of one update. All arrays hold `n` elements; master is updated in place,
// the moments too; `out` (if out_dtype != kNone) receives the updated master, rounded to
// nearest even.
struct AdamBuffers {
  float* master = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* out = nullptr;
  size_t n = 0;
  DType grad_dtype = DType::kF32;
  DType moment_dtype = DType::kF32;
  DType out_dtype = DType::kNone;
};

// The per-step scalars, computed once per call in double on the host (make_adam_scalars)
// and rounded to fp32 for the kernels, as torch does when a Python float meets a float
// tensor. Per element the kernel computes, in fp32 (see adam_math.h for the exact order):
//   g  = grad * grad_scale            (+ l2 * p for Adam's L2 weight decay)
//   p  = p * decay                    (AdamW's decoupled weight decay; decay = 1 - lr*wd)
//   m  = m + (1 - beta1) * (g - m)
//   v  = beta2 * v + (1 - beta2) * g * g
//   p  = p - step_size * m / (sqrt(v) * inv_bc2_sqrt + eps)
struct AdamScalars {
  float grad_scale = 1.0f;
  float l2 = 0.0f;          // weight_decay when decoupled_weight_decay is false, else 0
  float decay = 1.0f;       // 1 - lr * weight_decay when decoupled, else 1
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float neg_step_size = -1e-3f;  // -lr / (1 - beta1^step)
  float inv_bc2_sqrt = 1.0f;     // 1 / sqrt(1 - beta2^step)
  float eps = 1e-8f;
};

// Checks the hyper-parameters (throws ValueError) and derives the kernel scalars.
AdamScalars make_adam_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                              double weight_decay, bool decoupled_weight_decay,
                              double grad_scale);

// One fused update of b.n elements, on `threads` threads (0: the configured default) with
// the kernel for `isa` (kAuto: the best this CPU supports). Blocking; call without the GIL.
// Results do not depend on the thread count or on the ISA (every kernel performs the same
// fp32 operations in the same order, FMA where adam_math.h says so).
void adam_step(const AdamBuffers& b, const AdamScalars& s, Isa isa, int threads);

// The ISA kAuto resolves to on this CPU, and whether a given one can run here.
Isa best_isa();
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);
Isa isa_from_name(const std::string& name);  // throws ValueError on an unknown name

// Thread count used when a call passes 0. Defaults to the CPUs this process may run on
// (sched_getaffinity), read when first needed.
int adam_num_threads();
void set_adam_num_threads(int threads);  // throws ValueError unless >= 1

// Memory-bandwidth references for the benchmark, threaded and chunked exactly like
// adam_step and compiled for the same ISA:
//   roofline_adam: Adam's traffic (read p, g, m, v; write p, m, v), trivial arithmetic;
//   roofline_triad: STREAM triad a = b + s * c.
//   variant: which loop ([Note: a limit that is the limit] in adam.cpp), an index into
//   kRooflineVariantNames.
extern const char* const kRooflineVariantNames[];
int roofline_adam_variant_count();
void roofline_adam(float* p, const float* g, float* m, float* v, size_t n, int threads,
                   int variant = 0);
void roofline_triad(float* a, const float* b, const float* c, float s, size_t n, int threads);

}  // namespace offload
