#include "aio/engine.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include "aio/kernel_aio.h"
#include "common/errors.h"

namespace offload {

// [Note: alignment]
// O_DIRECT moves whole 4 KiB blocks between the device and memory, so the buffer address, the
// file offset and the length must all be multiples of 4 KiB. A request [offset, offset+n) is
// cut into
//   head  [offset, A)     A = offset rounded up to 4 KiB   (< 4 KiB, may be empty)
//   core  [A, B)          B = end rounded down to 4 KiB    (whole blocks, O_DIRECT)
//   tail  [B, end)                                         (< 4 KiB, may be empty)
// The core goes straight to the caller's buffer when buf + (A - offset) is 4 KiB aligned (it
// is whenever buf and offset are equally misaligned, e.g. a page-aligned buffer and an aligned
// offset), else through a bounce buffer. Head and tail are small and go through buffered
// pread/pwrite of exactly their bytes:
//   - a write touches exactly its own bytes, so two requests writing neighbouring ranges that
//     share a 4 KiB block never overwrite each other (a read-modify-write of the block through
//     O_DIRECT would race: both read the old block, and the second write drops the first's
//     bytes). The kernel merges buffered writes to one page under the page lock.
//   - a write past the end of the file leaves the size at exactly offset + n, not rounded up.
//   - coherence between the page cache and O_DIRECT is the kernel's: an O_DIRECT read or
//     write flushes and invalidates the cached pages in its range first, and no O_DIRECT piece
//     ever covers a block that another non-overlapping request touches only in part.
// Overlapping concurrent requests are, as with pread/pwrite themselves, unordered: the caller
// orders them by waiting.
//
// [Note: open per request]
// Each request opens its file and the descriptors close when its last piece completes. An
// open costs microseconds against milliseconds of I/O per MiB, and it keeps the engine free of
// a cache whose descriptors would go stale when a file is deleted, renamed or recreated
// between requests (checkpoint rotation does exactly that) and of a limit on open files.
//
// [Note: preallocation]
// A write that extends a file first fallocate()s [offset, end) (mode 0: allocate blocks and
// raise the size to exactly `end`, never lower it). Without it, ext4 and XFS complete an
// extending O_DIRECT write synchronously inside io_submit, so the queue depth buys nothing on
// a fresh file; fio preallocates its files the same way. A full disk then fails before any
// byte is written. Filesystems without fallocate skip this.

namespace {

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
size_t round_down(size_t x, size_t a) { return x / a * a; }
bool aligned(uint64_t x) { return x % kDirectAlignment == 0; }

std::string errno_text(int err) {
  return std::string(std::strerror(err)) + " (" + errno_name(err) + ")";
}

std::string range_text(int64_t offset, size_t len) {
  return "at file offset " + std::to_string(offset) + ", " + std::to_string(len) + " bytes";
}

void fail_piece(Piece& p, int err, const std::string& what) {
  p.request->record_error(err, errno_text(err) + " " + what + " " + range_text(p.offset, p.len));
}

void fail_short_read(Piece& p, size_t got) {
  const int64_t size = p.file->size();
  std::string detail = "short read: only " + std::to_string(got) + " of " +
                       std::to_string(p.len) + " bytes at file offset " +
                       std::to_string(p.offset) + " exist";
  if (size >= 0) detail += " (the file ends at byte " + std::to_string(size) + ")";
  detail += "; read within the file's size, or write the range first";
  // EIO is the errno a short read is reported with; Python raises it as ShortReadError.
  p.request->record_error(EIO, detail, /*short_read=*/true);
}

// pread/pwrite until `len` bytes are done, EOF, or an error. Returns bytes done; *err is set
// (0 at EOF) when fewer than `len`.
size_t full_rw(IOOp op, int fd, char* buf, size_t len, int64_t offset, int* err) {
  size_t done = 0;
  *err = 0;
  while (done < len) {
    ssize_t n = op == IOOp::kRead ? ::pread(fd, buf + done, len - done, offset + done)
                                  : ::pwrite(fd, buf + done, len - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      break;
    }
    if (n == 0) {
      if (op == IOOp::kWrite) *err = EIO;  // pwrite making no progress is a device problem
      break;
    }
    done += static_cast<size_t>(n);
  }
  return done;
}

void drain_eventfd(int fd) {
  uint64_t value;
  while (::read(fd, &value, sizeof(value)) > 0) {
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Worker

Worker::Worker(size_t block_size, int queue_depth, int64_t inject_delay_us)
    : block_size_(block_size), queue_depth_(queue_depth), inject_delay_us_(inject_delay_us),
      slots_(queue_depth) {
  if (kernel_aio::setup(static_cast<unsigned>(queue_depth), &ctx_) != 0) {
    const int err = errno;
    throw IOError(err, "", "io_setup(" + std::to_string(queue_depth) + ") failed: " +
                               errno_text(err) +
                               (err == EAGAIN ? "; the system-wide AIO limit "
                                                "(/proc/sys/fs/aio-max-nr) is exhausted: "
                                                "lower queue_depth or threads, or raise it"
                                              : ""));
  }
  notify_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  done_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (notify_fd_ < 0 || done_fd_ < 0) {
    const int err = errno;
    if (notify_fd_ >= 0) ::close(notify_fd_);
    if (done_fd_ >= 0) ::close(done_fd_);
    kernel_aio::destroy(ctx_);
    throw IOError(err, "", "eventfd failed: " + errno_text(err));
  }
  free_slots_.reserve(queue_depth);
  for (int i = queue_depth - 1; i >= 0; --i) free_slots_.push_back(i);
  thread_ = std::thread([this] { run(); });
}

Worker::~Worker() {
  stop();
  if (thread_.joinable()) thread_.join();
  for (Slot& s : slots_) std::free(s.bounce);
  kernel_aio::destroy(ctx_);
  ::close(notify_fd_);
  ::close(done_fd_);
}

void Worker::enqueue(std::vector<Piece>&& pieces) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Piece& p : pieces) queue_.push_back(std::move(p));
  }
  const uint64_t one = 1;
  (void)!::write(notify_fd_, &one, sizeof(one));
}

void Worker::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(notify_fd_, &one, sizeof(one));
}

