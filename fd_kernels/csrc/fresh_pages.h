// A packed weight's buffer on fresh pages.
//
// MKL sizes a packed matrix for the largest case it may use (cblas_sgemm_pack_get_size gives
// ~11 MiB for a [576, 960] float32 weight of 2.1 MiB) and writes only part of it. The rest keeps
// what the memory held before: where that was freed load-time arrays (the cpu platform's glibc
// keeps freed memory in the heap), those dirty pages stayed resident inside every packed weight for
// the life of the process (0-250 MiB for the default model, from one start to the next). Giving the
// buffer's whole pages back to the kernel before packing leaves resident only the pages the packing
// writes; the others read as zeros, should anything read them.

#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

inline void discard_pages(void* data, std::size_t bytes) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto start = reinterpret_cast<std::uintptr_t>(data);
  const auto first = (start + page - 1) / page * page;   // whole pages inside [data, data + bytes) only
  const auto last = (start + bytes) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}
