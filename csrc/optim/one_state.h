// The one-state optimizers, Lion and Adagrad, as fused steps over flat arrays: what the
// kernels compute, which kernel runs, on how many threads. The same contract as the Adam
// step (csrc/adam/adam.h): C++ sees raw pointers, element counts and dtype enums; Python
// owns the tensors and validates them (offload/optim/cpu_lion.py, cpu_adagrad.py). Kernels
// exist for the same instruction sets as Adam's (scalar reference, portable, AVX2,
// AVX-512), are picked at run time, and share Adam's thread pool and default thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "adam/adam.h"  // DType, Isa

namespace offload {

// The buffers of one update. All arrays hold `n` elements; master and state are updated in
// place; `out` (if out_dtype != kNone) receives the updated master rounded to nearest even.
// The state is Lion's momentum (exp_avg) or Adagrad's sum of squared gradients (sum).
struct OneStateBuffers {
  float* master = nullptr;
  const void* grad = nullptr;
  void* state = nullptr;
  void* out = nullptr;
  size_t n = 0;
  DType grad_dtype = DType::kF32;   // fp32, bf16 or fp16
  DType state_dtype = DType::kF32;  // fp32 or bf16
  DType out_dtype = DType::kNone;   // none, bf16 or fp16
};

// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2;
// the lion-pytorch reference), per element in fp32 (one_state_math.h has the exact order):
//   g = grad * grad_scale
//   c = beta1 * m + (1 - beta1) * g
//   p = p * (1 - lr * weight_decay) - lr * sign(c)        sign(0) = sign(NaN) = 0, as torch
//   m = beta2 * m + (1 - beta2) * g
struct LionScalars {
  float grad_scale = 1.0f;
  float decay = 1.0f;  // 1 - lr * weight_decay
  float neg_lr = -1e-4f;
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.99f;
  float one_minus_beta2 = 0.01f;
};

// Adagrad as torch.optim.Adagrad computes it, per element in fp32:
//   g   = grad * grad_scale (+ weight_decay * p: L2, added to the gradient)
//   sum = sum + g * g
//   p   = p - clr * g / (sqrt(sum) + eps),   clr = lr / (1 + (step - 1) * lr_decay)
// (initial_accumulator_value only fills the state when it is created, in Python.)
struct AdagradScalars {
  float grad_scale = 1.0f;
  float l2 = 0.0f;  // weight_decay
  float neg_clr = -1e-2f;
  float eps = 1e-10f;
};

// Check the hyper-parameters (throw ValueError naming the bad one) and derive the kernel
// scalars: in double on the host, as torch computes them in Python floats, then rounded
// once to fp32 (as torch rounds a Python scalar meeting an fp32 tensor).
LionScalars make_lion_scalars(double lr, double beta1, double beta2, double weight_decay,
                              double grad_scale);
AdagradScalars make_adagrad_scalars(int64_t step, double lr, double lr_decay,
                                    double weight_decay, double eps, double grad_scale);

// One fused update of b.n elements, on `threads` threads (0: the default of
// set_adam_num_threads) with the kernel for `isa` (kAuto: the best this CPU supports).
// Blocking; call without the GIL. Results do not depend on the thread count or the ISA.
void lion_step(const OneStateBuffers& b, const LionScalars& s, Isa isa, int threads);
void adagrad_step(const OneStateBuffers& b, const AdagradScalars& s, Isa isa, int threads);

// Memory-bandwidth reference for the benchmark: exactly a one-state optimizer's fp32
// traffic (read p, g, s; write p, s: 20 B per element) with one add per stream, threaded
// and chunked like the steps and compiled for the ISA they pick.
void roofline_one_state(float* p, const float* g, float* s, size_t n, int threads);

}  // namespace offload
