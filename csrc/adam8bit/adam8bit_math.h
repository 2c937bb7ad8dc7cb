// The 8-bit Adam step and the blockwise quantiser, written once over a "lanes" type (one
// float, 8 AVX2 lanes or 16 AVX-512 lanes), as csrc/optim/one_state_math.h does: every
// kernel file (adam8bit_kernel_*.cpp) instantiates these templates with its own lanes, so
// the kernels perform the same operations in the same order by construction.
//
// Per block ([Note: 8-bit moments] in adam8bit.h):
//   pass 0: map_m[code] and map_v[code] into two block buffers (L::dequant_block: a gather
//     per vector, or byte permutes where the CPU has AVX512-VBMI);
//   pass 1, per element: m = buffer_m * scale_m, v = buffer_v * scale_v, then the
//     fp32 update of [Note: operation order] (csrc/adam/adam_math.h) exactly: the same
//     multiplies, FMAs, sqrt and divide in the same order, so p equals what adam_step
//     computes from the same dequantised moments (tests/test_adam8bit.py holds the two
//     together bit for bit); p and the copy-out are stored, the new m and v go back to the
//     block buffers, and the bit patterns of |m| and |v| are max-reduced. An integer max of
//     non-negative float bit patterns is the float max with NaN and inf on top, and it is
//     associative, so the reduction order (lanes, tail) cannot change the result.
//   pass 2: the scales and codes from the buffer ([Note: nearest code], code_map.h).
// Threads take whole blocks (adam8bit.cpp), so a block is always one kernel call's.
// The kernel files are built with -ffp-contract=off (CMakeLists.txt), as csrc/optim's.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "adam/adam_math.h"
#include "adam8bit/adam8bit.h"
#include "adam8bit/code_map.h"

