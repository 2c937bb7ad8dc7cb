// Python binding of the one-state optimizers (Lion, Adagrad): addresses, element counts and
// dtype codes in, the GIL released around every call that touches the arrays. The tensors
// are validated in Python (offload/optim/cpu_lion.py, cpu_adagrad.py); the checks here only
// guard the values Python cannot get wrong without a bug.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "common/errors.h"
#include "common/register.h"
#include "optim/one_state.h"

namespace py = pybind11;

namespace offload {
namespace {

// The codes of csrc/adam/adam.h's DType, as the Adam binding reads them.
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

OneStateBuffers buffers(uintptr_t master, uintptr_t grad, uintptr_t state, uintptr_t out,
                        size_t n, int grad_dtype, int state_dtype, int out_dtype) {
  OneStateBuffers b;
  b.master = reinterpret_cast<float*>(master);
  b.grad = reinterpret_cast<const void*>(grad);
  b.state = reinterpret_cast<void*>(state);
  b.out = reinterpret_cast<void*>(out);
  b.n = n;
  b.grad_dtype = dtype_from_code(grad_dtype, "grad", false);
  b.state_dtype = dtype_from_code(state_dtype, "state", false);
  b.out_dtype = dtype_from_code(out_dtype, "out_lowp", true);
  return b;
}

}  // namespace

void register_one_state(py::module_& m) {
  m.def(
      "lion_step",
      [](uintptr_t master, uintptr_t grad, uintptr_t exp_avg, uintptr_t out, size_t n,
         int grad_dtype, int state_dtype, int out_dtype, double lr, double beta1, double beta2,
         double weight_decay, double grad_scale, const std::string& isa, int threads) {
        const OneStateBuffers b =
            buffers(master, grad, exp_avg, out, n, grad_dtype, state_dtype, out_dtype);
        lion_step(b, make_lion_scalars(lr, beta1, beta2, weight_decay, grad_scale),
                  isa_from_name(isa), threads);
      },
      py::arg("master"), py::arg("grad"), py::arg("exp_avg"), py::arg("out"), py::arg("n"),
      py::arg("grad_dtype"), py::arg("state_dtype"), py::arg("out_dtype"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("grad_scale"),
      py::arg("isa") = "auto", py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Fused Lion update of n elements at the given addresses (in place). dtype codes: "
      "0 fp32, 1 bf16, 2 fp16, -1 none (out only). threads=0: the configured default.");

  m.def(
      "adagrad_step",
      [](uintptr_t master, uintptr_t grad, uintptr_t state_sum, uintptr_t out, size_t n,
         int grad_dtype, int state_dtype, int out_dtype, int64_t step, double lr,
         double lr_decay, double weight_decay, double eps, double grad_scale,
         const std::string& isa, int threads) {
        const OneStateBuffers b =
            buffers(master, grad, state_sum, out, n, grad_dtype, state_dtype, out_dtype);
        adagrad_step(b, make_adagrad_scalars(step, lr, lr_decay, weight_decay, eps, grad_scale),
                     isa_from_name(isa), threads);
      },
      py::arg("master"), py::arg("grad"), py::arg("state_sum"), py::arg("out"), py::arg("n"),
      py::arg("grad_dtype"), py::arg("state_dtype"), py::arg("out_dtype"), py::arg("step"),
      py::arg("lr"), py::arg("lr_decay"), py::arg("weight_decay"), py::arg("eps"),
      py::arg("grad_scale"), py::arg("isa") = "auto", py::arg("threads") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "Fused Adagrad update (torch.optim.Adagrad's) of n elements at the given addresses "
      "(in place). dtype codes as lion_step's. threads=0: the configured default.");

  m.def(
      "roofline_one_state",
      [](uintptr_t p, uintptr_t g, uintptr_t s, size_t n, int threads) {
        roofline_one_state(reinterpret_cast<float*>(p), reinterpret_cast<const float*>(g),
                           reinterpret_cast<float*>(s), n, threads);
      },
      py::arg("p"), py::arg("g"), py::arg("s"), py::arg("n"), py::arg("threads") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "Benchmark reference: p += g; s += g over n fp32 elements (Lion's and Adagrad's traffic).");
}

}  // namespace offload
