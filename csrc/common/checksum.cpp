// CRC-32C (Castagnoli) of a byte range: the checksum of checkpoint chunks.
//
// Why not zlib's CRC-32: a checkpoint load verifies every byte it reads, and zlib's
// table-driven CRC-32 runs at ~3.8 GB/s per core on the development machine, below a fast
// NVMe disk's read bandwidth; on 2 cores it took ~40% of load time. SSE4.2 has a CRC-32C
// instruction (8 bytes per instruction, 3-cycle latency, one issued per cycle). One stream
// waits on the latency (~6 GB/s on the development VM); three independent streams over
// three adjacent lanes keep the unit busy every cycle, and their CRCs are joined with a
// table that appends a lane's worth of zero bytes to a CRC ([Note: joining lanes]): ~3x,
// close to memory bandwidth. A portable slice-by-8 kernel is the fallback (and the
// reference the fast one is tested against).
//
// [Note: joining lanes]
// The CRC register is linear over GF(2): running a register r over bytes B gives
// f(r, B) = z(r, |B|) ^ f(0, B), where z(r, L) is r run over L zero bytes. So for lanes
// A, B, C of L bytes each, f(r, ABC) = z(z(f(r, A), L) ^ f(0, B), L) ^ f(0, C). z(., L) is
// itself linear in r, so it is four 256-entry tables, one per byte of r (built once from
// the 32 unit vectors). This is the method of Mark Adler's crc32c.c and of storage engines
// (written from the algebra, not copied).
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

constexpr size_t kLane = 8192;  // bytes per lane: the join (8 lookups) costs ~nothing

struct ZeroShift {  // z(r, kLane) as four byte tables (see [Note: joining lanes])
  uint32_t t[4][256];
  ZeroShift() {
    const Tables& tab = tables();
    uint32_t unit[32];
    for (int i = 0; i < 32; ++i) {
      uint32_t r = 1u << i;
      for (size_t k = 0; k < kLane; ++k) r = (r >> 8) ^ tab.t[0][r & 0xFF];
      unit[i] = r;
    }
    for (int b = 0; b < 4; ++b)
      for (uint32_t v = 0; v < 256; ++v) {
        uint32_t r = 0;
        for (int bit = 0; bit < 8; ++bit)
          if (v & (1u << bit)) r ^= unit[8 * b + bit];
        t[b][v] = r;
      }
  }
  uint32_t operator()(uint32_t r) const {
    return t[0][r & 0xFF] ^ t[1][(r >> 8) & 0xFF] ^ t[2][(r >> 16) & 0xFF] ^ t[3][r >> 24];
  }
};

const ZeroShift& zero_shift() {
  static const ZeroShift z;
  return z;
}

// Three lanes of kLane bytes at a time, then one stream for the rest.
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42_3way(uint32_t c, const uint8_t* p, size_t n) {
  if (n >= 3 * kLane) {
    const ZeroShift& z = zero_shift();
    do {
      uint64_t a = c, b = 0, d = 0;
      const uint8_t* q = p;
      for (size_t i = 0; i < kLane; i += 8, q += 8) {
        uint64_t va, vb, vd;
        std::memcpy(&va, q, 8);
        std::memcpy(&vb, q + kLane, 8);
        std::memcpy(&vd, q + 2 * kLane, 8);
        a = __builtin_ia32_crc32di(a, va);
        b = __builtin_ia32_crc32di(b, vb);
        d = __builtin_ia32_crc32di(d, vd);
      }
      c = z(z(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(d);
      p += 3 * kLane;
      n -= 3 * kLane;
    } while (n >= 3 * kLane);
  }
  return crc32c_sse42(c, p, n);
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
  if (!portable && have_sse42()) return ~crc32c_sse42_3way(c, p, n);
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
      "CRC-32C of nbytes at address, continuing from crc (0 to start); SSE4.2 (three "
      "interleaved lanes) when the CPU has it unless portable=True.");
  m.def("crc32c_kernel", [] {
#if defined(__x86_64__)
    return std::string(have_sse42() ? "sse4.2-3way" : "portable");
#else
    return std::string("portable");
#endif
  });
}

}  // namespace offload
