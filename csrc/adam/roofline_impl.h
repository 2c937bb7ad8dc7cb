// The bandwidth reference loops, written once and compiled into each kernel file with
// that file's ISA flags, so the roofline the benchmark compares against gets the same
// vector width as the Adam kernel it judges.
#pragma once

#include <cstddef>

namespace offload {
// Internal linkage on purpose: see [Note: one copy per ISA] in adam_math.h.
namespace roofline_impl {
namespace {

// Adam's memory traffic (read p, g, m, v; write p, m, v) with one add per stream: the
// fastest any Adam kernel over these arrays can go.
inline void adam_traffic(float* __restrict p, const float* __restrict g, float* __restrict m,
                         float* __restrict v, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
  }
}

// STREAM triad.
inline void triad(float* __restrict a, const float* __restrict b, const float* __restrict c,
                  float s, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

}  // namespace
}  // namespace roofline_impl
}  // namespace offload
