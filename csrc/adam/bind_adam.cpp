// Python binding of the Adam core: addresses, element counts and dtype codes in; the GIL
// is released around every call that touches the arrays. Validation of the tensors
// themselves happens in Python (offload/optim/functional.py); the checks here only guard
// the values Python cannot get wrong without a bug.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "adam/adam.h"
#include "common/errors.h"
#include "common/register.h"

namespace py = pybind11;

namespace offload {
namespace {

DType dtype_from_code(int code, const char* what, bool allow_none) {
  switch (code) {
    case -1:
      if (allow_none) return DType::kNone;
      break;
    case 0: return DType::kF32;
    case 1: return DType::kBF16;
    case 2: return DType::kF16;
    default: break;
  }
  throw ValueError(std::string("invalid dtype code ") + std::to_string(code) + " for " + what);
}

template <class T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

void register_adam(py::module_& m) {
  m.def(
      "adam_step",
      [](uintptr_t master, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
         uintptr_t out, size_t n, int grad_dtype, int moment_dtype, int out_dtype,
         int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
         bool decoupled_weight_decay, double grad_scale, const std::string& isa,
         int threads) {
        AdamBuffers b;
        b.master = ptr<float>(master);
        b.grad = ptr<const void>(grad);
        b.exp_avg = ptr<void>(exp_avg);
        b.exp_avg_sq = ptr<void>(exp_avg_sq);
        b.out = ptr<void>(out);
        b.n = n;
        b.grad_dtype = dtype_from_code(grad_dtype, "grad", false);
        b.moment_dtype = dtype_from_code(moment_dtype, "moments", false);
        b.out_dtype = dtype_from_code(out_dtype, "out_lowp", true);
        const AdamScalars s = make_adam_scalars(step, lr, beta1, beta2, eps, weight_decay,
                                                decoupled_weight_decay, grad_scale);
        adam_step(b, s, isa_from_name(isa), threads);
      },
      py::arg("master"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("out"), py::arg("n"), py::arg("grad_dtype"), py::arg("moment_dtype"),
      py::arg("out_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("decoupled_weight_decay"), py::arg("grad_scale"), py::arg("isa") = "auto",
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Fused Adam/AdamW update of n elements at the given addresses (in place). dtype codes: "
      "0 fp32, 1 bf16, 2 fp16, -1 none (out only). threads=0: the configured default.");

  m.def("adam_isa", [] { return std::string(isa_name(best_isa())); },
        "The Adam kernel 'auto' picks on this CPU.");
  m.def(
      "adam_supported_isas",
      [] {
        std::vector<std::string> names;
        for (Isa isa : {Isa::kScalar, Isa::kPortable, Isa::kAvx2, Isa::kAvx512}) {
          if (isa_supported(isa)) names.emplace_back(isa_name(isa));
        }
        return names;
      },
      "The Adam kernels that can run on this CPU.");
  m.def("adam_num_threads", &adam_num_threads,
        "Threads an Adam step uses by default (initially the CPUs this process may use).");
  m.def("set_adam_num_threads", &set_adam_num_threads, py::arg("threads"),
        "Sets the default thread count of the Adam step (>= 1).");

  m.def(
      "roofline_adam",
      [](uintptr_t p, uintptr_t g, uintptr_t mo, uintptr_t v, size_t n, int threads,
         int variant) {
        roofline_adam(ptr<float>(p), ptr<const float>(g), ptr<float>(mo), ptr<float>(v), n,
                      threads, variant);
      },
      py::arg("p"), py::arg("g"), py::arg("m"), py::arg("v"), py::arg("n"),
      py::arg("threads") = 0, py::arg("variant") = 0, py::call_guard<py::gil_scoped_release>(),
      "Benchmark reference: p += g; m += g; v += g over n fp32 elements (Adam's traffic), "
      "by loop `variant` (roofline_adam_variants()).");
  m.def(
      "roofline_adam_variants",
      [] {
        std::vector<std::string> names;
        for (int i = 0; i < roofline_adam_variant_count(); ++i) names.push_back(kRooflineVariantNames[i]);
        return names;
      },
      "The roofline loops' names, by variant index: the plain loop, then software prefetch "
      "at four distances (elements ahead).");
  m.def(
      "roofline_triad",
      [](uintptr_t a, uintptr_t b, uintptr_t c, float s, size_t n, int threads) {
        roofline_triad(ptr<float>(a), ptr<const float>(b), ptr<const float>(c), s, n, threads);
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("s"), py::arg("n"),
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Benchmark reference: STREAM triad a = b + s * c over n fp32 elements.");
}

}  // namespace offload
