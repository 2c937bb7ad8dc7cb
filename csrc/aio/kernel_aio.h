// The Linux native AIO system calls, issued directly through syscall(2).
//
// Why not libaio: libaio is a thin user-space wrapper around these five calls, but linking it
// needs the libaio-dev apt package, and a fresh machine must build offload with nothing
// installed by hand. <linux/aio_abi.h> ships with the kernel headers every toolchain has, so
// issuing the calls ourselves costs a few lines and no dependency.
#pragma once

#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>

namespace offload::kernel_aio {

// Each returns what the system call returns: >= 0 on success, -1 with errno set on failure
// (the raw syscall(2) convention; unlike libaio, which returns -errno).
inline int setup(unsigned nr_events, aio_context_t* ctx) {
  return static_cast<int>(syscall(SYS_io_setup, nr_events, ctx));
}

inline int destroy(aio_context_t ctx) { return static_cast<int>(syscall(SYS_io_destroy, ctx)); }

inline int submit(aio_context_t ctx, long nr, struct iocb** iocbs) {
  return static_cast<int>(syscall(SYS_io_submit, ctx, nr, iocbs));
}

inline int getevents(aio_context_t ctx, long min_nr, long max_nr, struct io_event* events,
                     struct timespec* timeout) {
  return static_cast<int>(syscall(SYS_io_getevents, ctx, min_nr, max_nr, events, timeout));
}

}  // namespace offload::kernel_aio