namespace offload {
// Internal linkage: see [Note: one copy per ISA] in csrc/adam/adam_math.h.
namespace adam8bit_math {
namespace {

// One element as a lane group: the scalar reference (kLookup false: the threshold search
// itself), the portable kernel (Conv = BranchFreeConv, kLookup true) and every SIMD tail.
template <class Conv = adam_math::ScalarConv, bool kLookup = false>
struct ScalarLanes {
  using V = float;
  using I = uint32_t;  // an accumulator of bit patterns
  static constexpr size_t kWidth = 1;
  static V set1(float x) { return x; }
  template <DType D>
  static V load(const void* base, size_t i) {
    return Conv::template load<D>(base, i);
  }
  template <DType D>
  static void store(void* base, size_t i, V v) {
    Conv::template store<D>(base, i, v);
  }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return std::sqrt(a); }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static void dequant_block(const CodeMap& map, const uint8_t* codes, size_t len, float* buf) {
    for (size_t j = 0; j < len; ++j) buf[j] = map.values[codes[j]];
  }
  static I zero_bits() { return 0; }
  static I max_abs_bits(I acc, V x) {
    const uint32_t b = adam_math::bits_of(x) & 0x7FFFFFFFu;
    return b > acc ? b : acc;
  }
  static uint32_t reduce_max(I acc) { return acc; }
  template <bool kSigned = false>  // map.is_signed, unused: the search reads the map
  static void quantize(const CodeMap& map, uint8_t* codes, size_t i, V y) {
    codes[i] = static_cast<uint8_t>(kLookup ? code_lookup(map, y) : code_search(map, y));
  }
};

// Pass 0 for lanes that look codes up one vector at a time (L::dequant, a gather).
template <class L>
inline void dequant_vectors(const CodeMap& map, const uint8_t* codes, size_t len, float* buf) {
  size_t j = 0;
  for (; j + L::kWidth <= len; j += L::kWidth) {
    L::template store<DType::kF32>(buf, j, L::dequant(map.values, codes, j));
  }
  for (; j < len; ++j) buf[j] = map.values[codes[j]];
}

// The update's scalars as lanes (AdamScalars, adam.h).
template <class L>
struct Consts {
  typename L::V grad_scale, l2, decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size,
      inv_bc2_sqrt, eps;
  explicit Consts(const AdamScalars& s)
      : grad_scale(L::set1(s.grad_scale)),
        l2(L::set1(s.l2)),
        decay(L::set1(s.decay)),
        one_minus_beta1(L::set1(s.one_minus_beta1)),
        beta2(L::set1(s.beta2)),
        one_minus_beta2(L::set1(s.one_minus_beta2)),
        neg_step_size(L::set1(s.neg_step_size)),
        inv_bc2_sqrt(L::set1(s.inv_bc2_sqrt)),
        eps(L::set1(s.eps)) {}
};

// The arrays in locals (read through a struct they would be reloaded after every store).
struct Arrays {
  float* p;
  const void* g;
  void* out;
};

// Pass 1 on elements [i, i + L::kWidth) of the array, [j, ...) of the block buffers.
template <class L, DType G, DType O, bool kL2>
inline void update_lanes(const Arrays& a, const Consts<L>& k, typename L::V scale_m,
                         typename L::V scale_v, size_t i, float* mbuf, float* vbuf, size_t j,
                         typename L::I& max_m, typename L::I& max_v) {
  using V = typename L::V;
  V g = L::mul(L::template load<G>(a.g, i), k.grad_scale);
  V p = L::template load<DType::kF32>(a.p, i);
  if constexpr (kL2) g = L::fma(p, k.l2, g);
  p = L::mul(p, k.decay);
  V m = L::mul(L::template load<DType::kF32>(mbuf, j), scale_m);
  V v = L::mul(L::template load<DType::kF32>(vbuf, j), scale_v);
  m = L::fma(k.one_minus_beta1, L::sub(g, m), m);
  v = L::fma(L::mul(k.one_minus_beta2, g), g, L::mul(v, k.beta2));
  const V d = L::fma(L::sqrt(v), k.inv_bc2_sqrt, k.eps);
  p = L::fma(k.neg_step_size, L::div(m, d), p);
  L::template store<DType::kF32>(a.p, i, p);
  if constexpr (O != DType::kNone) L::template store<O>(a.out, i, p);
  L::template store<DType::kF32>(mbuf, j, m);
  L::template store<DType::kF32>(vbuf, j, v);
  max_m = L::max_abs_bits(max_m, m);
  max_v = L::max_abs_bits(max_v, v);
}

// A block's absmax (as bits) that gives it a scale: finite and normal. A zero, subnormal or
// non-finite block stores the zero code ([Note: 8-bit moments] in adam8bit.h).
inline bool ordinary_absmax(uint32_t max_abs_bits) {
  return max_abs_bits < 0x7F800000u && max_abs_bits >= 0x00800000u;
}

// Pass 2: the codes of buf[0, len) and the block's scale (returned), [Note: 8-bit moments].
template <class L>
inline float quantize_block(const CodeMap& map, const float* buf, uint8_t* codes, size_t len,
                            uint32_t max_abs_bits) {
  constexpr size_t W = L::kWidth;
  if (!ordinary_absmax(max_abs_bits)) {
    std::memset(codes, map.zero_code, len);
    return max_abs_bits >= 0x7F800000u ? adam_math::float_of(0x7FC00000u) : 0.0f;
  }
  const float scale = adam_math::float_of(max_abs_bits);
  const float inv = 1.0f / scale;
  const typename L::V inv_v = L::set1(inv);
  size_t j = 0;
  // The map's signedness as a template argument, so that no lanes type tests it per vector.
  const auto run = [&](auto is_signed) {
    for (; j + W <= len; j += W) {
      L::template quantize<decltype(is_signed)::value>(
          map, codes, j, L::mul(L::template load<DType::kF32>(buf, j), inv_v));
    }
  };
  if (map.is_signed) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
  for (; j < len; ++j) ScalarLanes<>::quantize(map, codes, j, buf[j] * inv);
  return scale;
}

// Whether lanes L store both moments' codes at once (they declare kQuantizePair and define
// L::quantize_pair(mm, mcodes, ym, vm, vcodes, yv, i): the codes of quantize<true> and
// quantize<false>).
template <class L, class = void>
struct HasQuantizePair : std::false_type {};
template <class L>
struct HasQuantizePair<L, std::void_t<decltype(L::kQuantizePair)>> : std::true_type {};

// Pass 2 for both moments of a block: exactly quantize_block(mm, ...) and then
// quantize_block(vm, ...), with the two maps' vectors interleaved in one loop (two
// independent chains per iteration: the AVX512-VBMI step 1.10x faster in cache, unchanged
// from memory; docs/adam.md). `mm` is the signed map, `vm` the
// unsigned one; a block whose moments are not both ordinary (zero or non-finite) takes
// quantize_block for each.
template <class L>
inline void quantize_pair(const CodeMap& mm, const float* mbuf, uint8_t* mcodes, uint32_t mbits,
                          float* m_scale, const CodeMap& vm, const float* vbuf, uint8_t* vcodes,
                          uint32_t vbits, float* v_scale, size_t len) {
  if (!ordinary_absmax(mbits) || !ordinary_absmax(vbits) || !mm.is_signed || vm.is_signed) {
    *m_scale = quantize_block<L>(mm, mbuf, mcodes, len, mbits);
    *v_scale = quantize_block<L>(vm, vbuf, vcodes, len, vbits);
    return;
  }
  constexpr size_t W = L::kWidth;
  const float sm = adam_math::float_of(mbits);
  const float sv = adam_math::float_of(vbits);
  const float inv_m = 1.0f / sm;
  const float inv_v = 1.0f / sv;
  const typename L::V im = L::set1(inv_m);
  const typename L::V iv = L::set1(inv_v);
  size_t j = 0;
  for (; j + W <= len; j += W) {
    const typename L::V ym = L::mul(L::template load<DType::kF32>(mbuf, j), im);
    const typename L::V yv = L::mul(L::template load<DType::kF32>(vbuf, j), iv);
    if constexpr (HasQuantizePair<L>::value) {
      L::quantize_pair(mm, mcodes, ym, vm, vcodes, yv, j);  // the same codes, stored together
    } else {
      L::template quantize<true>(mm, mcodes, j, ym);
      L::template quantize<false>(vm, vcodes, j, yv);
    }
  }
  for (; j < len; ++j) {
    ScalarLanes<>::quantize(mm, mcodes, j, mbuf[j] * inv_m);
    ScalarLanes<>::quantize(vm, vcodes, j, vbuf[j] * inv_v);
  }
  *m_scale = sm;
  *v_scale = sv;
}

// The step over blocks [block_begin, block_end) of b.
template <class L, DType G, DType O, bool kL2>
inline void step_blocks(const Adam8bitBuffers& b, const AdamScalars& s, size_t block_begin,
                        size_t block_end) {
  using S = ScalarLanes<>;
  constexpr size_t W = L::kWidth;
  const Consts<L> k(s);
  const Consts<S> ks(s);
  const CodeMap& mm = code_map(true);
  const CodeMap& vm = code_map(false);
  const Arrays a{b.master, b.grad, b.out};
  uint8_t* const cm = b.exp_avg_codes;
  uint8_t* const cv = b.exp_avg_sq_codes;
  float* const sm = b.exp_avg_scales;
  float* const sv = b.exp_avg_sq_scales;
  const size_t n = b.n;
  alignas(64) float mbuf[kAdam8bitBlock];
  alignas(64) float vbuf[kAdam8bitBlock];
  for (size_t blk = block_begin; blk < block_end; ++blk) {
    const size_t base = blk * kAdam8bitBlock;
    const size_t len = n - base < kAdam8bitBlock ? n - base : kAdam8bitBlock;
    const float scale_m = sm[blk];
    const float scale_v = sv[blk];
    const typename L::V scale_m_v = L::set1(scale_m);
    const typename L::V scale_v_v = L::set1(scale_v);
    typename L::I max_m = L::zero_bits();
    typename L::I max_v = L::zero_bits();
    uint32_t tail_max_m = 0;
    uint32_t tail_max_v = 0;
    L::dequant_block(mm, cm + base, len, mbuf);
    L::dequant_block(vm, cv + base, len, vbuf);
    size_t j = 0;
    for (; j + W <= len; j += W) {
      update_lanes<L, G, O, kL2>(a, k, scale_m_v, scale_v_v, base + j, mbuf, vbuf, j, max_m,
                                 max_v);
    }
    for (; j < len; ++j) {
      update_lanes<S, G, O, kL2>(a, ks, scale_m, scale_v, base + j, mbuf, vbuf, j, tail_max_m,
                                 tail_max_v);
    }
    const uint32_t bits_m = L::reduce_max(max_m);
    const uint32_t bits_v = L::reduce_max(max_v);
    quantize_pair<L>(mm, mbuf, cm + base, bits_m > tail_max_m ? bits_m : tail_max_m, sm + blk, vm,
                     vbuf, cv + base, bits_v > tail_max_v ? bits_v : tail_max_v, sv + blk, len);
  }
}

// The standalone quantiser over blocks [block_begin, block_end) of src.
template <class L>
inline void quantize_blocks(const float* src, uint8_t* codes, float* scales, size_t n,
                            const CodeMap& map, size_t block_begin, size_t block_end) {
  constexpr size_t W = L::kWidth;
  for (size_t blk = block_begin; blk < block_end; ++blk) {
    const size_t base = blk * kAdam8bitBlock;
    const size_t len = n - base < kAdam8bitBlock ? n - base : kAdam8bitBlock;
    typename L::I acc = L::zero_bits();
    uint32_t tail = 0;
    size_t j = 0;
    for (; j + W <= len; j += W) acc = L::max_abs_bits(acc, L::template load<DType::kF32>(src, base + j));
    for (; j < len; ++j) tail = ScalarLanes<>::max_abs_bits(tail, src[base + j]);
    const uint32_t bits = L::reduce_max(acc);
    scales[blk] = quantize_block<L>(map, src + base, codes + base, len, bits > tail ? bits : tail);
  }
}

// The bandwidth reference: the step's traffic (read p, g and both code arrays; write p and
// the codes) with one add per stream.
inline void adam8bit_traffic(float* __restrict p, const float* __restrict g,
                             uint8_t* __restrict cm, uint8_t* __restrict cv, size_t begin,
                             size_t end) {
  for (size_t i = begin; i < end; ++i) {
    p[i] += g[i];
    cm[i] = static_cast<uint8_t>(cm[i] + 1);
    cv[i] = static_cast<uint8_t>(cv[i] + 1);
  }
}

}  // namespace
}  // namespace adam8bit_math
}  // namespace offload
