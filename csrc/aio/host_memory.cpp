#include "aio/host_memory.h"

#include <sys/mman.h>

namespace offload {

bool advise_huge_pages(uintptr_t address, size_t nbytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kPage = 4096;
  const uintptr_t begin = (address + kPage - 1) / kPage * kPage;
  const uintptr_t end = (address + nbytes) / kPage * kPage;
  if (end <= begin) return false;
  return ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
#else
  (void)address;
  (void)nbytes;
  return false;
#endif
}

}  // namespace offload
