// Where a forward records ForwardArgs::chunk_states: sequence n's state before its token t
// (t a multiple of kChunkStateTokens) goes to entry first[n] + t / 64, the entries of the
// sequences following each other in order. Shared by validation and the host schedules.
#pragma once

#include <cstdint>
#include <vector>

#include "core/problem.h"

namespace flashdelta::detail {

class ChunkStateEntries {
 public:
  // From the host sequence table (p.seqs).
  explicit ChunkStateEntries(const Problem& p) : first_(p.seqs.size() + 1, 0) {
    for (size_t n = 0; n < p.seqs.size(); ++n)
      first_[n + 1] = first_[n] + chunk_state_count(p.seqs[n].len);
  }
  int64_t total() const { return first_.back(); }
  // The entry of sequence n's state before its token t, or -1 when t is not a chunk start.
  int64_t before(int64_t n, int64_t t) const {
    return t % kChunkStateTokens == 0 ? first_[static_cast<size_t>(n)] + t / kChunkStateTokens
                                      : -1;
  }

 private:
  std::vector<int64_t> first_;
};

}  // namespace flashdelta::detail
