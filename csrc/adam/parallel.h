// Splitting a flat update into chunks and running them on the persistent pool: shared by
// the Adam step (adam.cpp) and the one-state optimizers (csrc/optim/one_state.cpp), so
// every native optimizer chunks, and therefore scales, the same way.
#pragma once

#include <algorithm>
#include <cstddef>

#include "adam/adam.h"
#include "adam/kernels.h"
#include "adam/thread_pool.h"
#include "common/errors.h"

namespace offload {
namespace parallel {
namespace {

// [Note: chunking] Each task is one contiguous chunk, so a thread streams through whole
// runs of every array and the hardware prefetchers see long sequential streams. About four
// chunks per thread let a thread that was descheduled (shared machines) be covered by the
// others. Chunks hold at least 16K elements (~450 KB of fp32 traffic: thread hand-off
// costs vanish next to it) and at most 1M, and are multiples of kChunkAlignElems, so with
// 64-byte aligned bases no two threads ever write the same cache line (no false sharing).
// Results do not depend on the chunking: every element is updated independently.
constexpr size_t kMinChunkElems = size_t{1} << 14;
constexpr size_t kMaxChunkElems = size_t{1} << 20;

inline size_t chunk_elems(size_t n, int threads) {
  size_t c = (n + static_cast<size_t>(threads) * 4 - 1) / (static_cast<size_t>(threads) * 4);
  c = std::clamp(c, kMinChunkElems, kMaxChunkElems);
  return (c + kChunkAlignElems - 1) / kChunkAlignElems * kChunkAlignElems;
}

// A call's thread count: 0 means the process default (adam_num_threads()).
inline int threads_for_call(int threads) {
  if (threads < 0) throw ValueError("threads must be >= 0 (0 means the configured default)");
  return threads == 0 ? adam_num_threads() : threads;
}

// range(begin, end) over [0, n) in chunks, on `threads` threads (the caller among them).
template <class Range>
void parallel_chunks(size_t n, int threads, const Range& range) {
  const size_t chunk = chunk_elems(n, threads);
  const size_t nchunks = (n + chunk - 1) / chunk;
  if (nchunks <= 1 || threads <= 1) {
    range(size_t{0}, n);
    return;
  }
  ThreadPool::instance().run(nchunks, threads, [&](size_t c) {
    const size_t begin = c * chunk;
    range(begin, std::min(n, begin + chunk));
  });
}

}  // namespace
}  // namespace parallel
}  // namespace offload