void Worker::run() {
  std::vector<struct iocb*> batch;
  batch.reserve(queue_depth_);
  for (;;) {
    if (in_flight_ > 0) reap();

    bool stopping;
    bool queue_empty;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Take only what can go in flight now; the rest waits in queue_, in order, and
      // wait_for_work comes straight back while any is left and there is room.
      while (!queue_.empty() && static_cast<int>(ready_.size()) + in_flight_ < queue_depth_) {
        ready_.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      stopping = stopping_;
      queue_empty = queue_.empty();
    }

    batch.clear();
    while (!ready_.empty() && !free_slots_.empty()) {
      Piece p = std::move(ready_.front());
      ready_.pop_front();
      if (inject_delay_us_ > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(inject_delay_us_));
      }
      prepare(std::move(p), &batch);
    }
    const size_t wanted = batch.size();
    submit(&batch);
    const bool eagain = batch.size() < wanted && in_flight_ == 0 && !ready_.empty();

    if (stopping && queue_empty && ready_.empty() && in_flight_ == 0) return;
    wait_for_work(eagain);
  }
}

// Turns a piece into an iocb in a free slot (kDirect, kBounce), or runs it now (kBuffered,
// or a piece of a request that already failed, which is skipped). Returns true if queued.
bool Worker::prepare(Piece&& piece, std::vector<struct iocb*>* batch) {
  if (piece.request->failed()) {
    // Skipped: the request already failed, its caller gets that error, and there is no point
    // in moving more of its bytes.
    piece.request->complete_piece();
    return false;
  }
  if (piece.kind == PieceKind::kBuffered) {
    run_buffered(piece);
    piece.request->complete_piece();
    return false;
  }
  const int index = free_slots_.back();
  free_slots_.pop_back();
  Slot& slot = slots_[index];
  slot.piece = std::move(piece);
  ++in_flight_;  // the slot is taken; finish_slot gives it back
  Piece& p = slot.piece;
  char* io_buf = p.buf;
  if (p.kind == PieceKind::kBounce) {
    if (slot.bounce == nullptr) {
      void* mem = nullptr;
      if (posix_memalign(&mem, kDirectAlignment, block_size_) != 0) {
        fail_piece(p, ENOMEM, "allocating a bounce buffer");
        finish_slot(slot);
        return false;
      }
      slot.bounce = static_cast<char*>(mem);
    }
    io_buf = slot.bounce;
    if (p.request->op() == IOOp::kWrite) std::memcpy(io_buf, p.buf, p.len);
  }
  std::memset(&slot.cb, 0, sizeof(slot.cb));
  slot.cb.aio_data = static_cast<uint64_t>(index);
  slot.cb.aio_lio_opcode = p.request->op() == IOOp::kRead ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
  slot.cb.aio_fildes = static_cast<uint32_t>(p.file->fd());
  slot.cb.aio_buf = reinterpret_cast<uint64_t>(io_buf);
  slot.cb.aio_nbytes = p.len;
  slot.cb.aio_offset = p.offset;
  slot.cb.aio_flags = IOCB_FLAG_RESFD;  // the kernel bumps done_fd_ on completion
  slot.cb.aio_resfd = static_cast<uint32_t>(done_fd_);
  batch->push_back(&slot.cb);
  return true;
}

