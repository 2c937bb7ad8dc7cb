#include "aio/request.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/errors.h"

namespace offload {

const char* errno_name(int err) {
  switch (err) {
    case EPERM: return "EPERM";
    case ENOENT: return "ENOENT";
    case EIO: return "EIO";
    case ENXIO: return "ENXIO";
    case EBADF: return "EBADF";
    case EAGAIN: return "EAGAIN";
    case ENOMEM: return "ENOMEM";
    case EACCES: return "EACCES";
    case EFAULT: return "EFAULT";
    case EBUSY: return "EBUSY";
    case EEXIST: return "EEXIST";
    case ENODEV: return "ENODEV";
    case ENOTDIR: return "ENOTDIR";
    case EISDIR: return "EISDIR";
    case EINVAL: return "EINVAL";
    case EMFILE: return "EMFILE";
    case ENFILE: return "ENFILE";
    case ETXTBSY: return "ETXTBSY";
    case EFBIG: return "EFBIG";
    case ENOSPC: return "ENOSPC";
    case ESPIPE: return "ESPIPE";
    case EROFS: return "EROFS";
    case ENAMETOOLONG: return "ENAMETOOLONG";
    case ELOOP: return "ELOOP";
    case EOPNOTSUPP: return "EOPNOTSUPP";
    case EDQUOT: return "EDQUOT";
    case ESTALE: return "ESTALE";
    case EOVERFLOW: return "EOVERFLOW";
    default: return "errno";
  }
}

namespace {

// What to do about the errors a user can act on; empty for the rest.
const char* hint_for(int err) {
  switch (err) {
    case ENOSPC:
    case EDQUOT: return "; free space on that filesystem or point the offload path at a larger disk";
    case EFBIG: return "; the file would exceed the filesystem's or the process's file-size limit "
                       "(ulimit -f)";
    case EACCES:
    case EPERM: return "; use a directory this process may read and write";
    case EROFS: return "; the filesystem is mounted read-only: use a writable directory";
    case ENOENT: return "; the file does not exist (was it written first?)";
    case EIO: return "; the device reported an I/O error: check the disk (dmesg)";
    default: return "";
  }
}

int open_retry(const char* path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

}  // namespace

std::shared_ptr<OpenFile> OpenFile::open(const std::string& path, IOOp op, bool try_direct,
                                         bool want_buffered, int* err) {
  // Writes create the file but never truncate it: other requests may own other ranges.
  const int flags = O_CLOEXEC | (op == IOOp::kRead ? O_RDONLY : (O_WRONLY | O_CREAT));
  const mode_t mode = 0644;
  std::shared_ptr<OpenFile> f(new OpenFile(path, op));
  if (try_direct) {
    f->fd_ = open_retry(path.c_str(), flags | O_DIRECT, mode);
    if (f->fd_ >= 0) {
      f->direct_ = true;
    } else if (errno == EINVAL) {
      // The filesystem has no O_DIRECT (open(2): "EINVAL ... The filesystem does not support
      // the O_DIRECT flag"). Fall back to buffered I/O; the Python layer warns once.
      f->direct_refused_ = true;
    } else {
      *err = errno;
      return nullptr;
    }
  }
  if (!f->direct_) {
    f->fd_ = open_retry(path.c_str(), flags, mode);
    if (f->fd_ < 0) {
      *err = errno;
      return nullptr;
    }
    f->buffered_fd_ = f->fd_;
    return f;
  }
  if (want_buffered) {
    f->buffered_fd_ = open_retry(path.c_str(), flags, mode);
    if (f->buffered_fd_ < 0) {
      *err = errno;
      return nullptr;  // the destructor closes fd_
    }
  }
  return f;
}

OpenFile::~OpenFile() {
  if (buffered_fd_ >= 0 && buffered_fd_ != fd_) ::close(buffered_fd_);
  if (fd_ >= 0) ::close(fd_);
}

int OpenFile::buffered_fd(int* err) {
  std::lock_guard<std::mutex> lock(mu_);
  if (buffered_fd_ < 0) {
    const int flags = O_CLOEXEC | (op_ == IOOp::kRead ? O_RDONLY : O_WRONLY);
    buffered_fd_ = open_retry(path_.c_str(), flags, 0644);
    if (buffered_fd_ < 0) *err = errno;
  }
  return buffered_fd_;
}

int64_t OpenFile::size() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return -1;
  return static_cast<int64_t>(st.st_size);
}

void Request::add_pending(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_ += n;
}

void Request::record_error(int err, const std::string& detail, bool short_read) {
  std::lock_guard<std::mutex> lock(mu_);
  if (err_ != 0) return;
  err_ = err;
  short_read_ = short_read;
  std::string what = op_ == IOOp::kRead ? "pread of " : "pwrite of ";
  what += std::to_string(nbytes_) + " bytes at offset " + std::to_string(offset_) +
          (op_ == IOOp::kRead ? " from '" : " to '") + path_ + "' failed: " + detail;
  if (!short_read) what += hint_for(err);
  message_ = std::move(what);
  failed_.store(true, std::memory_order_release);
}

void Request::complete_piece() {
  bool now_done = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--pending_ == 0) {
      done_ = true;
      now_done = true;
    }
  }
  if (now_done) cv_.notify_all();
}

bool Request::wait_for(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout_s < 0) {
    cv_.wait(lock, [this] { return done_; });
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return done_; });
}

bool Request::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void Request::rethrow() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_ && err_ != 0) throw IOError(err_, path_, message_);
}

bool Request::short_read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return short_read_;
}

int Request::error_code() const {
  std::lock_guard<std::mutex> lock(mu_);
  return err_;
}

}  // namespace offload
