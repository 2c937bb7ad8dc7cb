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

// The same traffic with a software prefetch kAhead elements ahead in each of the four
// streams (one line of each per 16 elements): the hardware prefetchers run only so far
// ahead, so a loop may reach more of the bandwidth with help. [Note: a limit that is the
// limit] in adam.cpp: the benchmark's roofline is the best of these variants.
template <size_t kAhead>
inline void adam_traffic_ahead(float* __restrict p, const float* __restrict g,
                               float* __restrict m, float* __restrict v, size_t begin,
                               size_t end) {
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __builtin_prefetch(p + i + kAhead, 1, 3);
    __builtin_prefetch(g + i + kAhead, 0, 3);
    __builtin_prefetch(m + i + kAhead, 1, 3);
    __builtin_prefetch(v + i + kAhead, 1, 3);
    for (size_t j = i; j < i + 16; ++j) {
      const float gj = g[j];
      p[j] += gj;
      m[j] += gj;
      v[j] += gj;
    }
  }
  adam_traffic(p, g, m, v, i, end);
}

// STREAM triad.
inline void triad(float* __restrict a, const float* __restrict b, const float* __restrict c,
                  float s, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

}  // namespace
}  // namespace roofline_impl
}  // namespace offload