// Submits the batch. What the kernel did not take for lack of resources (EAGAIN) goes back to
// the front of ready_, in order; an iocb it rejects fails its own piece only.
void Worker::submit(std::vector<struct iocb*>* batch) {
  size_t i = 0;
  while (i < batch->size()) {
    const int n = kernel_aio::submit(ctx_, static_cast<long>(batch->size() - i), batch->data() + i);
    if (n > 0) {
      i += static_cast<size_t>(n);
      continue;
    }
    const int err = n == 0 ? EAGAIN : errno;
    if (err == EINTR) continue;
    if (err == EAGAIN) {
      for (size_t j = batch->size(); j-- > i;) {
        Slot& slot = slots_[(*batch)[j]->aio_data];
        ready_.push_front(std::move(slot.piece));
        slot.piece = Piece{};
        free_slots_.push_back(static_cast<int>((*batch)[j]->aio_data));
        --in_flight_;
      }
      batch->resize(i);
      return;
    }
    // io_submit reports only the first iocb's error; that one fails, the rest are retried.
    Slot& slot = slots_[(*batch)[i]->aio_data];
    fail_piece(slot.piece, err, "submitting");
    finish_slot(slot);
    ++i;
  }
}

void Worker::reap() {
  struct io_event events[64];
  for (;;) {
    struct timespec zero = {0, 0};
    const int n = kernel_aio::getevents(ctx_, 0, 64, events, &zero);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    for (int i = 0; i < n; ++i) {
      complete(slots_[events[i].data], static_cast<long>(events[i].res));
    }
    if (n < 64) return;
  }
}

void Worker::complete(Slot& slot, long res) {
  Piece& p = slot.piece;
  const bool read = p.request->op() == IOOp::kRead;
  if (res < 0) {
    fail_piece(p, static_cast<int>(-res), read ? "reading" : "writing");
  } else if (static_cast<size_t>(res) < p.len) {
    const size_t got = static_cast<size_t>(res);
    if (read) {
      fail_short_read(p, got);
    } else {
      // A short O_DIRECT write (the disk filled up, or the file-size limit was reached part
      // way). Write the rest synchronously so the caller gets the real errno, or, if the
      // condition has passed, the data.
      const char* src = (p.kind == PieceKind::kBounce ? slot.bounce : p.buf) + got;
      const int64_t off = p.offset + static_cast<int64_t>(got);
      const size_t left = p.len - got;
      int err = 0;
      int fd = (aligned(reinterpret_cast<uintptr_t>(src)) && aligned(off) && aligned(left))
                   ? p.file->fd()
                   : p.file->buffered_fd(&err);
      if (fd < 0) {
        fail_piece(p, err, "reopening to finish a short write");
      } else {
        const size_t n = full_rw(IOOp::kWrite, fd, const_cast<char*>(src), left, off, &err);
        if (n < left) fail_piece(p, err, "writing");
      }
    }
  } else if (read && p.kind == PieceKind::kBounce) {
    const int err = copy_out(p.buf, slot.bounce, p.len);
    if (err != 0) fail_piece(p, err, "copying the read into the caller's buffer");
  }
  finish_slot(slot);
}

