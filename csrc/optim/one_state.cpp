// Dispatch for the one-state optimizers: checks the hyper-parameters, derives the kernel
// scalars, picks the kernel for the CPU and the dtypes, and runs it in chunks on the pool
// the Adam step uses (csrc/adam/parallel.h), with its default thread count.
#include "optim/one_state.h"

#include <cmath>
#include <sstream>
#include <string>

#include "adam/parallel.h"
#include "common/errors.h"
#include "optim/kernels.h"

namespace offload {
namespace {

const OneStateKernelSet& kernels_for(Isa isa) {
  static const OneStateKernelSet sets[4] = {scalar_one_state_kernels(),
                                            portable_one_state_kernels(),
                                            avx2_one_state_kernels(),
                                            avx512_one_state_kernels()};
  return sets[static_cast<int>(isa)];
}

// kAuto -> the best this CPU runs; a forced one must run here. isa_supported/best_isa are
// the Adam step's: every kernel file of an ISA is built under the same condition.
const OneStateKernelSet& resolve(Isa isa, const char* optimizer) {
  if (isa == Isa::kAuto) return kernels_for(best_isa());
  if (!isa_supported(isa) || kernels_for(isa).lion == nullptr) {
    throw ValueError(std::string("the '") + isa_name(isa) + "' " + optimizer +
                     " kernel cannot run on this CPU (or was not built for it); pass "
                     "isa=None to use the best supported one (here '" +
                     isa_name(best_isa()) + "')");
  }
  return kernels_for(isa);
}

[[noreturn]] void bad(const char* what, double value, const char* rule) {
  std::ostringstream msg;
  msg << what << "=" << value << " is invalid: " << rule;
  throw ValueError(msg.str());
}

void check_lr_and_scale(double lr, double weight_decay, double grad_scale) {
  if (!(lr >= 0.0) || !std::isfinite(lr)) bad("lr", lr, "must be finite and >= 0");
  if (!(weight_decay >= 0.0) || !std::isfinite(weight_decay)) {
    bad("weight_decay", weight_decay, "must be finite and >= 0");
  }
  if (!std::isfinite(grad_scale)) {
    bad("grad_scale", grad_scale, "must be finite (skip the step when the loss scale overflowed)");
  }
}

void check_buffers(const OneStateBuffers& b, const char* who) {
  if (b.master == nullptr || b.grad == nullptr || b.state == nullptr ||
      (b.out_dtype != DType::kNone && b.out == nullptr)) {
    throw ValueError(std::string(who) + ": a buffer address is null");
  }
}

[[noreturn]] void bad_dtypes(const OneStateBuffers& b, const char* who) {
  throw ValueError(std::string(who) + ": unsupported dtype combination (grad " +
                   std::to_string(static_cast<int>(b.grad_dtype)) + ", state " +
                   std::to_string(static_cast<int>(b.state_dtype)) + ", out " +
                   std::to_string(static_cast<int>(b.out_dtype)) + ")");
}

}  // namespace

LionScalars make_lion_scalars(double lr, double beta1, double beta2, double weight_decay,
                              double grad_scale) {
  check_lr_and_scale(lr, weight_decay, grad_scale);
  // Lion's betas may be 0 (c = g, or m = g) but not 1 (the gradient would be ignored).
  if (!(beta1 >= 0.0 && beta1 < 1.0)) bad("beta1", beta1, "must be in [0, 1)");
  if (!(beta2 >= 0.0 && beta2 < 1.0)) bad("beta2", beta2, "must be in [0, 1)");
  LionScalars s;
  s.grad_scale = static_cast<float>(grad_scale);
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.neg_lr = static_cast<float>(-lr);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  return s;
}

AdagradScalars make_adagrad_scalars(int64_t step, double lr, double lr_decay,
                                    double weight_decay, double eps, double grad_scale) {
  check_lr_and_scale(lr, weight_decay, grad_scale);
  if (step < 1) bad("step", static_cast<double>(step), "the step count after this update, >= 1");
  if (!(lr_decay >= 0.0) || !std::isfinite(lr_decay)) bad("lr_decay", lr_decay, "must be finite and >= 0");
  if (!(eps >= 0.0) || !std::isfinite(eps)) bad("eps", eps, "must be finite and >= 0");
  AdagradScalars s;
  s.grad_scale = static_cast<float>(grad_scale);
  s.l2 = static_cast<float>(weight_decay);
  // torch.optim.Adagrad: clr = lr / (1 + (step - 1) * lr_decay), in Python floats.
  s.neg_clr = static_cast<float>(-(lr / (1.0 + static_cast<double>(step - 1) * lr_decay)));
  s.eps = static_cast<float>(eps);
  return s;
}

void lion_step(const OneStateBuffers& b, const LionScalars& s, Isa isa, int threads) {
  if (b.n == 0) return;
  check_buffers(b, "lion_step");
  const LionKernel kernel = resolve(isa, "Lion").lion(b.grad_dtype, b.state_dtype, b.out_dtype, false);
  if (kernel == nullptr) bad_dtypes(b, "lion_step");
  parallel::parallel_chunks(b.n, parallel::threads_for_call(threads),
                            [&](size_t begin, size_t end) { kernel(b, s, begin, end); });
}

void adagrad_step(const OneStateBuffers& b, const AdagradScalars& s, Isa isa, int threads) {
  if (b.n == 0) return;
  check_buffers(b, "adagrad_step");
  const AdagradKernel kernel =
      resolve(isa, "Adagrad").adagrad(b.grad_dtype, b.state_dtype, b.out_dtype, s.l2 != 0.0f);
  if (kernel == nullptr) bad_dtypes(b, "adagrad_step");
  parallel::parallel_chunks(b.n, parallel::threads_for_call(threads),
                            [&](size_t begin, size_t end) { kernel(b, s, begin, end); });
}

void roofline_one_state(float* p, const float* g, float* s, size_t n, int threads) {
  const RooflineOneStateKernel k = kernels_for(best_isa()).roofline;
  parallel::parallel_chunks(n, parallel::threads_for_call(threads),
                            [&](size_t begin, size_t end) { k(p, g, s, begin, end); });
}

}  // namespace offload
