// One read or write of a byte range: the handle a caller waits on, and the file it touches.
//
// A request is split into pieces (csrc/aio/engine.h); each piece completes exactly once, on a
// worker thread, successfully, with an error, or skipped because an earlier piece of the same
// request failed. The request is done when its last piece completes, so a waiter is woken
// whatever happens: a failure never leaves it hanging.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace offload {

enum class IOOp { kRead, kWrite };

// The name of an errno value ("ENOSPC"); glibc's strerrorname_np is too new for old distros.
const char* errno_name(int err);

// The file one request reads or writes, opened for that request alone and closed when its
// last piece lets go (see [Note: open per request] in engine.cpp).
class OpenFile {
 public:
  // Opens `path` for `op`: writes get O_CREAT and never O_TRUNC, so bytes outside the
  // written range survive. With `try_direct`, O_DIRECT is asked for first; a filesystem that
  // refuses it with EINVAL (ramfs, some FUSE and network mounts) gets a buffered descriptor
  // and direct() is false. `want_buffered` also opens a buffered descriptor next to the
  // O_DIRECT one, for the unaligned edges of a range. Returns nullptr with *err set on failure.
  static std::shared_ptr<OpenFile> open(const std::string& path, IOOp op, bool try_direct,
                                        bool want_buffered, int* err);
  ~OpenFile();
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;

  bool direct() const { return direct_; }
  // True when O_DIRECT was asked for and the filesystem refused it.
  bool direct_refused() const { return direct_refused_; }
  int fd() const { return fd_; }
  // A descriptor without O_DIRECT (the same as fd() when the file is not direct). Opened on
  // first use when open() did not; returns -1 with *err set if that fails.
  int buffered_fd(int* err);
  // The file's current size, or -1.
  int64_t size() const;
  const std::string& path() const { return path_; }

 private:
  OpenFile(std::string path, IOOp op) : path_(std::move(path)), op_(op) {}
  std::string path_;
  IOOp op_;
  int fd_ = -1;
  int buffered_fd_ = -1;
  bool direct_ = false;
  bool direct_refused_ = false;
  std::mutex mu_;  // guards the lazy open of buffered_fd_
};

class Request {
 public:
  Request(IOOp op, std::string path, void* buf, size_t nbytes, int64_t offset)
      : op_(op), path_(std::move(path)), buf_(static_cast<char*>(buf)), nbytes_(nbytes),
        offset_(offset) {}

  IOOp op() const { return op_; }
  const std::string& path() const { return path_; }
  char* buf() const { return buf_; }
  size_t nbytes() const { return nbytes_; }
  int64_t offset() const { return offset_; }
  bool direct() const { return direct_.load(std::memory_order_relaxed); }
  void set_direct(bool d) { direct_.store(d, std::memory_order_relaxed); }

  // --- completion, called by the engine and its workers ---
  // Pieces still to complete; starts at 1, a guard the submitter drops once every piece is
  // queued, so the request cannot look done while it is still being split.
  void add_pending(size_t n);
  // Records the first failure (later ones are dropped: the first is the cause) and makes
  // failed() true so queued pieces of this request are skipped. Does not complete a piece.
  void record_error(int err, const std::string& detail, bool short_read = false);
  void complete_piece();
  bool failed() const { return failed_.load(std::memory_order_acquire); }

  // --- waiting, called by the owner (the binding releases the GIL around these) ---
  // Blocks until done or until timeout_s passes (timeout_s < 0: no limit). True when done.
  bool wait_for(double timeout_s);
  bool done() const;
  // After done: throws IOError(errno, path, message) if the request failed.
  void rethrow() const;
  bool short_read() const;
  int error_code() const;

 private:
  const IOOp op_;
  const std::string path_;
  char* const buf_;
  const size_t nbytes_;
  const int64_t offset_;
  std::atomic<bool> direct_{true};
  std::atomic<bool> failed_{false};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t pending_ = 1;
  bool done_ = false;
  int err_ = 0;
  bool short_read_ = false;
  std::string message_;
};

}  // namespace offload
