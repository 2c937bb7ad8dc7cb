// Python binding of the 8-bit Adam step and its quantiser: addresses, element counts and
// dtype codes in, the GIL released around every call that touches the arrays. The tensors
// are validated in Python (offload/optim/adam8bit.py); the checks here only guard the values
// Python cannot get wrong without a bug.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "adam8bit/adam8bit.h"
#include "common/errors.h"
#include "common/register.h"

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

template <class T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

void register_adam8bit(py::module_& m) {
  m.def(
      "adam8bit_step",
      [](uintptr_t master, uintptr_t grad, uintptr_t exp_avg_codes, uintptr_t exp_avg_scales,
         uintptr_t exp_avg_sq_codes, uintptr_t exp_avg_sq_scales, uintptr_t out, size_t n,
         int grad_dtype, int out_dtype, int64_t step, double lr, double beta1, double beta2,
         double eps, double weight_decay, bool decoupled_weight_decay, double grad_scale,
         const std::string& isa, int threads) {
        Adam8bitBuffers b;
        b.master = ptr<float>(master);
        b.grad = ptr<const void>(grad);
        b.exp_avg_codes = ptr<uint8_t>(exp_avg_codes);
        b.exp_avg_scales = ptr<float>(exp_avg_scales);
        b.exp_avg_sq_codes = ptr<uint8_t>(exp_avg_sq_codes);
        b.exp_avg_sq_scales = ptr<float>(exp_avg_sq_scales);
        b.out = ptr<void>(out);
        b.n = n;
        b.grad_dtype = dtype_from_code(grad_dtype, "grad", false);
        b.out_dtype = dtype_from_code(out_dtype, "out_lowp", true);
        const AdamScalars s = make_adam_scalars(step, lr, beta1, beta2, eps, weight_decay,
                                                decoupled_weight_decay, grad_scale);
        adam8bit_step(b, s, isa_from_name(isa), threads);
      },
      py::arg("master"), py::arg("grad"), py::arg("exp_avg_codes"), py::arg("exp_avg_scales"),
      py::arg("exp_avg_sq_codes"), py::arg("exp_avg_sq_scales"), py::arg("out"), py::arg("n"),
      py::arg("grad_dtype"), py::arg("out_dtype"), py::arg("step"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("decoupled_weight_decay"), py::arg("grad_scale"), py::arg("isa") = "auto",
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Fused Adam/AdamW update with 8-bit blockwise moments of n elements at the given "
      "addresses (in place). dtype codes: 0 fp32, 1 bf16, 2 fp16, -1 none (out only).");

  m.def(
      "quantize_blockwise",
      [](uintptr_t src, uintptr_t codes, uintptr_t scales, size_t n, bool is_signed,
         const std::string& isa, int threads) {
        quantize_blockwise(ptr<const float>(src), ptr<uint8_t>(codes), ptr<float>(scales), n,
                           is_signed, isa_from_name(isa), threads);
      },
      py::arg("src"), py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("is_signed"),
      py::arg("isa") = "auto", py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Blockwise 8-bit quantisation of n fp32 values (the 8-bit Adam step's own).");
  m.def(
      "dequantize_blockwise",
      [](uintptr_t codes, uintptr_t scales, uintptr_t dst, size_t n, bool is_signed, int threads) {
        dequantize_blockwise(ptr<const uint8_t>(codes), ptr<const float>(scales), ptr<float>(dst),
                             n, is_signed, threads);
      },
      py::arg("codes"), py::arg("scales"), py::arg("dst"), py::arg("n"), py::arg("is_signed"),
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "map[code] * scale of n blockwise 8-bit codes.");
  m.def(
      "adam8bit_code_values",
      [](bool is_signed) {
        const float* v = adam8bit_code_values(is_signed);
        return std::vector<float>(v, v + 256);
      },
      py::arg("is_signed"), "The 256 values of the signed (exp_avg) or unsigned map, ascending.");
  m.def("adam8bit_avx512_variant", [] { return std::string(adam8bit_avx512_variant()); },
        "The build isa 'avx512' runs for 8-bit Adam: 'vbmi', 'gather' or 'none'.");
  m.def("set_adam8bit_vbmi", &set_adam8bit_vbmi, py::arg("enabled"),
        "Whether isa 'avx512' may use the AVX512-VBMI build (tests turn it off to reach the "
        "gather build).");
  m.def("adam8bit_block_size", [] { return kAdam8bitBlock; },
        "Elements per quantisation block of the 8-bit moments.");
  m.def(
      "roofline_adam8bit",
      [](uintptr_t p, uintptr_t g, uintptr_t cm, uintptr_t cv, size_t n, int threads) {
        roofline_adam8bit(ptr<float>(p), ptr<const float>(g), ptr<uint8_t>(cm), ptr<uint8_t>(cv),
                          n, threads);
      },
      py::arg("p"), py::arg("g"), py::arg("cm"), py::arg("cv"), py::arg("n"),
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Benchmark reference: p += g; cm += 1; cv += 1 (fp32 p, g; uint8 codes): the 8-bit step's traffic.");
}

}  // namespace offload
