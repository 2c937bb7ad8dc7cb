// CRC-32C (Castagnoli) of a byte range: the checksum of checkpoint chunks.
//
// Why not zlib's CRC-32: a checkpoint load verifies every byte it reads, and zlib's
// table-driven CRC-32 runs at ~3.8 GB/s per core on the development machine, below a fast
// NVMe disk's read bandwidth; on 2 cores it took ~40% of load time. SSE4.2 has a CRC-32C
// instruction (8 bytes per instruction, 3-cycle latency): one stream runs at ~8 GB/s per
// core, with no tables. A portable slice-by-8 kernel is the fallback (and the reference
// the fast one is tested against).
//
// Convention: crc32c(data, crc) continues a running CRC like zlib.crc32(data, crc): start
// from 0, pass the previous result to continue. The check value of "123456789" is
// 0xE3069283.
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace py = pybind11;

namespace offload {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (int s = 1; s < 8; ++s)
      for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

const Tables& tables() {
  static const Tables tab;
  return tab;
}

uint32_t crc32c_portable(uint32_t c, const uint8_t* p, size_t n) {
  const Tables& tab = tables();
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;
    c = tab.t[7][v & 0xFF] ^ tab.t[6][(v >> 8) & 0xFF] ^ tab.t[5][(v >> 16) & 0xFF] ^
        tab.t[4][(v >> 24) & 0xFF] ^ tab.t[3][(v >> 32) & 0xFF] ^ tab.t[2][(v >> 40) & 0xFF] ^
        tab.t[1][(v >> 48) & 0xFF] ^ tab.t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ tab.t[0][(c ^ *p++) & 0xFF];
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t c, const uint8_t* p, size_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = __builtin_ia32_crc32di(c64, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}

bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc, bool portable) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (!portable && have_sse42()) return ~crc32c_sse42(c, p, n);
#endif
  return ~crc32c_portable(c, p, n);
}

void register_checksum(py::module_& m) {
  m.def(
      "crc32c",
      [](uintptr_t address, size_t nbytes, uint32_t crc, bool portable) {
        py::gil_scoped_release release;  // long for large buffers; touches no Python object
        return crc32c(reinterpret_cast<const void*>(address), nbytes, crc, portable);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0u, py::arg("portable") = false,
      "CRC-32C of nbytes at address, continuing from crc (0 to start); SSE4.2 when the CPU "
      "has it unless portable=True.");
  m.def("crc32c_kernel", [] {
#if defined(__x86_64__)
    return std::string(have_sse42() ? "sse4.2" : "portable");
#else
    return std::string("portable");
#endif
  });
}

}  // namespace offload
