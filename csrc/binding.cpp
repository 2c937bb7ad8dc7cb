// The one extension module, offload._C. Only binding here; logic lives in csrc/aio,
// csrc/adam, csrc/optim and csrc/adam8bit. Native exceptions become Python ones with errno
// and filename set.
#include <pybind11/pybind11.h>

#include <cerrno>
#include <cstring>

#include "common/cpu_features.h"
#include "common/errors.h"
#include "common/register.h"

namespace py = pybind11;

namespace offload {

void register_common(py::module_& m) {
  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["avx2"] = f.avx2;
    d["avx512"] = f.avx512;
    d["avx512_bf16"] = f.avx512_bf16;
    d["neon"] = f.neon;
    return d;
  }, "The SIMD features this CPU and OS support, as detected at run time.");
}

}  // namespace offload

PYBIND11_MODULE(_C, m) {
  m.doc() = "offload native core: async O_DIRECT I/O and SIMD CPU Adam, Lion, Adagrad (no torch linkage).";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const offload::IOError& e) {
      // OSError(errno, strerror-ish message, filename) -> Python picks the errno subclass
      // (FileNotFoundError, PermissionError, ...) and sets .errno and .filename.
      py::object exc = py::module_::import("builtins").attr("OSError")(
          e.err(), py::str(e.what()), py::str(e.path()));
      // Raise with the instance's own type (the errno subclass), not plain OSError.
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const offload::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  offload::register_common(m);
  offload::register_aio(m);
  offload::register_adam(m);
  offload::register_one_state(m);
  offload::register_adam8bit(m);
  offload::register_checksum(m);
}