// Copies a bounced read into the caller's buffer. The caller's memory may not be writable
// (a tensor over a read-only mapping): the kernel's own reads report that as EFAULT, and so
// must this copy, never SIGSEGV. process_vm_readv on our own pid copies like memcpy but
// returns EFAULT (or a short count) at a fault; where a sandbox forbids the call (EPERM,
// ENOSYS) the copy falls back to memcpy.
int Worker::copy_out(char* dst, const char* src, size_t n) {
  struct iovec local = {dst, n};
  struct iovec remote = {const_cast<char*>(src), n};
  const ssize_t got = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
  if (got == static_cast<ssize_t>(n)) return 0;
  if (got < 0 && (errno == EPERM || errno == ENOSYS)) {
    std::memcpy(dst, src, n);
    return 0;
  }
  return got < 0 ? errno : EFAULT;
}

// Completes the slot's piece (after every byte of it has been copied: the waiter may free the
// buffer the moment the request is done) and returns the slot.
void Worker::finish_slot(Slot& slot) {
  const int index = static_cast<int>(&slot - slots_.data());
  std::shared_ptr<Request> req = std::move(slot.piece.request);
  slot.piece = Piece{};  // drops the file: its descriptors close with the last piece
  free_slots_.push_back(index);
  --in_flight_;
  req->complete_piece();
}

void Worker::run_buffered(Piece& p) {
  int err = 0;
  const int fd = p.file->buffered_fd(&err);
  if (fd < 0) {
    fail_piece(p, err, "opening without O_DIRECT");
    return;
  }
  const IOOp op = p.request->op();
  const size_t n = full_rw(op, fd, p.buf, p.len, p.offset, &err);
  if (n == p.len) return;
  if (op == IOOp::kRead && err == 0) {
    fail_short_read(p, n);
  } else {
    fail_piece(p, err, op == IOOp::kRead ? "reading" : "writing");
  }
}

// Sleeps until there is something to do: new pieces (only if there is room for them), a
// completion (only if something is in flight), or, after EAGAIN from io_submit with nothing
// in flight, a short retry delay.
void Worker::wait_for_work(bool eagain) {
  struct pollfd fds[2];
  int n = 0;
  const bool room = static_cast<int>(ready_.size()) + in_flight_ < queue_depth_;
  if (room) {
    // Pieces may be waiting in queue_ with their wakeup already consumed (the last round
    // took only as many as fitted, or skipped and ran buffered pieces without using a
    // slot): take them now rather than sleep on a signal that will not come again.
    std::lock_guard<std::mutex> lock(mu_);
    if (!queue_.empty()) return;
  }
  if (room) fds[n++] = {notify_fd_, POLLIN, 0};
  if (in_flight_ > 0) fds[n++] = {done_fd_, POLLIN, 0};
  if (n == 0 && !eagain) return;  // full and nothing in flight cannot happen; be safe
  const int rc = ::poll(fds, n, eagain ? 1 : -1);
  if (rc <= 0) return;
  // Reset the counters before looking at the queue and the completion ring, so that anything
  // arriving after this point signals again.
  for (int i = 0; i < n; ++i) {
    if (fds[i].revents & POLLIN) drain_eventfd(fds[i].fd);
  }
}

// ------------------------------------------------------------------------------------------
// Engine

Engine::Engine(const EngineOptions& options) : options_(options) {
  if (options.block_size == 0 || options.block_size % kDirectAlignment != 0) {
    throw ValueError("block_size must be a positive multiple of 4096 bytes, got " +
                     std::to_string(options.block_size));
  }
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    throw ValueError("queue_depth must be in [1, 4096], got " +
                     std::to_string(options.queue_depth));
  }
  if (options.threads < 1 || options.threads > 256) {
    throw ValueError("threads must be in [1, 256], got " + std::to_string(options.threads));
  }
  workers_.reserve(options.threads);
  for (int i = 0; i < options.threads; ++i) {
    workers_.push_back(std::make_unique<Worker>(options.block_size, options.queue_depth,
                                                options.inject_delay_us));
  }
}

Engine::~Engine() { close(); }

