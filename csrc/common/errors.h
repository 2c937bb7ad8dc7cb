// Typed native errors. The binding translates them to Python exceptions:
//   IOError -> OSError(errno, message, filename), ValueError -> ValueError.
// Thrown, never asserted: NDEBUG must not remove a check that guards user data.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace offload {

class IOError : public std::runtime_error {
 public:
  IOError(int err, std::string path, std::string message)
      : std::runtime_error(std::move(message)), err_(err), path_(std::move(path)) {}
  int err() const noexcept { return err_; }
  const std::string& path() const noexcept { return path_; }

 private:
  int err_;
  std::string path_;
};

class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace offload
