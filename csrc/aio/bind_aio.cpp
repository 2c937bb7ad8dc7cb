#include "common/register.h"
namespace offload {
void register_aio(pybind11::module_& m) {}
}  // namespace offload