void Engine::close() {
  std::lock_guard<std::mutex> lock(close_mu_);
  if (closed_) return;
  closed_ = true;
  for (auto& w : workers_) w->stop();
  workers_.clear();  // joins each worker after it has finished its queue
}

void Engine::split(const std::shared_ptr<Request>& req, const std::shared_ptr<OpenFile>& file,
                   std::vector<Piece>* pieces) const {
  char* const buf = req->buf();
  const size_t begin = static_cast<size_t>(req->offset());
  const size_t end = begin + req->nbytes();
  auto add = [&](PieceKind kind, size_t from, size_t to) {
    for (size_t at = from; at < to; at += options_.block_size) {
      const size_t len = std::min(options_.block_size, to - at);
      pieces->push_back(Piece{req, file, kind, buf + (at - begin), len, static_cast<int64_t>(at)});
    }
  };
  if (!file->direct()) {
    add(PieceKind::kBuffered, begin, end);
    return;
  }
  const size_t a = round_up(begin, kDirectAlignment);
  const size_t b = round_down(end, kDirectAlignment);
  if (a >= b) {  // no whole block inside the range
    add(PieceKind::kBuffered, begin, end);
    return;
  }
  add(PieceKind::kBuffered, begin, a);
  const bool buf_aligned = aligned(reinterpret_cast<uintptr_t>(buf + (a - begin)));
  add(buf_aligned ? PieceKind::kDirect : PieceKind::kBounce, a, b);
  add(PieceKind::kBuffered, b, end);
}

std::shared_ptr<Request> Engine::submit(IOOp op, void* buf, size_t nbytes,
                                        const std::string& path, int64_t offset) {
  if (offset < 0) throw ValueError("offset must be >= 0, got " + std::to_string(offset));
  if (nbytes > static_cast<uint64_t>(INT64_MAX - offset)) {
    throw ValueError("offset + nbytes overflows a file offset (" + std::to_string(offset) +
                     " + " + std::to_string(nbytes) + ")");
  }
  {
    std::lock_guard<std::mutex> lock(close_mu_);
    if (closed_) throw ValueError("the AIO handle is closed; create a new one");
  }
  auto req = std::make_shared<Request>(op, path, buf, nbytes, offset);
  const bool unaligned_edges = !aligned(static_cast<uint64_t>(offset)) || !aligned(nbytes);
  int err = 0;
  std::shared_ptr<OpenFile> file =
      OpenFile::open(path, op, !options_.buffered, unaligned_edges, &err);
  if (!file) {
    req->record_error(err, errno_text(err) + " opening the file");
    req->complete_piece();  // the submission guard: done, with the error
    return req;
  }
  req->set_direct(file->direct());
  const int64_t end = offset + static_cast<int64_t>(nbytes);
  if (op == IOOp::kWrite && file->direct() && nbytes > 0 && end > file->size()) {
    // [Note: preallocation]
    int rc;
    do {
      rc = ::fallocate(file->fd(), 0, offset, static_cast<off_t>(nbytes));
    } while (rc != 0 && errno == EINTR);
    if (rc != 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
      const int e = errno;
      req->record_error(e, errno_text(e) + " allocating " + range_text(offset, nbytes));
      req->complete_piece();
      return req;
    }
  }

  std::vector<Piece> pieces;
  pieces.reserve(nbytes / options_.block_size + 3);
  split(req, file, &pieces);
  req->add_pending(pieces.size());

  // Round-robin over workers, starting where the last request stopped, so that small
  // requests spread too. Each worker gets its share in one enqueue (one lock, one wakeup).
  {
    std::lock_guard<std::mutex> lock(close_mu_);
    if (closed_) throw ValueError("the AIO handle is closed; create a new one");
    const size_t n_workers = workers_.size();
    const size_t start = next_worker_.fetch_add(pieces.size()) % n_workers;
    std::vector<std::vector<Piece>> per_worker(n_workers);
    for (size_t i = 0; i < pieces.size(); ++i) {
      per_worker[(start + i) % n_workers].push_back(std::move(pieces[i]));
    }
    for (size_t w = 0; w < n_workers; ++w) {
      if (!per_worker[w].empty()) workers_[w]->enqueue(std::move(per_worker[w]));
    }
  }
  req->complete_piece();  // drop the submission guard
  return req;
}

}  // namespace offload
