// MKL's GEMM entry points, from Paddle's libmklml_intel.so, resolved once per process.
//
// The library is opened locally: its symbols must not become global, where they would interpose
// on another MKL in the process (torch's: a crash).

#pragma once

#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <string>

#include "paddle/extension.h"

namespace mkl_api {

// CBLAS constants (mkl_cblas.h).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kBMatrix = 162, kPacked = 151;

struct Functions {
  size_t (*get_size)(int, int, int, int);
  void (*pack)(int, int, int, int, int, int, float, const float*, int, float*);
  void (*compute)(int, int, int, int, int, int, const float*, int, const float*, int, float, float*, int);
  void (*gemm)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
};

// The library at `path`, opened by the first call that names one (later paths are ignored); null
// until then, or when it cannot be opened.
inline void* library(const std::string& path) {
  static std::atomic<void*> opened{nullptr};
  if (opened.load() == nullptr && !path.empty()) opened.store(dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL));
  return opened.load();
}

// `entry` <- the library's symbol `name` (null when the library or the symbol is missing).
template <typename F>
inline void resolve(void* opened, const char* name, F& entry) {
  entry = opened == nullptr ? nullptr : reinterpret_cast<F>(dlsym(opened, name));
}

// The float32 entry points of the library at `path` (see library()).
inline const Functions& functions(const std::string& path = "") {
  static const Functions found = [&] {
    Functions f{};
    void* opened = library(path);
    resolve(opened, "cblas_sgemm_pack_get_size", f.get_size);
    resolve(opened, "cblas_sgemm_pack", f.pack);
    resolve(opened, "cblas_sgemm_compute", f.compute);
    resolve(opened, "cblas_sgemm", f.gemm);
    return f;
  }();
  PD_CHECK(found.get_size && found.pack && found.compute && found.gemm,
           "MKL's cblas_sgemm/cblas_sgemm_pack/compute not found", path.empty() ? "" : " in ", path);
  return found;
}

// MKL's integer GEMM: C (int32) = A (uint8, row-major) times B (int8), B packed once. MKL's names
// say s8u8; it reads A as the unsigned operand and B as the signed one (checked against exact sums).
struct Int8Functions {
  size_t (*get_size)(int, int, int, int);
  void (*pack)(int, int, int, int, int, int, const void*, int, void*);
  void (*compute)(int, int, int, int, int, int, int, float, const void*, int, signed char, const void*, int,
                  signed char, float, int*, int, const int*);
};

// Fixed offset of C (CBLAS_OFFSET), for the integer GEMM.
constexpr int kFixOffset = 173;

// The integer entry points of the library at `path` (see library()).
inline const Int8Functions& int8_functions(const std::string& path = "") {
  static const Int8Functions found = [&] {
    Int8Functions f{};
    void* opened = library(path);
    resolve(opened, "cblas_gemm_s8u8s32_pack_get_size", f.get_size);
    resolve(opened, "cblas_gemm_s8u8s32_pack", f.pack);
    resolve(opened, "cblas_gemm_s8u8s32_compute", f.compute);
    return f;
  }();
  PD_CHECK(found.get_size && found.pack && found.compute,
           "MKL's cblas_gemm_s8u8s32_pack/compute not found", path.empty() ? "" : " in ", path);
  return found;
}

}  // namespace mkl_api
