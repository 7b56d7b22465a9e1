// The one threading primitive of the CPU code: a parallel loop over independent work items
// (OpenMP when available). Items write disjoint outputs, so results do not depend on the
// thread count or the schedule.
#pragma once

#include <cstdint>
#include <exception>
#include <mutex>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace flashdelta::detail {

inline int resolve_threads(int requested) {
#ifdef _OPENMP
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

// Calls f(i) for i in [0, n). Exceptions thrown by f are re-thrown on the calling thread.
template <class F>
void parallel_for(int64_t n, int num_threads, F&& f) {
  if (n <= 1 || resolve_threads(num_threads) == 1) {  // no thread team for serial work
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(resolve_threads(num_threads))
#endif
  for (int64_t i = 0; i < n; ++i) {
    try {
      f(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace flashdelta::detail
