// Dispatch and threading for the fused Adam step: picks the kernel for the CPU and the
// dtypes, splits the arrays into chunks and runs them on the persistent pool.
#include "adam/adam.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <sstream>

#include "adam/kernels.h"
#include "adam/parallel.h"
#include "common/cpu_features.h"
#include "common/errors.h"

namespace offload {
namespace {

std::atomic<int> g_num_threads{0};  // 0: not chosen yet -> the affinity count

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

const KernelSet& kernels_for(Isa isa) {
  static const KernelSet sets[4] = {scalar_kernels(), portable_kernels(), avx2_kernels(),
                                    avx512_kernels()};
  return sets[static_cast<int>(isa)];
}

Isa resolve(Isa isa) {
  if (isa == Isa::kAuto) return best_isa();
  if (!isa_supported(isa)) {
    throw ValueError(std::string("the '") + isa_name(isa) +
                     "' Adam kernel cannot run on this CPU (or was not built for it); "
                     "pass isa=None to use the best supported one (here '" +
                     isa_name(best_isa()) + "')");
  }
  return isa;
}

using parallel::parallel_chunks;
using parallel::threads_for_call;

}  // namespace

AdamScalars make_adam_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                              double weight_decay, bool decoupled_weight_decay,
                              double grad_scale) {
  auto bad = [](const char* what, double value, const char* rule) {
    std::ostringstream msg;
    msg << what << "=" << value << " is invalid: " << rule;
    throw ValueError(msg.str());
  };
  if (step < 1) bad("step", static_cast<double>(step), "the step count after this update, >= 1");
  if (!(lr >= 0.0) || !std::isfinite(lr)) bad("lr", lr, "must be finite and >= 0");
  if (!(beta1 >= 0.0 && beta1 < 1.0)) bad("beta1", beta1, "must be in [0, 1)");
  if (!(beta2 >= 0.0 && beta2 < 1.0)) bad("beta2", beta2, "must be in [0, 1)");
  if (!(eps >= 0.0) || !std::isfinite(eps)) bad("eps", eps, "must be finite and >= 0");
  if (!(weight_decay >= 0.0) || !std::isfinite(weight_decay)) {
    bad("weight_decay", weight_decay, "must be finite and >= 0");
  }
  if (!std::isfinite(grad_scale)) {
    bad("grad_scale", grad_scale, "must be finite (skip the step when the loss scale overflowed)");
  }
  // Host-side scalars in double, as torch computes them in Python floats, then rounded
  // once to fp32 (torch rounds a Python scalar to the tensor's dtype the same way).
  const double s = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(beta1, s);
  const double bias_correction2 = 1.0 - std::pow(beta2, s);
  AdamScalars out;
  out.grad_scale = static_cast<float>(grad_scale);
  out.l2 = decoupled_weight_decay ? 0.0f : static_cast<float>(weight_decay);
  out.decay = decoupled_weight_decay && weight_decay != 0.0
                  ? static_cast<float>(1.0 - lr * weight_decay)
                  : 1.0f;
  out.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  out.beta2 = static_cast<float>(beta2);
  out.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  out.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  out.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  out.eps = static_cast<float>(eps);
  return out;
}

bool isa_supported(Isa isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::kScalar:
    case Isa::kPortable:
      return true;
    case Isa::kAvx2:
      return f.avx2 && kernels_for(isa).select != nullptr;
    case Isa::kAvx512:
      return f.avx512 && kernels_for(isa).select != nullptr;
    default:
      return false;
  }
}

Isa best_isa() {
  // AVX-512 first: on the CPUs that have it, it loads and stores a cache line per
  // instruction, and the step is memory-bound either way.
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kPortable;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kScalar: return "scalar";
    case Isa::kPortable: return "portable";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

Isa isa_from_name(const std::string& name) {
  for (Isa isa : {Isa::kAuto, Isa::kScalar, Isa::kPortable, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(isa)) return isa;
  }
  throw ValueError("unknown Adam kernel '" + name +
                   "'; choose one of 'auto', 'scalar', 'portable', 'avx2', 'avx512'");
}

int adam_num_threads() {
  int t = g_num_threads.load(std::memory_order_relaxed);
  if (t == 0) {
    t = affinity_cpus();
    int expected = 0;
    g_num_threads.compare_exchange_strong(expected, t);
    t = g_num_threads.load(std::memory_order_relaxed);
  }
  return t;
}

void set_adam_num_threads(int threads) {
  if (threads < 1) {
    throw ValueError("the Adam thread count must be >= 1, got " + std::to_string(threads));
  }
  g_num_threads.store(threads, std::memory_order_relaxed);
}

void adam_step(const AdamBuffers& b, const AdamScalars& s, Isa isa, int threads) {
  if (b.n == 0) return;
  if (b.master == nullptr || b.grad == nullptr || b.exp_avg == nullptr ||
      b.exp_avg_sq == nullptr || (b.out_dtype != DType::kNone && b.out == nullptr)) {
    throw ValueError("adam_step: a buffer address is null");
  }
  const KernelSet& set = kernels_for(resolve(isa));
  const AdamKernel kernel = set.select(b.grad_dtype, b.moment_dtype, b.out_dtype, s.l2 != 0.0f);
  if (kernel == nullptr) {
    throw ValueError("adam_step: unsupported dtype combination (grad " +
                     std::to_string(static_cast<int>(b.grad_dtype)) + ", moments " +
                     std::to_string(static_cast<int>(b.moment_dtype)) + ", out " +
                     std::to_string(static_cast<int>(b.out_dtype)) + ")");
  }
  parallel_chunks(b.n, threads_for_call(threads),
                  [&](size_t begin, size_t end) { kernel(b, s, begin, end); });
}

// [Note: a limit that is the limit] The benchmark judges the Adam kernels against "the
// roofline": how fast anything can move Adam's bytes (read p, g, m, v; write p, m, v) on
// this machine. One plain loop under-measured it (torch's fused AdamW ran at 1.40 of it in
// the same run, issue #35), so it is the best of several loops moving the same bytes: the
// plain one and software prefetch at four distances, each timed interleaved with the
// contenders (benchmarks/bench_adam.py), on buffers with transparent huge pages, and never
// below any contender's bytes per second in that run. Non-temporal stores are not among
// them: every array Adam writes it has just read, so a streaming store saves no
// read-for-ownership and only evicts the line.
const char* const kRooflineVariantNames[] = {"plain", "prefetch 256", "prefetch 512",
                                             "prefetch 1024", "prefetch 2048"};

int roofline_adam_variant_count() { return kRooflineVariants; }

void roofline_adam(float* p, const float* g, float* m, float* v, size_t n, int threads,
                   int variant) {
  if (variant < 0 || variant >= kRooflineVariants) {
    throw ValueError("roofline_adam: variant " + std::to_string(variant) + " is not in 0.." +
                     std::to_string(kRooflineVariants - 1));
  }
  const RooflineAdamKernel k = kernels_for(best_isa()).roofline_adam[variant];
  parallel_chunks(n, threads_for_call(threads),
                  [&](size_t begin, size_t end) { k(p, g, m, v, begin, end); });
}

void roofline_triad(float* a, const float* b, const float* c, float s, size_t n, int threads) {
  const RooflineTriadKernel k = kernels_for(best_isa()).roofline_triad;
  parallel_chunks(n, threads_for_call(threads),
                  [&](size_t begin, size_t end) { k(a, b, c, s, begin, end); });
}

}  // namespace offload
