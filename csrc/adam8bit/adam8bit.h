// Adam/AdamW with 8-bit moments over flat arrays: what the kernels compute, which kernel runs,
// on how many threads. The contract of the fp32 step (csrc/adam/adam.h): C++ sees raw
// pointers, element counts and dtype enums; Python owns the tensors and validates them
// (offload/optim/adam8bit.py). Kernels for the same instruction sets as Adam's (scalar
// reference, portable, AVX2, AVX-512), picked at run time, on Adam's pool and thread count.
//
// [Note: 8-bit moments] The moments are stored blockwise-quantised, as bitsandbytes' 8-bit
// blockwise optimizers and torchao's AdamW8bit define them (Dettmers et al. 2022, "8-bit
// Optimizers via Block-wise Quantization", arXiv:2110.02861):
//   - blocks of kAdam8bitBlock = 256 consecutive elements, counted from element 0 of the
//     flat array (the last block may be shorter);
//   - per block one fp32 scale: the block's absmax;
//   - per element one uint8 code, an index into a sorted 256-entry code map: the *dynamic*
//     (tree) map of bitsandbytes' create_dynamic_map, signed for exp_avg (0 at code 127, no
//     -1: its most negative value is -0.99297), unsigned for exp_avg_sq (0 at code 0);
//   - value = map[code] * scale (one fp32 multiply);
//   - code = the map entry nearest to x * (1 / scale) (both fp32, the reciprocal rounded
//     once per block), exactly: ties, which only an fp32 value lying exactly on a midpoint
//     can produce, go to the larger code. (torchao's binary search compares against
//     (hi - lo) * 0.5 rounded in fp32, so it can pick the farther code near a midpoint.)
//   - a block whose absmax is below 2^-126 (zeros, subnormals) is stored as scale 0 and the
//     zero code; a block holding inf or NaN is stored as scale NaN and the zero code, so it
//     dequantises to NaN throughout: a diverged moment stays visible, as in fp32 Adam.
// One step per block: dequantise m and v, the fp32 Adam update of adam_math.h ([Note:
// operation order], the same operations in the same order as adam_step's), which writes p
// (and the low-precision copy) from the *unquantised* new m and v, then re-quantise m and v
// with the block's new absmax. So quantisation error enters through the next step's
// moments only, and the first step from zeros equals adam_step's bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "adam/adam.h"  // DType, Isa, AdamScalars

namespace offload {

// Elements per quantisation block. 256 as torchao's AdamW8bit: small enough that one
// outlier (an embedding row's large gradient) coarsens only 255 neighbours, large enough
// that the scales cost 4 / 256 B per element and moment (0.03 B/param in all), and a
// multiple of every kernel's vector width and of the threads' 64-element chunk alignment.
constexpr size_t kAdam8bitBlock = 256;

// The buffers of one update. master, grad, the codes and out hold `n` elements; the scale
// arrays ceil(n / kAdam8bitBlock). Everything but grad is updated in place; `out` (if
// out_dtype != kNone) receives the updated master rounded to nearest even.
struct Adam8bitBuffers {
  float* master = nullptr;
  const void* grad = nullptr;
  uint8_t* exp_avg_codes = nullptr;     // signed map
  float* exp_avg_scales = nullptr;
  uint8_t* exp_avg_sq_codes = nullptr;  // unsigned map
  float* exp_avg_sq_scales = nullptr;
  void* out = nullptr;
  size_t n = 0;
  DType grad_dtype = DType::kF32;  // fp32, bf16 or fp16
  DType out_dtype = DType::kNone;  // none, bf16 or fp16
};

// One fused update of b.n elements with the scalars of make_adam_scalars (csrc/adam/adam.h:
// the same hyper-parameters, checks and bias correction as the fp32 step), on `threads`
// threads (0: the default of set_adam_num_threads) with the kernel for `isa` (kAuto: the
// best this CPU supports). Threads take whole blocks, so results depend on neither.
void adam8bit_step(const Adam8bitBuffers& b, const AdamScalars& s, Isa isa, int threads);

// [Note: 8-bit moments]'s quantisation of n fp32 values (codes: n bytes, scales:
// ceil(n / 256) floats), and its inverse. The step's own quantiser, exposed for tests and
// for converting an fp32 state.
void quantize_blockwise(const float* src, uint8_t* codes, float* scales, size_t n,
                        bool is_signed, Isa isa, int threads);
void dequantize_blockwise(const uint8_t* codes, const float* scales, float* dst, size_t n,
                          bool is_signed, int threads);

// The 256 values of a code map, ascending (the kernels' copy of csrc/adam8bit/code_maps.h).
const float* adam8bit_code_values(bool is_signed);

// Which build isa 'avx512' runs: "vbmi" (byte permutes, where the CPU has AVX512-VBMI),
// "gather", or "none" (no AVX-512 here). set_adam8bit_vbmi(false) makes it "gather" where it
// would be "vbmi", process-wide: how the tests reach both builds on one CPU.
const char* adam8bit_avx512_variant();
void set_adam8bit_vbmi(bool enabled);

// Memory-bandwidth reference for the benchmark: exactly the step's traffic without scales
// (read p, g, both code arrays; write p and the codes: 16 B per element with fp32 grads),
// one add per stream, threaded and chunked like the step and compiled for its ISA.
void roofline_adam8bit(float* p, const float* g, uint8_t* cm, uint8_t* cv, size_t n,
                       int threads);

}  // namespace offload
