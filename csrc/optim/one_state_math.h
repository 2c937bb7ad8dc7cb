// Lion's and Adagrad's update of one lane group, written once over a "lanes" type (one
// float, 8 AVX2 lanes or 16 AVX-512 lanes), and the loops that apply it to a range. Every
// kernel (csrc/optim/one_state_kernel_*.cpp) instantiates these same templates with its
// own lanes, so the kernels perform the same operations in the same order by
// construction, not by keeping hand-written copies in step.
//
// [Note: one-state operation order] Per element, in fp32, FMA (one rounding) exactly where
// written and nowhere else:
//   Lion:     g = grad * grad_scale
//             c = fma(1 - beta1, g, m * beta1)
//             p = fma(-lr, sign(c), p * decay)       decay = 1 - lr * wd; sign(c) in {-1, 0, 1}
//             m = fma(1 - beta2, g, m * beta2)
//   Adagrad:  g = grad * grad_scale
//             g = fma(p, wd, g)                      only when weight_decay != 0 (torch skips it)
//             s = fma(g, g, s)
//             p = fma(-clr, g / (sqrt(s) + eps), p)
// Lion's c and m are torch's `m.mul(beta1).add(g, alpha=1-beta1)` (ATen's CPU add with an
// alpha is one fused multiply-add): lion-pytorch's fp32 update, sign included. Adagrad's
// s and p fuse what torch rounds twice (addcmul_, addcdiv_), a last-bit difference, as the
// Adam kernel does (csrc/adam/adam_math.h). sign(c) is exact, so -lr * sign(c) is too and
// Lion's p rounds once whichever way it is written; but sign() turns a last-bit change of a
// c near 0 into a whole lr step, so the order of c's operations is part of the contract.
// IEEE multiply, add, divide, sqrt and FMA are correctly rounded in every ISA, so equal
// operation order means equal bits. No product above feeds an addition directly (each one
// is an FMA's addend or a multiplicand), so there is nothing a compiler could contract; the
// files that compile these templates are built with -ffp-contract=off all the same
// (CMakeLists.txt), so that a later edit writing `add(mul(a, b), c)` cannot be fused into
// an FMA in the kernel files whose ISA has one and left unfused in the scalar reference.
#pragma once

#include <cmath>
#include <cstddef>

#include "adam/adam_math.h"
#include "optim/one_state.h"

