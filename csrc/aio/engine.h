// The asynchronous I/O engine: splits requests into blocks and keeps them in flight on worker
// threads, each with its own kernel AIO context.
//
//   submit(op, buf, n, path, offset)        caller thread: open, split, queue; never blocks on I/O
//     -> pieces, round-robin over workers   each worker: up to queue_depth pieces in flight,
//     -> io_submit / io_getevents            completions reaped as they arrive
//     -> Request::complete_piece             the last piece wakes the waiter
//
// A piece is one of three kinds (see [Note: alignment] in engine.cpp):
//   kDirect   4 KiB-aligned buffer, offset and length: O_DIRECT straight from/to the caller's
//             buffer (the fast path);
//   kBounce   aligned file range but misaligned buffer: O_DIRECT through a worker-owned
//             aligned bounce buffer, one memcpy per block;
//   kBuffered the sub-4 KiB head and tail of an unaligned range, and every piece on a
//             filesystem without O_DIRECT: plain pread/pwrite on the worker thread.
#pragma once

#include <linux/aio_abi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "aio/request.h"

namespace offload {

// O_DIRECT alignment for buffer addresses, file offsets and lengths. 4 KiB satisfies every
// logical block size in use (512 B and 4 KiB sectors) and the page size.
constexpr size_t kDirectAlignment = 4096;

struct EngineOptions {
  size_t block_size = 1 << 20;  // bytes per piece; a multiple of kDirectAlignment
  int queue_depth = 32;         // pieces in flight per worker
  int threads = 2;              // workers, each with its own AIO context
  bool buffered = false;        // never use O_DIRECT (page-cache pread/pwrite only)
  // Testing aid: each piece waits this long on its worker before it is issued, so tests of
  // the layers above can check that nothing reads a buffer or file before waiting. 0: off.
  int64_t inject_delay_us = 0;
};

enum class PieceKind { kDirect, kBounce, kBuffered };

struct Piece {
  std::shared_ptr<Request> request;
  std::shared_ptr<OpenFile> file;
  PieceKind kind = PieceKind::kDirect;
  char* buf = nullptr;  // the caller's bytes for this piece
  size_t len = 0;
  int64_t offset = 0;   // file offset
};

// One worker thread and its AIO context. Pieces are queued from any thread; only the worker
// thread touches its context, slots and bounce buffers.
class Worker {
 public:
  Worker(size_t block_size, int queue_depth, int64_t inject_delay_us);  // throws IOError
  ~Worker();                                   // finishes every queued piece, then joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void enqueue(std::vector<Piece>&& pieces);
  void stop();  // finish what is queued, then exit; idempotent

 private:
  struct Slot {
    Piece piece;
    struct iocb cb;
    char* bounce = nullptr;  // block_size bytes, 4 KiB aligned, allocated on first use
  };

  void run();
  bool prepare(Piece&& piece, std::vector<struct iocb*>* batch);
  void submit(std::vector<struct iocb*>* batch);
  void reap();
  void complete(Slot& slot, long res);
  void run_buffered(Piece& piece);
  void finish_slot(Slot& slot);
  static int copy_out(char* dst, const char* src, size_t n);
  void wait_for_work(bool eagain);

  const size_t block_size_;
  const int queue_depth_;
  const int64_t inject_delay_us_;
  aio_context_t ctx_ = 0;
  int notify_fd_ = -1;  // eventfd: new pieces queued, or stop
  int done_fd_ = -1;    // eventfd: signalled by the kernel on each AIO completion
  std::vector<Slot> slots_;
  std::vector<int> free_slots_;
  std::deque<Piece> ready_;  // taken from queue_, not yet submitted (worker thread only)
  int in_flight_ = 0;        // worker thread only

  std::mutex mu_;
  std::deque<Piece> queue_;
  bool stopping_ = false;

  std::thread thread_;
};

class Engine {
 public:
  explicit Engine(const EngineOptions& options);  // throws ValueError / IOError
  ~Engine();

  // Starts a read or write of `nbytes` at `buf` from/to `path` at `offset`. Never throws for
  // I/O failures: those, opening the file included, complete the request with an error that
  // Request::rethrow reports, so every failure surfaces in one place (the wait).
  std::shared_ptr<Request> submit(IOOp op, void* buf, size_t nbytes, const std::string& path,
                                  int64_t offset);
  // Finishes everything queued and stops the workers. Submitting afterwards throws.
  void close();
  const EngineOptions& options() const { return options_; }

 private:
  void split(const std::shared_ptr<Request>& req, const std::shared_ptr<OpenFile>& file,
             std::vector<Piece>* pieces) const;

  const EngineOptions options_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<size_t> next_worker_{0};
  std::mutex close_mu_;
  bool closed_ = false;
};

}  // namespace offload
