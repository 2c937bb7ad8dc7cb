#include "adam/thread_pool.h"

#include <pthread.h>

#include <algorithm>

namespace offload {
namespace {

// Deliberately leaked: a pool destroyed at exit would have to join threads that may be
// parked inside a job of a thread the interpreter is tearing down. The OS reclaims all.
ThreadPool* g_pool = nullptr;
std::once_flag g_atfork_once;

void reset_pool_in_child() { g_pool = nullptr; }  // the old one is unusable there; leak it

}  // namespace

ThreadPool& ThreadPool::instance() {
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, &reset_pool_in_child); });
  // Function-local statics cannot be reset after fork, hence the pointer and this lock.
  static std::mutex create_mu;
  std::lock_guard<std::mutex> lock(create_mu);
  if (g_pool == nullptr) g_pool = new ThreadPool();
  return *g_pool;
}

void ThreadPool::ensure_workers(int count) {
  // Called with submit_mu_ held, so no job is running: workers can be added safely.
  while (static_cast<int>(workers_.size()) < count) {
    const int index = static_cast<int>(workers_.size());
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gen = generation_;
    }
    // The worker starts from the generation current now, before the job that needs it is
    // posted: reading it inside the new thread could see that job's generation already
    // and sleep through it.
    workers_.emplace_back([this, index, gen] { worker_loop(index, gen); });
  }
}

void ThreadPool::drain(const std::function<void(size_t)>& task) {
  // Tasks are handed out in index order under mu_ (a task is a chunk of >= 16K elements,
  // so the lock is taken rarely); a chunk is contiguous memory, so each thread
  // streams through whole chunks and the hardware prefetchers see long runs.
  for (;;) {
    size_t i;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_ >= ntasks_ || error_) return;
      i = next_++;
    }
    try {
      task(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::worker_loop(int index, uint64_t seen) {
  for (;;) {
    const std::function<void(size_t)>* task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= participants_) continue;  // not needed for this job
      task = task_;
    }
    drain(*task);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--running_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::run(size_t ntasks, int threads, const std::function<void(size_t)>& task) {
  if (ntasks == 0) return;
  const int want = static_cast<int>(std::min<size_t>(ntasks, threads < 1 ? 1 : threads));
  if (want <= 1) {
    for (size_t i = 0; i < ntasks; ++i) task(i);
    return;
  }
  std::lock_guard<std::mutex> submit(submit_mu_);
  ensure_workers(want - 1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    task_ = &task;
    ntasks_ = ntasks;
    next_ = 0;
    error_ = nullptr;
    participants_ = want - 1;
    running_ = want - 1;
    ++generation_;
  }
  work_cv_.notify_all();
  drain(task);  // the caller works too
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return running_ == 0; });
    task_ = nullptr;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace offload