namespace offload {
// Internal linkage: see [Note: one copy per ISA] in csrc/adam/adam_math.h.
namespace one_state_math {
namespace {

// One element as a "lane group": the scalar reference, the portable kernel (Conv =
// BranchFreeConv, for the vectoriser) and every SIMD kernel's tail.
template <class Conv = adam_math::ScalarConv>
struct ScalarLanes {
  using V = float;
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
  static V add(V a, V b) { return a + b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return std::sqrt(a); }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  // +1, -1, or +0 for zeros and NaN (torch.sign gives 0 for NaN on the CPU too).
  static V sign(V a) { return static_cast<float>(static_cast<int>(a > 0.0f) - static_cast<int>(a < 0.0f)); }
};

struct LionOp {
  using Scalars = LionScalars;
  static constexpr bool kHasFlag = false;  // one code path for every hyper-parameter
  template <class L>
  struct Consts {
    typename L::V grad_scale, decay, neg_lr, beta1, one_minus_beta1, beta2, one_minus_beta2;
    explicit Consts(const LionScalars& s)
        : grad_scale(L::set1(s.grad_scale)),
          decay(L::set1(s.decay)),
          neg_lr(L::set1(s.neg_lr)),
          beta1(L::set1(s.beta1)),
          one_minus_beta1(L::set1(s.one_minus_beta1)),
          beta2(L::set1(s.beta2)),
          one_minus_beta2(L::set1(s.one_minus_beta2)) {}
  };
  // [Note: one-state operation order], Lion.
  template <class L, bool>
  static void update(typename L::V& p, typename L::V& m, typename L::V grad, const Consts<L>& k) {
    const typename L::V g = L::mul(grad, k.grad_scale);
    const typename L::V c = L::fma(k.one_minus_beta1, g, L::mul(m, k.beta1));
    p = L::fma(k.neg_lr, L::sign(c), L::mul(p, k.decay));
    m = L::fma(k.one_minus_beta2, g, L::mul(m, k.beta2));
  }
};

struct AdagradOp {
  using Scalars = AdagradScalars;
  static constexpr bool kHasFlag = true;  // the flag: L2 weight decay on (wd != 0)
  template <class L>
  struct Consts {
    typename L::V grad_scale, l2, neg_clr, eps;
    explicit Consts(const AdagradScalars& s)
        : grad_scale(L::set1(s.grad_scale)),
          l2(L::set1(s.l2)),
          neg_clr(L::set1(s.neg_clr)),
          eps(L::set1(s.eps)) {}
  };
  // [Note: one-state operation order], Adagrad.
  template <class L, bool kL2>
  static void update(typename L::V& p, typename L::V& s, typename L::V grad, const Consts<L>& k) {
    typename L::V g = L::mul(grad, k.grad_scale);
    if constexpr (kL2) g = L::fma(p, k.l2, g);
    s = L::fma(g, g, s);
    const typename L::V d = L::add(L::sqrt(s), k.eps);
    p = L::fma(k.neg_clr, L::div(g, d), p);
  }
};

// Elements [i, i + L::kWidth): load, update, store (and the low-precision copy).
template <class L, class Op, DType G, DType S, DType O, bool F>
inline void step_lanes(float* p, const void* g, void* st, void* out,
                       const typename Op::template Consts<L>& k, size_t i) {
  typename L::V pv = L::template load<DType::kF32>(p, i);
  typename L::V sv = L::template load<S>(st, i);
  Op::template update<L, F>(pv, sv, L::template load<G>(g, i), k);
  L::template store<DType::kF32>(p, i, pv);
  L::template store<S>(st, i, sv);
  if constexpr (O != DType::kNone) L::template store<O>(out, i, pv);
}

// The scalar and portable kernels: one element at a time (the portable kernel's loop is
// vectorised by the compiler; `ivdep`: the arrays never overlap, Python checks that).
template <class L, class Op, DType G, DType S, DType O, bool F>
inline void run_elements(const OneStateBuffers& b, const typename Op::Scalars& s, size_t begin,
                         size_t end) {
  const typename Op::template Consts<L> k(s);
  float* const p = b.master;
  const void* const g = b.grad;
  void* const st = b.state;
  void* const out = b.out;
#pragma GCC ivdep
  for (size_t i = begin; i < end; ++i) step_lanes<L, Op, G, S, O, F>(p, g, st, out, k, i);
}

// The SIMD kernels: two vectors per iteration (two independent dependency chains, which
// keeps Adagrad's sqrt/divide unit busy; `L::store2` lets AVX2 narrow two vectors of bf16
// at once), then one vector, then the tail element by element with scalar lanes.
template <class L, class Op, DType G, DType S, DType O, bool F>
inline void run_vectors(const OneStateBuffers& b, const typename Op::Scalars& s, size_t begin,
                        size_t end) {
  using V = typename L::V;
  constexpr size_t W = L::kWidth;
  const typename Op::template Consts<L> k(s);
  // The pointers in locals: read through `b` they would be reloaded after every store
  // (a float store may alias the struct, as far as the compiler can tell).
  float* const p = b.master;
  const void* const g = b.grad;
  void* const st = b.state;
  void* const out = b.out;
  size_t i = begin;
  for (; i + 2 * W <= end; i += 2 * W) {
    V p0 = L::template load<DType::kF32>(p, i);
    V p1 = L::template load<DType::kF32>(p, i + W);
    V s0 = L::template load<S>(st, i);
    V s1 = L::template load<S>(st, i + W);
    Op::template update<L, F>(p0, s0, L::template load<G>(g, i), k);
    Op::template update<L, F>(p1, s1, L::template load<G>(g, i + W), k);
    L::template store2<DType::kF32>(p, i, p0, p1);
    L::template store2<S>(st, i, s0, s1);
    if constexpr (O != DType::kNone) L::template store2<O>(out, i, p0, p1);
  }
  if (i + W <= end) {
    step_lanes<L, Op, G, S, O, F>(p, g, st, out, k, i);
    i += W;
  }
  if (i < end) run_elements<ScalarLanes<>, Op, G, S, O, F>(b, s, i, end);
}

// The bandwidth reference: a one-state step's traffic (read p, g, s; write p, s) with one
// add per stream, the fastest any Lion or Adagrad kernel over these arrays can go.
inline void one_state_traffic(float* __restrict p, const float* __restrict g,
                              float* __restrict s, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float gi = g[i];
    p[i] += gi;
    s[i] += gi;
  }
}

}  // namespace
}  // namespace one_state_math
}  // namespace offload
