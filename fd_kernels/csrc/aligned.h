// Scratch buffers on cache-line boundaries. An AMX tile row (64 bytes) that straddles two lines
// costs two accesses: on the AMX Xeon a 2048 x 576 x 3072 bfloat16 GEMM whose inputs sat 16 bytes
// off a line (std::vector's alignment) ran at 40 % of its speed aligned.

#pragma once

#include <cstddef>
#include <new>
#include <vector>

constexpr std::size_t kCacheLine = 64;

template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kCacheLine))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(kCacheLine)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};

// A std::vector whose data starts on a cache line.
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;
