// Each subsystem binds its own functions into the one module; csrc/binding.cpp calls these.
// Binding code does pointers, sizes and enums only, and releases the GIL around any call
// that can block or run long.
#pragma once

#include <pybind11/pybind11.h>

namespace offload {
void register_common(pybind11::module_& m);
void register_aio(pybind11::module_& m);
void register_adam(pybind11::module_& m);
void register_one_state(pybind11::module_& m);  // Lion, Adagrad (csrc/optim)
void register_adam8bit(pybind11::module_& m);   // 8-bit Adam moments (csrc/adam8bit)
void register_checksum(pybind11::module_& m);
}  // namespace offload
