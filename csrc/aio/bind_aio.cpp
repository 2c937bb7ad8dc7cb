// Python binding of the I/O engine: addresses, byte counts and paths in; a request handle
// out. The GIL is released around every call that can block (submit opens the file and may
// preallocate; wait blocks; close drains the queues). offload/io.py is the public face.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "aio/engine.h"
#include "aio/host_memory.h"
#include "common/register.h"

namespace py = pybind11;

namespace offload {

void register_aio(py::module_& m) {
  m.attr("AIO_ALIGNMENT") = kDirectAlignment;
  m.def("advise_huge_pages", &advise_huge_pages, py::arg("address"), py::arg("nbytes"),
        "madvise(MADV_HUGEPAGE) the whole pages of [address, address+nbytes) before first "
        "touch; False if the kernel declines (csrc/aio/host_memory.h).");

  py::class_<Request, std::shared_ptr<Request>>(
      m, "AioRequest",
      "One submitted read or write. Completed on a worker thread; wait() blocks without the "
      "GIL and raises OSError(errno, message, path) if the request failed.")
      .def(
          "wait",
          [](Request& r, double timeout_s) {
            bool done;
            {
              py::gil_scoped_release release;
              done = r.wait_for(timeout_s);
            }
            if (done) r.rethrow();
            return done;
          },
          py::arg("timeout_s") = -1.0,
          "Block until done or timeout_s passes (< 0: no limit). True when done; raises the "
          "request's error if it failed.")
      .def("done", &Request::done, "True once every piece has completed (ok or not).")
      .def_property_readonly("failed", &Request::failed)
      .def_property_readonly("short_read", &Request::short_read,
                             "The failure is a read past the end of the file.")
      .def_property_readonly("error_code", &Request::error_code, "errno of the failure, or 0.")
      .def_property_readonly("direct", &Request::direct,
                             "The file was opened with O_DIRECT (False: buffered I/O).")
      .def_property_readonly("nbytes", &Request::nbytes)
      .def_property_readonly("offset", &Request::offset)
      .def_property_readonly("path", &Request::path);

  py::class_<Engine>(m, "AioEngine",
                     "Worker threads, each with its own kernel AIO context, moving byte ranges "
                     "between memory and files (csrc/aio/engine.h).")
      .def(py::init([](size_t block_size, int queue_depth, int threads, bool buffered,
                       int64_t inject_delay_us) {
             EngineOptions o;
             o.inject_delay_us = inject_delay_us;
             o.block_size = block_size;
             o.queue_depth = queue_depth;
             o.threads = threads;
             o.buffered = buffered;
             return std::make_unique<Engine>(o);
           }),
           py::arg("block_size"), py::arg("queue_depth"), py::arg("threads"),
           py::arg("buffered") = false, py::arg("inject_delay_us") = 0)
      .def(
          "submit",
          [](Engine& e, bool write, uintptr_t address, size_t nbytes, const std::string& path,
             int64_t offset) {
            py::gil_scoped_release release;
            return e.submit(write ? IOOp::kWrite : IOOp::kRead, reinterpret_cast<void*>(address),
                            nbytes, path, offset);
          },
          py::arg("write"), py::arg("address"), py::arg("nbytes"), py::arg("path"),
          py::arg("offset"),
          "Start reading (write=False) into or writing from the nbytes at address. The memory "
          "must stay valid until the returned request is done.")
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>(),
           "Finish everything queued, then stop the workers.")
      .def_property_readonly("block_size", [](const Engine& e) { return e.options().block_size; })
      .def_property_readonly("queue_depth", [](const Engine& e) { return e.options().queue_depth; })
      .def_property_readonly("threads", [](const Engine& e) { return e.options().threads; })
      .def_property_readonly("buffered", [](const Engine& e) { return e.options().buffered; });
}

}  // namespace offload
