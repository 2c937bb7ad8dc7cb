// A persistent pool of worker threads for the Adam kernels.
//
// Why not a std::thread per call: creating and joining threads costs tens of microseconds
// per call and the engine calls the step once per unit per step. Why not OpenMP: torch
// ships its own libgomp, and two OpenMP runtimes in one process fight over threads (and
// some combinations crash). So: a small pool, started lazily, grown on demand, parked on
// a condition variable between jobs (no spinning: on shared machines a spinning pool
// steals the cores it is waiting for).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace offload {

class ThreadPool {
 public:
  // The process-wide pool. After fork() the child gets a fresh, empty pool (the parent's
  // workers do not exist there; their mutexes may be held), see pthread_atfork in the .cpp.
  static ThreadPool& instance();

  // Runs task(0) .. task(ntasks - 1) on `threads` threads (the caller plus threads - 1
  // workers), tasks handed out in order from a shared counter, and returns when all are
  // done. One job at a time: concurrent callers queue on submit_mu_. The first exception
  // a task throws is rethrown here after the others finish.
  void run(size_t ntasks, int threads, const std::function<void(size_t)>& task);

  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

 private:
  void ensure_workers(int count);
  void worker_loop(int index, uint64_t seen);
  void drain(const std::function<void(size_t)>& task);

  std::mutex submit_mu_;  // serialises run() callers
  std::mutex mu_;         // guards everything below
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;   // bumped per job; workers wait for a change
  int participants_ = 0;      // workers (index < participants_) taking part in this job
  int running_ = 0;           // workers still inside this job
  const std::function<void(size_t)>* task_ = nullptr;
  size_t ntasks_ = 0;
  size_t next_ = 0;           // next task index to hand out
  std::exception_ptr error_;
};

}  // namespace offload
